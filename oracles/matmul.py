"""Float64 oracle and error bound for ``act(x @ y)`` (kernels/matmul.py)."""

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


@numeric.pytree("k")
@dataclasses.dataclass(frozen=True)
class MatmulOracle:
    out: np.ndarray  # act(x @ y), float64
    preactivation: np.ndarray  # x @ y
    magnitude: np.ndarray  # |x| @ |y| = sum_k |x_ik y_kj|, what the dot error scales with
    flushed_magnitude: np.ndarray  # the part of |x| @ |y| from products with a subnormal factor
    k: int


def oracle(x: Any, y: Any, *, activation: str = "none") -> MatmulOracle:
    """In spans of output columns (oracles/chunks.py): a span's temporaries are its
    [k, span] slices of y and [m, span] outputs, beside x's float64 copies."""
    x64, y64 = f64(x), f64(y)
    x_abs, x_sub = xp.abs(x64), algebra.subnormal_part(x64)
    (m, k), n = x64.shape, y64.shape[1]

    def columns(start: int, stop: int) -> MatmulOracle:
        yc = y64[:, start:stop]
        z, yc_abs = x64 @ yc, xp.abs(yc)
        return MatmulOracle(
            out=activation_model(activation).fn(z),
            preactivation=z,
            magnitude=x_abs @ yc_abs,
            flushed_magnitude=x_sub @ yc_abs + x_abs @ algebra.subnormal_part(yc),
            k=k,
        )

    return chunks.over(columns, n, max(m, k), axis=1)


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
    act = activation_model(activation)
    u32, t = unit_roundoff(F32), arith.transcendental_rel(F32)

    def rows(start: int, stop: int) -> Any:  # elementwise: in spans of rows
        z = _preactivation(chunks.part(ref, start, stop, 0), operand_dtype=operand_dtype, arith=arith, block_k=block_k)
        y = algebra.apply(
            z, act.fn, lipschitz=act.lipschitz, evaluation_error=lambda m: act.evaluation_error(m, u32, t)
        )
        return algebra.round_to(y, out_dtype, arith).err

    return chunks.over(rows, ref.out.shape[0], ref.out.shape[1], axis=0)


def _matmul64(x: Any, y: Any, activation: str) -> Any:
    """act(x @ y), module-level so that gradients.vjp64 compiles its VJP once per shape."""
    return activation_model(activation).fn(x @ y)


def _matmul64_of_y(y: Any, x: Any, activation: str) -> Any:
    """``_matmul64`` with y first: its VJP in y alone."""
    return activation_model(activation).fn(x @ y)


def oracle_vjp(x: Any, y: Any, cotangent: Any, *, activation: str = "none") -> dict[str, np.ndarray]:
    """dx, dy of sum(act(x @ y) * cotangent), and dz = cotangent * act'(x @ y). A row
    of dx and dz depends on its own rows of x and the cotangent, a column of dy on its
    own columns of y and the cotangent: spans of rows and of columns
    (oracles/chunks.py), each span's VJP in its own operand alone."""
    x64, y64, g = f64(x), f64(y), f64(cotangent)
    (m, k), n = x64.shape, y64.shape[1]

    def rows(start: int, stop: int) -> dict[str, Any]:
        xr, gr = x64[start:stop], g[start:stop]
        (dx,) = vjp64(_matmul64, (xr,), gr, constants=(y64,), static=(activation,))
        (dz,) = vjp64(activation_model(activation).fn, (xr @ y64,), gr)
        return {"dx": dx, "dz": dz}

    def columns(start: int, stop: int) -> Any:
        (dy,) = vjp64(_matmul64_of_y, (y64[:, start:stop],), g[:, start:stop], constants=(x64,), static=(activation,))
        return dy

    by_rows = chunks.over(rows, m, max(k, n), axis=0)
    return {"dx": by_rows["dx"], "dy": chunks.over(columns, n, max(m, k), axis=1), "dz": by_rows["dz"]}


def _abs_and_subnormal(a: Any) -> tuple[Any, Any]:
    """|a|^T and a's subnormal part^T in float64, without keeping a float64 copy of a."""
    return xp.abs(f64(a)).T, algebra.subnormal_part(f64(a)).T


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
    err(dx) = err(dz) @ |y|^T + dot error + rounding to x's dtype. dx in spans of
    rows, dy in spans of columns (oracles/chunks.py).
    """
    act = activation_model(activation)
    u32, t = unit_roundoff(F32), arith.transcendental_rel(F32)
    g64 = f64(cotangent)
    order = arith.dot_order(block_k) if block_k else SEQUENTIAL

    def dz_of(ref: MatmulOracle, dz_exact: Any, g: Any) -> algebra.Bounded:
        """dz on a span of rows or columns (elementwise in the oracle, dz and g)."""
        if activation == "none":
            dz_err = xp.zeros_like(g)
        else:
            z_err = _preactivation(ref, operand_dtype=operand_dtype, arith=arith, block_k=block_k).err
            if math.isinf(act.curvature):  # derivative jumps at 0
                slope_err = xp.where(xp.abs(ref.preactivation) <= z_err, 1.0, 0.0)
            else:
                slope_err = act.curvature * z_err + act.derivative_error(u32, t)
            dz_err = xp.abs(g) * slope_err
        dz = algebra.round_to(algebra.Bounded(dz_exact, dz_err), F32, arith)
        return algebra.round_to(dz, operand_dtype, arith)

    def product(a: algebra.Bounded, b_abs: Any, b_sub: Any, exact: Any, n: int, a_on_left: bool):
        a_abs, a_sub = a.magnitude, algebra.subnormal_part(a.value)
        mm = algebra.matmul  # dz's error and magnitude are unbounded where it may overflow; y may hold zeros
        if a_on_left:
            propagated, magnitude, flushed = mm(a.err, b_abs), mm(a_abs, b_abs), a_sub @ b_abs + mm(a_abs, b_sub)
        else:
            propagated, magnitude, flushed = mm(b_abs, a.err), mm(b_abs, a_abs), mm(b_sub, a_abs) + b_abs @ a_sub
        d = algebra.dot(
            exact, magnitude, n, arith=arith, operand_dtype=operand_dtype, order=order, flushed_magnitude=flushed
        )
        return algebra.round_to(algebra.Bounded(exact, d.err + propagated), operand_dtype, arith).err

    (m, k), n = x.shape, y.shape[1]
    yt = _abs_and_subnormal(y)  # once for all spans; then x's

    def rows(start: int, stop: int) -> Any:  # dx[i] from dz[i] and all of y
        span = chunks.part((ref, grads["dz"], grads["dx"]), start, stop, 0)
        return product(dz_of(span[0], span[1], g64[start:stop]), *yt, span[2], n, a_on_left=True)

    dx = chunks.over(rows, m, max(k, n), axis=0)
    xt = _abs_and_subnormal(x)

    def columns(start: int, stop: int) -> Any:  # dy[:, j] from dz[:, j] and all of x
        span = chunks.part((ref, grads["dz"], grads["dy"]), start, stop, 1)
        return product(dz_of(span[0], span[1], g64[:, start:stop]), *xt, span[2], m, a_on_left=False)

    return {"dx": dx, "dy": chunks.over(columns, n, max(m, k), axis=1)}
