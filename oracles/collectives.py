"""Float64 oracles and error bounds for the distributed kernels (kernels/collectives.py).

The oracle of every collective is the *unsharded* computation in float64; the bound
replays how the sharded kernel (or its ``xla_reference``) actually rounds:

- all-gather moves bits: the bound is 0 (bit-exact);
- all-gather-matmul: each output element is one f32 dot over the full K on one
  device, rounded once: exactly the single-device matmul model (oracles/matmul.py)
  with the order inside the dot unknown (sequential, k = K - 1);
- matmul-reduce-scatter: p partial dots over K/p each, then a sum of the p partials
  in the reduction order of the collective, in the dtype the partials travel in,
  then one rounding to the output dtype. A psum of partials that were *already
  rounded* to a low-precision dtype (what a user writes with ``psum``) adds one
  rounding per partial and does its additions in that dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pallascheck.oracles import algebra
from pallascheck.oracles.matmul import MatmulOracle
from pallascheck.oracles.matmul import oracle as matmul_oracle
from pallascheck.oracles.tolerance import SEQUENTIAL, Arithmetic

F32 = np.float32


def _f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def all_gather_bound(x: Any) -> np.ndarray:
    """A gather copies: every element must be bit-identical."""
    return np.zeros(np.shape(x))


def all_gather_matmul_oracle(x: Any, w: Any) -> MatmulOracle:
    return matmul_oracle(x, w)


def all_gather_matmul_bound(ref: MatmulOracle, *, operand_dtype: Any, out_dtype: Any, arith: Arithmetic) -> np.ndarray:
    """One f32 dot of length K per element (order unknown inside XLA's dot:
    gamma_{K-1}(u32) |x|@|w|; bf16/f16 products exact), rounded once to
    ``out_dtype`` (u_out |y| + the subnormal floor). Sharding only decides which
    device computes which block, not the arithmetic."""
    z = algebra.dot(
        ref.preactivation,
        ref.magnitude,
        ref.k,
        arith=arith,
        operand_dtype=operand_dtype,
        order=SEQUENTIAL,
        flushed_magnitude=ref.flushed_magnitude,
    )
    return algebra.round_to(z, out_dtype, arith).err


@dataclasses.dataclass(frozen=True)
class PartialsOracle:
    """The p partial products of a K-sharded matmul, in float64."""

    out: np.ndarray  # x @ w, the unsharded result
    partial: np.ndarray  # [p, M, N]: x[:, K_d] @ w[K_d, :]
    magnitude: np.ndarray  # [p, M, N]: |x[:, K_d]| @ |w[K_d, :]|
    flushed_magnitude: np.ndarray  # [p, M, N]: the part from products with a subnormal factor
    k_per_part: int


def partials_oracle(x: Any, w: Any, parts: int) -> PartialsOracle:
    """Oracle of ``x @ w`` computed as ``parts`` partial products over equal K chunks."""
    x64, w64 = _f64(x), _f64(w)
    k = x64.shape[1]
    if k % parts:
        raise ValueError(f"K={k} must divide into parts={parts} chunks")
    step = k // parts
    chunks = [slice(d * step, (d + 1) * step) for d in range(parts)]
    sub_x, sub_w = algebra.subnormal_part(x64), algebra.subnormal_part(w64)
    return PartialsOracle(
        out=x64 @ w64,
        partial=np.stack([x64[:, c] @ w64[c] for c in chunks]),
        magnitude=np.stack([np.abs(x64[:, c]) @ np.abs(w64[c]) for c in chunks]),
        flushed_magnitude=np.stack([sub_x[:, c] @ np.abs(w64[c]) + np.abs(x64[:, c]) @ sub_w[c] for c in chunks]),
        k_per_part=step,
    )


def reduce_scattered(
    ref: PartialsOracle, *, operand_dtype: Any, partial_dtype: Any, arith: Arithmetic
) -> algebra.Bounded:
    """The summed partials before the final rounding, as a Bounded.

    Each partial is an f32 dot of K/p terms (order unknown: gamma_{K/p-1}(u32)),
    rounded to ``partial_dtype`` if that is not f32 (one u_partial |partial|); the p
    partials are then added in ``partial_dtype`` in some order (a ring adds them one
    after another; XLA's order is unknown): sequential, gamma_{p-1}(u_partial)
    times the sum of the partials' magnitudes.
    """
    partials = algebra.dot(
        ref.partial,
        ref.magnitude,
        ref.k_per_part,
        arith=arith,
        operand_dtype=operand_dtype,
        order=SEQUENTIAL,
        flushed_magnitude=ref.flushed_magnitude,
    )
    if np.dtype(partial_dtype) != np.dtype(F32):
        partials = algebra.round_to(partials, partial_dtype, arith)
    return algebra.reduce_sum(partials, 0, arith=arith, order=SEQUENTIAL, dtype=partial_dtype)


def matmul_reduce_scatter_bound(
    ref: PartialsOracle, *, operand_dtype: Any, out_dtype: Any, partial_dtype: Any, arith: Arithmetic
) -> np.ndarray:
    """|kernel - x @ w| elementwise: :func:`reduce_scattered`, then one rounding to
    ``out_dtype`` (skipped in the model when the sum is already in ``out_dtype``,
    since the additions in that dtype were counted as roundings)."""
    total = reduce_scattered(ref, operand_dtype=operand_dtype, partial_dtype=partial_dtype, arith=arith)
    if np.dtype(partial_dtype) == np.dtype(out_dtype) and np.dtype(out_dtype) != np.dtype(F32):
        return total.err
    return algebra.round_to(total, out_dtype, arith).err


@dataclasses.dataclass(frozen=True)
class Attribution:
    """Where the model puts the error budget of one output element."""

    observed: float
    bound: float
    accumulation: float  # what the bound allows without the final output rounding
    output_rounding: float  # the final rounding's share: u_out |y| + floor

    @property
    def explained_by_output_rounding(self) -> bool:
        """Within the bound, and beyond what accumulation alone allows: only the
        output rounding can account for it."""
        return self.observed <= self.bound and self.observed > self.accumulation


def attribute_unsharded_bf16(
    ref: MatmulOracle,
    index: tuple[int, int],
    observed: float,
    *,
    other_err: float,
    out_dtype: Any,
    operand_dtype: Any,
    arith: Arithmetic,
) -> Attribution:
    """Attribution for |low - other| at ``index`` where ``low`` is a single-device
    ``x @ w`` rounded to ``out_dtype`` and ``other`` is a more accurate result with
    its own bound ``other_err``: the accumulation part is the dot's error plus
    ``other_err``; the rest is ``out_dtype``'s rounding."""
    z = algebra.dot(
        ref.preactivation[index],
        ref.magnitude[index],
        ref.k,
        arith=arith,
        operand_dtype=operand_dtype,
        order=SEQUENTIAL,
        flushed_magnitude=ref.flushed_magnitude[index],
    )
    rounded = algebra.round_to(z, out_dtype, arith)
    accumulation = float(z.err) + other_err
    return Attribution(
        observed=float(observed),
        bound=float(rounded.err) + other_err,
        accumulation=accumulation,
        output_rounding=float(rounded.err - z.err),
    )
