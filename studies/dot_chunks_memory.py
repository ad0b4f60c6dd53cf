"""Peak host memory and time of one dot-like check's float64 side (oracle, the
implementation bound, the contract, the exact gradients and their bound and
contract), on the host (numpy, as the interpret backend computes them): a benchmark
command, run once per family in a fresh process so that ru_maxrss is its own.

    python studies/dot_chunks_memory.py matmul      # or gated_linear_unit, ragged_dot

Run it with another checkout's interpreter to time that checkout's oracles (the
figures in docs/results.md: before and after oracles/chunks.py)."""

from __future__ import annotations

import resource
import sys
import time

import ml_dtypes
import numpy as np

from pallascheck.kernels.backends import Backend
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties.registry import get_spec
from pallascheck.properties.spec import Case

BF16 = ml_dtypes.bfloat16


def _case(family: str) -> Case:
    """One case per family, twice the span of oracles/chunks.py along its streamed axis."""
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, np.float32).astype(BF16)

    if family == "matmul":  # out 4096 x 8192: two spans of 4096 columns
        m, k, n = 4096, 1024, 8192
        return Case(
            {"x": normal(m, k), "y": normal(k, n), "cotangent": normal(m, n)},
            {"activation": "gelu", "out_dtype": "bfloat16"},
        )
    if family == "gated_linear_unit":  # [t, 2f] 4096 x 8192: two spans of 2048 rows
        t, d, f = 4096, 1024, 4096
        return Case(
            {"x": normal(t, d), "weights": normal(d, 2, f) / 32, "cotangent": normal(t, f)}, {"activation": "silu"}
        )
    if family == "ragged_dot":  # m 65536 of width 512: two spans of 32768 rows, 4 groups
        m, k, n, g = 65536, 512, 512, 4
        sizes = np.array([20000, 0, 30000, 15536], np.int32)
        return Case({"lhs": normal(m, k), "rhs": normal(g, k, n), "group_sizes": sizes, "cotangent": normal(m, n)}, {})
    raise ValueError(f"family must be matmul, gated_linear_unit or ragged_dot, got {family!r}")


def main(family: str) -> None:
    case = _case(family)
    spec, arith = get_spec(family), arithmetic_for(Backend("interpret"))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    ref = spec.oracle(case)
    spec.bound(case, ref, spec.default_config, arith)
    spec.contract(case, ref, arith)
    grads = spec.gradients.oracle_vjp(case, ref)
    spec.gradients.bound(case, ref, grads, spec.default_config, arith)
    spec.gradients.contract(case, ref, grads, arith)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    shapes = " ".join(f"{k}{list(a.shape)}" for k, a in case.arrays.items())
    print(f"{family}: {shapes}: peak {peak / 2**20:.2f} GiB (inputs and imports {base / 2**20:.2f}), {seconds:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1])
