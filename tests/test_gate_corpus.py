"""The gate's corpora: every gaming candidate rejected with its named reason, every
honest candidate accepted (tests/gate_corpus/). ``python -m studies.gate_corpus``
prints the table with the verdict times."""

from __future__ import annotations

import pytest

from pallascheck.bench.gate.judge import gate
from pallascheck.bench.gate.verdict import REASONS
from tests.gate_corpus.gaming import GAMING
from tests.gate_corpus.honest import HONEST


@pytest.mark.parametrize(("task", "name", "reason"), GAMING, ids=[g[1] for g in GAMING])
def test_gaming_candidate_rejected_for_its_reason(task: str, name: str, reason: str) -> None:
    verdict = gate(task, f"tests.gate_corpus.gaming:{name}", drawn=1)
    assert verdict.status == REASONS[reason][0], verdict.summary()
    assert reason in verdict.reason_names, verdict.summary()
    assert verdict.not_checked, "a stopped verdict lists what it did not check"


@pytest.mark.parametrize(("task", "name"), HONEST, ids=[h[1] for h in HONEST])
def test_honest_candidate_accepted(task: str, name: str) -> None:
    verdict = gate(task, f"tests.gate_corpus.honest:{name}", drawn=0)
    assert verdict.passed, verdict.summary()
    assert verdict.worst is not None and verdict.worst["budget_used"] <= 1.0
    assert any("poisoned" in item for item in verdict.not_checked), "the CPU says what it could not poison"
