"""pallascheck: correctness and numerics verification for Pallas kernels.

The code lives in the subpackages ``kernels``, ``oracles``, ``properties``, ``fuzz``
and ``bench``; this package is the short public face and only re-exports
(``pallascheck.specs``: the spec builders for your own kernels; ``autotune``,
``use_configs``, ``AutotuneResult``: autotuning with a numerics gate, from
``bench/autotune.py``; ``gate``, ``Task``, ``Arg``, ``Verdict``: the gate for
generated kernels, from ``bench/gate/``).
"""

from typing import Any

_AUTOTUNE = ("autotune", "use_configs", "AutotuneResult")
_GATE = ("gate", "Task", "Arg", "Verdict")


def __getattr__(name: str) -> Any:
    # Imported on first use: ``import pallascheck.kernels`` runs this file, and the
    # autotuner pulls in the properties and oracles.
    if name in _AUTOTUNE:
        from pallascheck.bench import autotune

        return getattr(autotune, name)
    if name in _GATE:
        from pallascheck.bench.gate import judge, task, verdict

        return {"gate": judge.gate, "Task": task.Task, "Arg": task.Arg, "Verdict": verdict.Verdict}[name]
    raise AttributeError(f"module 'pallascheck' has no attribute {name!r}")
