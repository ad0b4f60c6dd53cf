"""The gate's corpora: honest candidates it must accept and gaming ones it must reject,
each with the reason it must give (tests/test_gate_corpus.py, studies/gate_corpus.py)."""
