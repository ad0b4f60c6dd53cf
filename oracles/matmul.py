"""Float64 oracle and error bound for ``act(x @ y)`` (kernels/matmul.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from pallascheck.oracles import algebra, numeric
from pallascheck.oracles.activations import activation_model
from pallascheck.oracles.gradients import vjp64
from pallascheck.oracles.numeric import f64, xp
from pallascheck.oracles.tolerance import SEQUENTIAL, Arithmetic, unit_roundoff

F32 = xp.float32


@numeric.pytree("k")
@dataclasses.dataclass(frozen=True)
class MatmulOracle:
    out: np.ndarray  # act(x @ y), float64
    preactivation: np.ndarray  # x @ y
    magnitude: np.ndarray  # |x| @ |y| = sum_k |x_ik y_kj|, what the dot error scales with
    flushed_magnitude: np.ndarray  # the part of |x| @ |y| from products with a subnormal factor
    k: int


def oracle(x: Any, y: Any, *, activation: str = "none") -> MatmulOracle:
    x64, y64 = f64(x), f64(y)
    z = x64 @ y64
    return MatmulOracle(
        out=activation_model(activation).fn(z),
        preactivation=z,
        magnitude=xp.abs(x64) @ xp.abs(y64),
        flushed_magnitude=algebra.subnormal_part(x64) @ xp.abs(y64) + xp.abs(x64) @ algebra.subnormal_part(y64),
        k=x64.shape[1],
    )


def _preactivation(ref: MatmulOracle, *, operand_dtype: Any, arith: Arithmetic, block_k: int | None) -> algebra.Bounded:
    order = arith.dot_order(block_k) if block_k else SEQUENTIAL
    return algebra.dot(
        ref.preactivation,
        ref.magnitude,
        ref.k,
        arith=arith,
        operand_dtype=operand_dtype,
        order=order,
        flushed_magnitude=ref.flushed_magnitude,
    )


def bound(
    ref: MatmulOracle,
    *,
    activation: str,
    operand_dtype: Any,
    out_dtype: Any,
    arith: Arithmetic,
    block_k: int | None,
) -> np.ndarray:
    """|kernel - oracle| elementwise.

    z = x @ y: K products (exact for bf16/f16, tf32-rounded f32 on the GPU) summed
    in f32 in blocks of ``block_k`` then across blocks (interpreters), or in one
    chain (GPU, and ``block_k=None`` for an XLA dot of unknown order): gamma_k(u32)
    * |x|@|y|. The activation in f32 adds L * err(z) + its evaluation error
    (oracles/activations.py); rounding to ``out_dtype`` adds u_out |y| plus the
    subnormal floor.
    """
    z = _preactivation(ref, operand_dtype=operand_dtype, arith=arith, block_k=block_k)
    act = activation_model(activation)
    u32, t = unit_roundoff(F32), arith.transcendental_rel(F32)
    y = algebra.apply(z, act.fn, lipschitz=act.lipschitz, evaluation_error=lambda m: act.evaluation_error(m, u32, t))
    return algebra.round_to(y, out_dtype, arith).err


def _matmul64(x: Any, y: Any, activation: str) -> Any:
    """act(x @ y), module-level so that gradients.vjp64 compiles its VJP once per shape."""
    return activation_model(activation).fn(x @ y)


def oracle_vjp(x: Any, y: Any, cotangent: Any, *, activation: str = "none") -> dict[str, np.ndarray]:
    """dx, dy of sum(act(x @ y) * cotangent), and dz = cotangent * act'(x @ y)."""
    dx, dy = vjp64(_matmul64, (x, y), cotangent, static=(activation,))
    (dz,) = vjp64(activation_model(activation).fn, (f64(x) @ f64(y),), cotangent)
    return {"dx": dx, "dy": dy, "dz": dz}


def gradient_bound(
    ref: MatmulOracle,
    grads: dict[str, np.ndarray],
    x: Any,
    y: Any,
    cotangent: Any,
    *,
    activation: str,
    operand_dtype: Any,
    arith: Arithmetic,
    block_k: int | None,
) -> dict[str, np.ndarray]:
    """Bounds on dx and dy of the kernel's backward pass.

    dz = g * act'(z^) in f32: act' moves by <= max|act''| * err(z) (for relu, act'
    flips between 0 and 1 only where |z| <= err(z), costing |g| there) plus its own
    evaluation error, times |g|; the product rounds (u32). dz is rounded to the
    operand dtype, then dx = dz @ y^T (N terms) and dy = x^T @ dz (M terms) are the
    same tiled dot as the forward, whose inputs now carry err(dz):
    err(dx) = err(dz) @ |y|^T + dot error + rounding to x's dtype.
    """
    act = activation_model(activation)
    u32, t = unit_roundoff(F32), arith.transcendental_rel(F32)
    g = f64(cotangent)
    if activation == "none":
        dz_err = xp.zeros_like(g)
    else:
        z_err = _preactivation(ref, operand_dtype=operand_dtype, arith=arith, block_k=block_k).err
        if math.isinf(act.curvature):  # derivative jumps at 0
            slope_err = xp.where(xp.abs(ref.preactivation) <= z_err, 1.0, 0.0)
        else:
            slope_err = act.curvature * z_err + act.derivative_error(u32, t)
        dz_err = xp.abs(g) * slope_err
    dz = algebra.round_to(algebra.Bounded(grads["dz"], dz_err), F32, arith)
    dz = algebra.round_to(dz, operand_dtype, arith)
    x64, y64 = f64(x), f64(y)
    order = arith.dot_order(block_k) if block_k else SEQUENTIAL

    def product(a: algebra.Bounded, b: np.ndarray, exact: np.ndarray, n: int, a_on_left: bool):
        a_abs, a_sub, b_abs, b_sub = a.magnitude, algebra.subnormal_part(a.value), xp.abs(b), algebra.subnormal_part(b)
        mm = algebra.matmul  # dz's error and magnitude are unbounded where it may overflow; y may hold zeros
        if a_on_left:
            propagated, magnitude, flushed = mm(a.err, b_abs), mm(a_abs, b_abs), a_sub @ b_abs + mm(a_abs, b_sub)
        else:
            propagated, magnitude, flushed = mm(b_abs, a.err), mm(b_abs, a_abs), mm(b_sub, a_abs) + b_abs @ a_sub
        d = algebra.dot(
            exact, magnitude, n, arith=arith, operand_dtype=operand_dtype, order=order, flushed_magnitude=flushed
        )
        return algebra.round_to(algebra.Bounded(exact, d.err + propagated), operand_dtype, arith).err

    return {
        "dx": product(dz, y64.T, grads["dx"], y64.shape[1], a_on_left=True),
        "dy": product(dz, x64.T, grads["dy"], x64.shape[0], a_on_left=False),
    }
