"""pallascheck: correctness and numerics verification for Pallas kernels.

The code lives in the subpackages ``kernels``, ``oracles``, ``properties``, ``fuzz``
and ``bench``; this package is the short public face and only re-exports
(``pallascheck.specs``: the spec builders for your own kernels).
"""
