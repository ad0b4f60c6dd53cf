"""The gate: a verdict on a candidate kernel for a task (``pallascheck gate``).

A task (``task.py``) is a jax.numpy reference, its input domain and the facts of its
bound; the gate (``judge.py``) checks a candidate against it with the property runner's
checks on drawn shapes, plus integrity checks of its own (``integrity.py``: the work is
in Pallas, no host callbacks; ``probes.py``: no state carried between calls), times it on
a GPU (``speed.py``) and says everything in one ``Verdict`` (``verdict.py``). The
shipped tasks are the modules of ``tasks/``.
"""
