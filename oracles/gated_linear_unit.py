"""Float64 oracle and error bounds for ``gated_linear_unit`` (kernels/gated_linear_unit.py).

``out = act(gate) * up`` with ``gate = x @ W[:, 0]`` and ``up = x @ W[:, 1]``. The
oracle returns both projections and their magnitudes ``|x| @ |W[:, j]|`` so that
the bound can replay the kernel: two dot products of the matmul model, the
activation's conditioning, one product and the output rounding.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from pallascheck.oracles import algebra, chunks, numeric
from pallascheck.oracles.activations import activation_model
from pallascheck.oracles.gradients import vjp64
from pallascheck.oracles.numeric import f64, xp
from pallascheck.oracles.tolerance import SEQUENTIAL, Arithmetic, unit_roundoff

F32 = xp.float32


@numeric.pytree("d")
@dataclasses.dataclass(frozen=True)
class GluOracle:
    out: np.ndarray  # act(gate) * up, shape [..., f]
    gate: np.ndarray  # x @ W[:, 0], [T, f] (x's leading axes flattened)
    up: np.ndarray  # x @ W[:, 1], [T, f]
    gate_magnitude: np.ndarray  # |x| @ |W[:, 0]|
    up_magnitude: np.ndarray
    gate_flushed: np.ndarray  # the part of gate_magnitude from products with a subnormal factor
    up_flushed: np.ndarray
    d: int


def oracle(x: Any, weights: Any, *, activation: str) -> GluOracle:
    """In spans of token rows (oracles/chunks.py), beside the weights' float64 copies."""
    x64, w = f64(x), f64(weights)
    x2 = x64.reshape(-1, x64.shape[-1])
    sub = algebra.subnormal_part
    w_abs, w_sub = xp.abs(w), sub(w)
    (t, d), f = x2.shape, w.shape[2]

    def rows(start: int, stop: int) -> GluOracle:
        xr = x2[start:stop]
        xr_abs, xr_sub = xp.abs(xr), sub(xr)
        gate, up = xr @ w[:, 0], xr @ w[:, 1]
        return GluOracle(
            out=activation_model(activation).fn(gate) * up,
            gate=gate,
            up=up,
            gate_magnitude=xr_abs @ w_abs[:, 0],
            up_magnitude=xr_abs @ w_abs[:, 1],
            gate_flushed=xr_sub @ w_abs[:, 0] + xr_abs @ w_sub[:, 0],
            up_flushed=xr_sub @ w_abs[:, 1] + xr_abs @ w_sub[:, 1],
            d=d,
        )

    whole = chunks.over(rows, t, max(d, 2 * f), axis=0)
    return dataclasses.replace(whole, out=whole.out.reshape(x64.shape[:-1] + (f,)))


def _order(arith: Arithmetic, block_k: int | None):
    return arith.dot_order(block_k) if block_k else SEQUENTIAL  # None: XLA, order unknown


def _projections(ref: GluOracle, operand_dtype: Any, arith: Arithmetic, block_k: int | None):
    """gate and up as the kernel's f32 accumulators hold them (d-term dots)."""
    order = _order(arith, block_k)
    gate = algebra.dot(
        ref.gate,
        ref.gate_magnitude,
        ref.d,
        arith=arith,
        operand_dtype=operand_dtype,
        order=order,
        flushed_magnitude=ref.gate_flushed,
    )
    up = algebra.dot(
        ref.up,
        ref.up_magnitude,
        ref.d,
        arith=arith,
        operand_dtype=operand_dtype,
        order=order,
        flushed_magnitude=ref.up_flushed,
    )
    return gate, up


def _activated(gate: algebra.Bounded, activation: str, arith: Arithmetic) -> algebra.Bounded:
    act = activation_model(activation)
    u32, t = unit_roundoff(F32), arith.transcendental_rel(F32)
    return algebra.apply(
        gate, act.fn, lipschitz=act.lipschitz, evaluation_error=lambda m: act.evaluation_error(m, u32, t)
    )


