"""Float64 oracle and error bounds for ``ragged_dot`` (kernels/ragged_dot.py).

The oracle multiplies each group separately in float64: rows of group i times
rhs[i]; rows past sum(group_sizes) are exactly 0. Every output and gradient element
is one dot product of the matmul model (oracles/matmul.py, oracles/algebra.py):
products exact for bf16/f16 (tf32-rounded f32 on the GPU), summed in f32 in the
kernel's order, rounded once to the input dtype.

The oracle, the bounds and dlhs run in spans of token rows, each with the groups'
ranges clipped to it; drhs and its bound group by group (oracles/chunks.py), each
group's sum over all m rows whole (rows of other groups add exact zeros).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pallascheck.oracles import algebra, chunks, numeric
from pallascheck.oracles.numeric import f64, xp
from pallascheck.oracles.tolerance import SEQUENTIAL, Arithmetic, unit_roundoff


def group_ranges(group_sizes: Any, m: int) -> list[tuple[int, int]]:
    """[start, end) of each group's rows, in order."""
    ends = np.cumsum(np.asarray(group_sizes, dtype=np.int64))
    if ends.size and ends[-1] > m:
        raise ValueError(f"sum(group_sizes)={int(ends[-1])} exceeds m={m}")
    starts = np.concatenate([[0], ends[:-1]])
    return [(int(s), int(e)) for s, e in zip(starts, ends)]


@numeric.pytree("ranges", "k")
@dataclasses.dataclass(frozen=True)
class RaggedDotOracle:
    out: np.ndarray  # [m, n] float64
    magnitude: np.ndarray  # sum_k |lhs_rk rhs_gkn| per output element (0 for rows in no group)
    flushed_magnitude: np.ndarray  # the part of ``magnitude`` from products with a subnormal factor
    ranges: tuple[tuple[int, int], ...]
    k: int


def oracle(lhs: Any, rhs: Any, group_sizes: Any) -> RaggedDotOracle:
    x, w = f64(lhs), _Groups(rhs)
    ranges = group_ranges(group_sizes, x.shape[0])
    sub = algebra.subnormal_part
    w_abs, w_sub = _Groups(rhs, xp.abs), _Groups(rhs, sub)

    def rows(start: int, stop: int) -> tuple[Any, Any, Any]:
        span, xs = _clipped(ranges, start, stop), x[start:stop]
        out = _by_group(span, xs, lambda i, rows: rows @ w[i])
        magnitude = _by_group(span, xs, lambda i, rows: xp.abs(rows) @ w_abs[i])
        flushed = _by_group(span, xs, lambda i, rows: sub(rows) @ w_abs[i] + xp.abs(rows) @ w_sub[i])
        return out, magnitude, flushed

    out, magnitude, flushed = chunks.over(rows, x.shape[0], max(x.shape[1], w.shape[2]), axis=0)
    return RaggedDotOracle(out, magnitude, flushed, tuple(ranges), x.shape[1])


class _Groups:
    """rhs group by group in float64 (``fn`` of it): never the whole [g, k, n] in
    float64, which at DeepSeek-V3's 256 experts is 3.8 GB per copy."""

    def __init__(self, rhs: Any, fn: Callable[[Any], Any] = lambda a: a) -> None:
        self.rhs, self.fn, self.shape = rhs, fn, rhs.shape

    def __getitem__(self, i: int) -> Any:
        return self.fn(f64(self.rhs[i]))


