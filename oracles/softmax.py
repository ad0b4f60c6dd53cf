"""Float64 oracle and error bounds for softmax over the last axis.

Notation per row: x_j the inputs (exact, upcast), m = max_j x_j (a max of floats is
exact in any order), d_j = x_j - m <= 0, w_j = exp(d_j), L = sum_j w_j >= 1,
y_j = w_j / L. An input of -inf has w_j = 0 exactly in every implementation. u is
the unit roundoff of a format, t the f32 exp accuracy (``Arithmetic.transcendental_rel``).

Forward bound, step by step (``algebra`` carries each intermediate's exact value and
error; every relative error composes exactly):
1. the shift d_j rounds once in the dtype it is computed in (``shift_dtype``: f32 in
   a kernel that upcasts first, the input dtype in one that subtracts before
   upcasting, as ``jax.nn.softmax`` in the input dtype does): u_c |d_j|;
2. w_j = exp(d_hat_j) in f32: an argument error a is a factor e^a (``algebra.exp``),
   exp adds t, a result below the f32 normals may flush; xla_reference then rounds
   w to its dtype (u_in and that dtype's floor);
3. L = sum_j w_hat_j in f32, in blocks of ``block`` (one block, the whole row, bounds
   every order: the chain n - 1); xla_reference's ``jnp.sum`` accumulates in f32 and
   rounds the sum once to its dtype;
4. y_j = w_hat_j / L_hat: ``algebra.divide`` in f32 plus t|y| (Triton may emit PTX's
   approximate division, within 2 ulp); xla_reference divides in its dtype, and
   step 5 charges it a second rounding there: XLA may form w * (1 / L), two roundings;
5. one rounding of y to the output dtype.
The contract is the kernel's model with the shift in f32 and one block: what a
two-pass softmax that upcasts its inputs achieves. A shift in bf16 costs up to
u_bf16 |d_j| relative in y_j, |d_j| times more than the output's own rounding where
|d_j| > 1, for nothing.

Gradient (dx of sum(y * g)): dx_j = y_j (g_j - c) with c = sum_k g_k y_k, formed
from the forward's output y_hat (error e_k, the forward bound, whether it is saved
or recomputed) either as y (g - c) or as y g - y c (autodiff of the xla_reference).
Both are within
    P = e_j (|g_j| + |c|) + |y_j| err(c) + e_j err(c)
    P + u_c (|y_j| + e_j) (|g_j| + |c| + err(c)) + u_c (|dx_j| + P) + 3 floors,
where the second line is the products' and the subtraction's roundings in the
compute dtype c (bounded by the larger of the two forms' roundings), and
err(c) = sum_k |g_k| e_k + gamma_n(u_c) sum_k |g_k| (|y_k| + e_k) + 2n floors
(n rounded products summed in any order in the compute dtype: the f32 sum of a
kernel, or the input-dtype reduction autodiff emits for the reference). Then one
rounding to the input dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pallascheck.oracles import algebra
from pallascheck.oracles.algebra import Bounded
from pallascheck.oracles.tolerance import SEQUENTIAL, Arithmetic, blocked, unit_roundoff

F32 = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class SoftmaxOracle:
    x: np.ndarray  # inputs, float64, [rows, n]
    shift: np.ndarray  # d = x - max(x) per row (-inf where x is -inf)
    out: np.ndarray  # y = softmax(x), float64, the input's shape

    @property
    def rows(self) -> np.ndarray:
        return self.out.reshape(self.x.shape)


def oracle(x: Any) -> SoftmaxOracle:
    """Softmax of every row (last axis) in float64, from the exact inputs."""
    x64 = np.asarray(x).astype(np.float64)
    rows = x64.reshape(-1, x64.shape[-1])
    shift = rows - rows.max(axis=1, keepdims=True)
    w = np.exp(shift)
    return SoftmaxOracle(rows, shift, (w / w.sum(axis=1, keepdims=True)).reshape(x64.shape))


def _shift(ref: SoftmaxOracle, shift_dtype: Any, arith: Arithmetic) -> Bounded:
    """Step 1: d_hat = fl_c(x - m), exact where x is -inf (w = 0 everywhere)."""
    finite = np.isfinite(ref.shift)
    magnitude = np.where(finite, np.abs(ref.shift), 0.0)
    err = unit_roundoff(shift_dtype) * magnitude + algebra.underflow_floor(shift_dtype, arith)
    return Bounded(ref.shift, np.where(finite, err, 0.0))


def bound(
    ref: SoftmaxOracle, *, dtype: Any, arith: Arithmetic, shift_dtype: Any, block: int | None, reference: bool = False
) -> np.ndarray:
    """|y_hat - y| of a kernel (steps 1-5 of the module docstring) whose shift rounds
    in ``shift_dtype`` and whose row sum runs in blocks of ``block`` (None: one block);
    ``reference``: xla_reference's arithmetic in ``dtype`` instead."""
    t = arith.transcendental_rel(F32)
    w = algebra.exp(_shift(ref, shift_dtype, arith), arith=arith, dtype=F32)
    if reference:
        w = algebra.round_to(w, dtype, arith)
    order = SEQUENTIAL if block is None else blocked(block)
    total = algebra.reduce_sum(w, axis=1, arith=arith, order=order, dtype=F32)
    if reference:
        total = algebra.round_to(total, dtype, arith)
    denominator = Bounded(total.value[:, None], total.err[:, None])
    y = algebra.divide(w, denominator, arith=arith, dtype=dtype if reference else F32)
    if not reference:  # approximate division (step 4)
        y = Bounded(y.value, y.err + t * (np.abs(y.value) + y.err))
    return algebra.round_to(y, dtype, arith).err.reshape(ref.out.shape)