def bound(ref: GluOracle, *, activation: str, operand_dtype: Any, arith: Arithmetic, block_k: int | None) -> np.ndarray:
    """|kernel - oracle| elementwise.

    gate^ and up^ are d-term dots in f32 (blocked by block_k on the interpreters,
    sequential on the GPU and for XLA): e_g = gamma |x| @ |W_0| (+ tf32 operand
    rounding for f32 on the GPU), likewise e_u. The activation in f32 moves by
    e_a = L e_g + eval(|gate| + e_g) (oracles/activations.py: L = max|act'|). The
    f32 product errs by |act(gate)| e_u + |up| e_a + e_a e_u plus one rounding
    u32 |out|; the final rounding to the output dtype adds u_out |out| plus the
    subnormal floor (algebra.multiply, algebra.round_to).
    """
    f = ref.gate.shape[1]
    flat = dataclasses.replace(ref, out=ref.out.reshape(-1, f))

    def rows(start: int, stop: int) -> Any:  # elementwise: in spans of token rows
        gate, up = _projections(chunks.part(flat, start, stop, 0), operand_dtype, arith, block_k)
        out = algebra.multiply(_activated(gate, activation, arith), up, arith=arith, dtype=F32)
        return algebra.round_to(out, operand_dtype, arith).err

    return chunks.over(rows, ref.gate.shape[0], f, axis=0).reshape(ref.out.shape)


# Module-level, with the activation static, so that gradients.vjp64 compiles their
# VJPs once per shape, not once per case.
def _glu64(x: Any, w: Any, activation: str) -> Any:
    return activation_model(activation).fn(x @ w[:, 0]) * (x @ w[:, 1])


def _gated64(gate: Any, up: Any, activation: str) -> Any:
    return activation_model(activation).fn(gate) * up


def _glu64_of_w(w: Any, x: Any, activation: str) -> Any:
    """``_glu64`` with the weights first: its VJP in the weights alone."""
    return _glu64(x, w, activation)


def oracle_vjp(x: Any, weights: Any, cotangent: Any, *, activation: str) -> dict[str, np.ndarray]:
    """dx and dweights of sum(out * cotangent); also dgate and dup (the cotangents of
    the two projections) that the gradient bound needs. A token row of dx, dgate and
    dup depends on its own rows of x and the cotangent, a column of dweights on its
    own columns of the weights and the cotangent: spans of rows and of columns
    (oracles/chunks.py), each span's VJP in its own operand alone."""
    x64, w = f64(x), f64(weights)
    x2, g = x64.reshape(-1, x64.shape[-1]), f64(cotangent).reshape(-1, w.shape[2])
    (t, d), f = x2.shape, w.shape[2]

    def rows(start: int, stop: int) -> dict[str, Any]:
        xr, gr = x2[start:stop], g[start:stop]
        (dx,) = vjp64(_glu64, (xr,), gr, constants=(w,), static=(activation,))
        dgate, dup = vjp64(_gated64, (xr @ w[:, 0], xr @ w[:, 1]), gr, static=(activation,))
        return {"dx": dx, "dgate": dgate, "dup": dup}

    def columns(start: int, stop: int) -> Any:
        (dw,) = vjp64(_glu64_of_w, (w[:, :, start:stop],), g[:, start:stop], constants=(x2,), static=(activation,))
        return dw

    by_rows = chunks.over(rows, t, max(d, 2 * f), axis=0)
    dw = chunks.over(columns, f, 2 * max(t, d), axis=2)
    return {"dx": by_rows["dx"].reshape(x64.shape), "dweights": dw, "dgate": by_rows["dgate"], "dup": by_rows["dup"]}


