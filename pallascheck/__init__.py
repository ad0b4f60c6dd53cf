"""pallascheck: correctness and numerics verification for Pallas kernels.

The code lives in the subpackages ``kernels``, ``oracles``, ``properties``, ``fuzz``
and ``bench``; this package is the short public face and only re-exports
(``pallascheck.specs``: the spec builders for your own kernels; ``autotune``,
``use_configs``, ``AutotuneResult``: autotuning with a numerics gate, from
``bench/autotune.py``).
"""

from typing import Any

_AUTOTUNE = ("autotune", "use_configs", "AutotuneResult")


def __getattr__(name: str) -> Any:
    # Imported on first use: ``import pallascheck.kernels`` runs this file, and the
    # autotuner pulls in the properties and oracles.
    if name in _AUTOTUNE:
        from pallascheck.bench import autotune

        return getattr(autotune, name)
    raise AttributeError(f"module 'pallascheck' has no attribute {name!r}")