def contract(ref: SoftmaxOracle, *, dtype: Any, arith: Arithmetic) -> np.ndarray:
    """A two-pass softmax that upcasts first: shift in f32, one block."""
    return bound(ref, dtype=dtype, arith=arith, shift_dtype=F32, block=None)


def oracle_vjp(ref: SoftmaxOracle, cotangent: Any) -> np.ndarray:
    """dx = y (g - sum_k g_k y_k), float64 (softmax's VJP in closed form)."""
    g = np.asarray(cotangent).astype(np.float64).reshape(ref.x.shape)
    y = ref.rows
    return (y * (g - np.sum(g * y, axis=1, keepdims=True))).reshape(ref.out.shape)


def gradient_bound(
    ref: SoftmaxOracle, cotangent: Any, forward: np.ndarray, *, dtype: Any, arith: Arithmetic, compute_dtype: Any
) -> np.ndarray:
    """|dx_hat - dx| from an output y_hat within ``forward`` of y, the products, the
    sum and the subtraction in ``compute_dtype`` (module docstring), then one rounding
    to ``dtype``."""
    g = np.asarray(cotangent).astype(np.float64).reshape(ref.x.shape)
    y, e = ref.rows, np.asarray(forward, dtype=np.float64).reshape(ref.x.shape)
    n = y.shape[1]
    u = unit_roundoff(compute_dtype)
    floor = algebra.underflow_floor(compute_dtype, arith)
    absg, absy = np.abs(g), np.abs(y)
    c = np.sum(g * y, axis=1, keepdims=True)
    c_err = (
        np.sum(absg * e, axis=1, keepdims=True)
        + arith.gamma(n, u) * np.sum(absg * (absy + e), axis=1, keepdims=True)
        + 2 * n * floor
    )
    dx = y * (g - c)
    # algebra.times: where the forward bound or c's is unbounded, an exact zero times
    # it stays unbounded (the kernel's 0 * inf is NaN), never a NaN bound
    times = algebra.times
    propagated = times(e, absg + np.abs(c)) + times(absy, c_err) + times(e, c_err)
    # roundings of the computed products y g, y c (or of g - c and its product)
    products = times(absy + e, absg + np.abs(c) + c_err)
    err = propagated + u * products + u * (np.abs(dx) + propagated) + 3 * floor
    return algebra.round_to(Bounded(dx, err), dtype, arith).err.reshape(ref.out.shape)