def gradient_bound(
    ref: GluOracle,
    grads: dict[str, np.ndarray],
    x: Any,
    weights: Any,
    cotangent: Any,
    *,
    activation: str,
    operand_dtype: Any,
    arith: Arithmetic,
    block_k: int | None,
) -> dict[str, np.ndarray]:
    """Bounds on dx and dweights of the kernel's backward pass.

    From the saved f32 accumulators gate^, up^ (errors e_g, e_u as in ``bound``):
    - c = g up^ in f32: |g| e_u + u32 |c|;
    - dgate = act'(gate^) c via act's VJP in f32: act' moves by max|act''| e_g (for
      relu it jumps by 1 where |gate| <= e_g) plus its evaluation error; so
      e_dgate = (|c| + e_c) slope_err + L e_c, then one f32 rounding;
    - dup = g act(gate^) in f32: |g| e_a + u32 |dup|;
    - both rounded to the operand dtype, giving dz = [dgate, dup] as [T, 2f];
    - dx = dz @ W^T (2f terms) and dW = x^T @ dz (T terms) are tiled matmuls whose
      left or right operand carries e_dz: e_dz @ |W|^T (resp. |x|^T @ e_dz) plus the
      dot error on the perturbed magnitudes plus rounding to the operand dtype.
    dx in spans of token rows, dW in spans of columns (oracles/chunks.py).
    """
    act = activation_model(activation)
    u32, t = unit_roundoff(F32), arith.transcendental_rel(F32)
    d, f = weights.shape[0], weights.shape[2]
    g = f64(cotangent).reshape(-1, f)
    t_rows = g.shape[0]
    flat = dataclasses.replace(ref, out=ref.out.reshape(t_rows, f))

    def dz_of(ref: GluOracle, dgate_exact: Any, g: Any) -> tuple[Any, Any]:
        """dz = [dgate, dup] on a span of rows or columns ([r, 2c]: elementwise in the
        oracle, dgate and g), its value and error."""
        gate, up = _projections(ref, operand_dtype, arith, block_k)
        exact_g = algebra.Bounded.exact(g)
        c = algebra.multiply(exact_g, up, arith=arith, dtype=F32)
        if math.isinf(act.curvature):  # act' jumps at 0
            slope_err = xp.where(xp.abs(ref.gate) <= gate.err, 1.0, 0.0)
        else:
            slope_err = act.curvature * gate.err + act.derivative_error(u32, t)
        dgate = algebra.Bounded(dgate_exact, c.magnitude * slope_err + act.lipschitz * c.err)
        dgate = algebra.round_to(algebra.round_to(dgate, F32, arith), operand_dtype, arith)
        dup = algebra.round_to(
            algebra.multiply(exact_g, _activated(gate, activation, arith), arith=arith, dtype=F32), operand_dtype, arith
        )
        r, cols = g.shape
        value = xp.stack([dgate.value, dup.value], axis=1).reshape(r, 2 * cols)
        return value, xp.stack([dgate.err, dup.err], axis=1).reshape(r, 2 * cols)

    sub = algebra.subnormal_part
    order = _order(arith, block_k)

    def product(exact, propagated, magnitude, flushed, n):
        dot = algebra.dot(
            exact, magnitude, n, arith=arith, operand_dtype=operand_dtype, order=order, flushed_magnitude=flushed
        )
        return algebra.round_to(algebra.Bounded(exact, dot.err + propagated), operand_dtype, arith).err

    mm = algebra.matmul  # dz's error and magnitude are unbounded where it may overflow; x and W may hold zeros
    # |W| and W's subnormal part (then x's) once for all spans, no float64 copy kept
    abs_w, sub_w = xp.abs(f64(weights)).reshape(d, 2 * f).T, sub(f64(weights)).reshape(d, 2 * f).T

    def rows(start: int, stop: int) -> Any:  # dx[i] from dz[i] and all of W
        ref_span, dgate, dx = chunks.part((flat, grads["dgate"], grads["dx"].reshape(t_rows, d)), start, stop, 0)
        dz_value, dz_err = dz_of(ref_span, dgate, g[start:stop])
        dz_mag = xp.abs(dz_value) + dz_err
        return product(
            dx,
            mm(dz_err, abs_w),
            mm(dz_mag, abs_w),
            sub(dz_value) @ abs_w + mm(dz_mag, sub_w),
            2 * f,
        )

    dx = chunks.over(rows, t_rows, max(d, 2 * f), axis=0)
    abs_x, sub_x = xp.abs(f64(x)).reshape(t_rows, d).T, sub(f64(x)).reshape(t_rows, d).T

    def columns(start: int, stop: int) -> Any:  # dW[:, :, j] from dz[:, j] and all of x
        ref_span, dgate = chunks.part((flat, grads["dgate"]), start, stop, 1)
        dz_value, dz_err = dz_of(ref_span, dgate, g[:, start:stop])
        dz_mag = xp.abs(dz_value) + dz_err
        dw = product(
            chunks.part(grads["dweights"], start, stop, 2).reshape(d, 2 * (stop - start)),
            mm(abs_x, dz_err),
            mm(abs_x, dz_mag),
            mm(sub_x, dz_mag) + abs_x @ sub(dz_value),
            t_rows,
        )
        return dw.reshape(d, 2, stop - start)

    return {"dx": dx.reshape(x.shape), "dweights": chunks.over(columns, f, 2 * max(t_rows, d), axis=2)}
