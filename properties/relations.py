"""Metamorphic relations shared by kernel specs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from pallascheck.kernels.backends import Backend
from pallascheck.oracles.tolerance import Arithmetic, arithmetic_for
from pallascheck.properties.device import layout_programs
from pallascheck.properties.spec import Case, Relation


def row_permutation(
    rows_of: Sequence[str],
    run: Callable[[Case, Any, Backend], Any],
    bound: Callable[[Case, Any, Backend], np.ndarray],
) -> Relation:
    """f(P x) = P f(x) for kernels whose output rows depend only on the same input
    rows (``rows_of``: the arrays permuted along axis 0). Each side is within its
    bound of the same oracle row, so they agree within twice the bound."""

    def relation(case: Case, config: Any, backend: Backend, out: np.ndarray):
        n = case.arrays[rows_of[0]].shape[0]
        perm = np.random.default_rng(n).permutation(n)
        permuted = Case({k: (v[perm] if k in rows_of else v) for k, v in case.arrays.items()}, case.params)
        lhs = np.asarray(layout_programs.run_kernel(run, permuted, config, backend))
        rhs = np.asarray(out)[perm].astype(np.float64)
        return lhs, rhs, 2.0 * bound(case, config, backend)[perm]

    return Relation("row_permutation", relation)


def invariance_within_contract(
    name: str,
    run: Callable[[Case, Any, Backend], Any],
    move: Callable[[Case], Case | None],
    oracle: Callable[[Case], Any],
    contract: Callable[[Case, Any, Arithmetic], np.ndarray],
) -> Relation:
    """f(move(case)) = f(case) for an op invariant to ``move`` in real arithmetic (a
    constant added to a row of logits, to a row of layer-norm inputs). The moved
    inputs are rounded to their dtype, so the exact outputs of the two cases differ by
    that rounding's effect, which the oracle gives (``oracle(case).out``); each side
    may be off by its accuracy contract. ``move`` returns None where it does not
    apply without another compiled kernel: the output is then compared with itself."""

    def relation(case: Case, config: Any, backend: Backend, out: np.ndarray):
        moved = move(case)
        if moved is None:
            return np.asarray(out), np.asarray(out).astype(np.float64), np.float64(0.0)
        arith = arithmetic_for(backend)
        ref, ref_moved = oracle(case), oracle(moved)
        allowed = contract(case, ref, arith) + contract(moved, ref_moved, arith) + np.abs(ref_moved.out - ref.out)
        return np.asarray(layout_programs.run_kernel(run, moved, config, backend)), np.asarray(out), allowed

    return Relation(name, relation)


# Products and partial sums of a power-of-two scaled dot stay exact in f32 when the
# smallest nonzero product is at least 2^-90 (partial sums then cancel to no less than
# its ulp, 2^-113, still normal in f32) and |x| @ |y|, scaled, stays below a quarter
# of the output dtype's largest finite value. The rounding to the output dtype
# commutes with the scaling where the output is normal: every nonzero output must be,
# and a zero output is the f32 sum's exact 0 only where the output dtype reaches down
# to 2^-113 (f32, bf16; not f16, where a tiny sum also rounds to 0).
_SMALLEST_PRODUCT = 2.0**-90


def _scales_exactly(v: np.ndarray, factor: float) -> bool:
    """v * factor is exact in v's dtype (no overflow, no bit lost below the normals)."""
    exact = v.astype(np.float64) * factor
    with np.errstate(over="ignore"):
        return bool(np.array_equal(exact.astype(v.dtype).astype(np.float64), exact))


def _exactly_scalable(a: np.ndarray, b: np.ndarray, a_factor: float, b_factor: float, out: np.ndarray) -> bool:
    if not (_scales_exactly(a, a_factor) and _scales_exactly(b, b_factor)):
        return False
    out_dtype = out.dtype
    info = ml_dtypes.finfo(out_dtype)
    magnitude = np.abs(out.astype(np.float64))
    if (magnitude[magnitude > 0] < float(info.smallest_normal)).any():
        return False
    if float(info.smallest_normal) > 2.0**-113 and (magnitude == 0).any():
        return False
    a64, b64 = np.abs(a.astype(np.float64)) * a_factor, np.abs(b.astype(np.float64)) * b_factor
    smallest = a64[a64 > 0].min(initial=np.inf) * b64[b64 > 0].min(initial=np.inf)
    largest = float((a64 @ b64).max(initial=0.0))
    return bool(smallest >= _SMALLEST_PRODUCT and largest <= float(ml_dtypes.finfo(np.dtype(out_dtype)).max) / 4)


def power_of_two_scaling(
    run: Callable[[Case, Any, Backend], Any],
    lhs: str,
    rhs: str,
    homogeneous: Callable[[Case], bool],
) -> Relation:
    """Scaling by powers of two is exact in floating point (no rounding changes while
    everything stays normal), so for a dot-like kernel of ``lhs`` @ ``rhs``:
    f(2 lhs, 2 rhs) = 4 f(lhs, rhs) bitwise where the output is positively homogeneous
    (``homogeneous(case)``: no activation, or relu), and f(2 lhs, rhs / 2) = f(lhs, rhs)
    bitwise for any activation (every product is unchanged). A case whose values sit
    near the ends of the range (subnormal, huge) is compared with itself: the scaling
    would change its roundings, and the relation claims nothing there."""

    def relation(case: Case, config: Any, backend: Backend, out: np.ndarray):
        a, b = case.arrays[lhs], case.arrays[rhs]
        b_scale = 2.0 if homogeneous(case) else 0.5
        factor = 2.0 * b_scale
        if not _exactly_scalable(a, b, 2.0, b_scale, np.asarray(out)):
            return np.asarray(out), np.asarray(out).astype(np.float64), np.float64(0.0)
        scaled = Case(
            {
                **case.arrays,
                lhs: (a.astype(np.float64) * 2).astype(a.dtype),
                rhs: (b.astype(np.float64) * b_scale).astype(b.dtype),
            },
            case.params,
        )
        got = np.asarray(layout_programs.run_kernel(run, scaled, config, backend)).astype(np.float64)
        return got, np.asarray(out).astype(np.float64) * factor, np.float64(0.0)

    return Relation("power_of_two_scaling", relation)