def _clipped(ranges: Sequence[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """The groups' ranges within rows [start, stop), counted from ``start`` (a group
    outside the span is empty)."""
    return [(min(max(s, start), stop) - start, min(max(e, start), stop) - start) for s, e in ranges]


def _group_rows(ranges: Sequence[tuple[int, int]], i: int, a: Any) -> Any:
    """``a`` with the rows outside group ``i`` zeroed. Every group's product then has
    the same shape: on a device each operation compiles once, not once per group size
    (a layout of 256 groups compiled for minutes), and the zeroed rows add exact
    zeros to every float64 sum."""
    s, e = ranges[i]
    rows = np.arange(a.shape[0])
    return xp.where(xp.asarray((rows >= s) & (rows < e))[:, None], a, 0.0)


def _by_group(ranges: Sequence[tuple[int, int]], x: Any, product: Callable[[int, Any], Any]) -> Any:
    """Rows of group i from ``product(i, x's rows of group i, others zero)``, for every
    group; rows in no group are 0."""
    total = None
    for i, (s, e) in enumerate(ranges):
        if e > s:
            part = product(i, _group_rows(ranges, i, x))
            total = part if total is None else total + part  # each row is nonzero in one part only: exact
    return xp.zeros((x.shape[0], product(0, x[:0]).shape[1])) if total is None else total


def _order(arith: Arithmetic, block_k: int | None):
    return arith.dot_order(block_k) if block_k else SEQUENTIAL  # None: XLA, order unknown


def bound(ref: RaggedDotOracle, *, operand_dtype: Any, arith: Arithmetic, block_k: int | None) -> np.ndarray:
    """|kernel - oracle| elementwise.

    A row of group i is the K-term dot lhs[r] @ rhs[i] summed in f32 in blocks of
    block_k (the kernel's K loop; sequential for the GPU's fed-back MMA and for
    XLA): gamma_depth(u32) |lhs[r]| @ |rhs[i]| (+ 2u_tf32 for f32 on the GPU),
    plus rounding to the input dtype. The kernel adds exact zeros from the other
    groups of its row tile (masked rows), which cost nothing. Rows in no group are
    exactly 0 (their bound is the underflow floor only).
    """
    return _rows_bound(ref, operand_dtype=operand_dtype, arith=arith, block_k=block_k)


def _rows_bound(
    ref: RaggedDotOracle, *, operand_dtype: Any, arith: Arithmetic, block_k: int | None, rhs_rounding: float = 0.0
) -> Any:
    """``bound``, in spans of rows (elementwise), for an rhs whose every element may have
    moved by ``rhs_rounding`` of itself before the dot (``dequantised_rhs_bound``)."""

    def rows(start: int, stop: int) -> Any:
        span = chunks.part(ref, start, stop, 0)
        z = algebra.dot(
            span.out,
            (1.0 + rhs_rounding) * span.magnitude,
            span.k,
            arith=arith,
            operand_dtype=operand_dtype,
            order=_order(arith, block_k),
            flushed_magnitude=span.flushed_magnitude,
        )
        if rhs_rounding:
            z = algebra.Bounded(z.value, z.err + algebra.times(rhs_rounding, span.magnitude))
        return algebra.round_to(z, operand_dtype, arith).err

    return chunks.over(rows, ref.out.shape[0], ref.out.shape[1], axis=0)


def dequantised_rhs_bound(
    ref: RaggedDotOracle, *, operand_dtype: Any, arith: Arithmetic, block_k: int | None
) -> np.ndarray:
    """``bound`` for a kernel whose rhs arrives quantised (integer q, a scale per block)
    and is dequantised in registers to ``operand_dtype`` before the tensor core: ``ref``
    is the oracle on the exactly dequantised rhs (q * scale in float64). The integers
    are exact in ``operand_dtype`` (|q| <= 128 needs 8 significant bits, bf16's count),
    so ``q * scale`` rounds once: every rhs element moves by at most u |q s|, every
    output by at most u M (M = |lhs| @ |q s|), and the dot then runs on a magnitude of
    at most (1 + u) M; the result is rounded once to ``operand_dtype``."""
    return _rows_bound(
        ref, operand_dtype=operand_dtype, arith=arith, block_k=block_k, rhs_rounding=unit_roundoff(operand_dtype)
    )


def oracle_vjp(lhs: Any, rhs: Any, group_sizes: Any, cotangent: Any) -> dict[str, np.ndarray]:
    """The op is linear in lhs and in rhs, so its VJP is two grouped products:
    dlhs[rows_i] = g[rows_i] @ rhs[i]^T and drhs[i] = lhs[rows_i]^T @ g[rows_i]."""
    x, w, g = f64(lhs), _Groups(rhs), f64(cotangent)
    ranges = group_ranges(group_sizes, x.shape[0])

    def rows(start: int, stop: int) -> Any:
        return _by_group(_clipped(ranges, start, stop), g[start:stop], lambda i, rows: rows @ w[i].T)

    dlhs = chunks.over(rows, x.shape[0], max(x.shape[1], w.shape[2]), axis=0)
    # a group's rows of g, the narrower operand, others zero: the same products, exact zeros elsewhere
    xt = x.T  # once: on a device an eager transpose is a copy of lhs
    drhs = chunks.stacked(lambda i: xt @ _group_rows(ranges, i, g), len(ranges), x.shape[1] * g.shape[1])
    return {"dlhs": dlhs, "drhs": drhs}


def gradient_bound(
    ref: RaggedDotOracle,
    grads: dict[str, np.ndarray],
    lhs: Any,
    rhs: Any,
    cotangent: Any,
    *,
    operand_dtype: Any,
    arith: Arithmetic,
    block_k: int | None,
    block_rows: int | None = None,
) -> dict[str, np.ndarray]:
    """Bounds on dlhs and drhs; the cotangent (in the input dtype) is exact.

    dlhs[r] = g[r] @ rhs[i]^T: an n-term dot in block_k chunks, as the forward.
    drhs[i] = lhs_i^T @ g_i: an n_i-term dot over the group's rows. The kernel walks
    row tiles of ``block_rows`` (default block_k) aligned to its multiples, so a group
    starting at s spans ceil((s mod block_rows + n_i) / block_rows) chunks of at most
    block_rows terms: blocked depth of n_i + (s mod block_rows) terms bounds it (exact
    zeros from masked rows cost nothing). XLA's order is unknown: sequential over
    n_i. Both round once to the input dtype.
    """
    w, g = _Groups(rhs), f64(cotangent)
    order = _order(arith, block_k)
    block_rows = block_k if block_rows is None else block_rows
    row_order = _order(arith, block_rows)
    sub = algebra.subnormal_part
    w_abs, w_sub = _Groups(rhs, xp.abs), _Groups(rhs, sub)

    def dlhs_rows(start: int, stop: int) -> Any:
        span, gs = _clipped(ref.ranges, start, stop), g[start:stop]
        dlhs = algebra.dot(
            chunks.part(grads["dlhs"], start, stop, 0),
            _by_group(span, gs, lambda i, rows: xp.abs(rows) @ w_abs[i].T),
            w.shape[2],
            arith=arith,
            operand_dtype=operand_dtype,
            order=order,
            flushed_magnitude=_by_group(span, gs, lambda i, rows: sub(rows) @ w_abs[i].T + xp.abs(rows) @ w_sub[i].T),
        )
        return algebra.round_to(dlhs, operand_dtype, arith).err

    dlhs = chunks.over(dlhs_rows, lhs.shape[0], max(lhs.shape[1], w.shape[2]), axis=0)
    x_abs_t, x_sub_t = xp.abs(f64(lhs)).T, sub(f64(lhs)).T  # once for every group, no float64 copy kept

    def drhs_err(i: int, s: int, e: int) -> Any:
        terms = (e - s) + (s % block_rows if block_rows else 0)
        gi = _group_rows(ref.ranges, i, g)  # the narrower operand zeroed outside the group, as oracle_vjp
        gi_abs = xp.abs(gi)
        d = algebra.dot(
            chunks.part(grads["drhs"], i, i + 1, 0)[0],
            x_abs_t @ gi_abs,
            terms,
            arith=arith,
            operand_dtype=operand_dtype,
            order=row_order,
            flushed_magnitude=x_sub_t @ gi_abs + x_abs_t @ sub(gi),
        )
        return algebra.round_to(d, operand_dtype, arith).err

    width = lhs.shape[1] * g.shape[1]
    drhs = chunks.stacked(lambda i: drhs_err(i, *ref.ranges[i]), len(ref.ranges), width)
    return {"dlhs": dlhs, "drhs": drhs}
