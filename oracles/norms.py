"""Float64 oracles and error bounds for layer norm and RMS norm (kernels/norms.py).

The bound replays the kernel's arithmetic step by step with the error algebra
(oracles/algebra.py), per row of D features, in the kernel's compute dtype:

    s1   = sum(x)                  D terms, any order: gamma_{D-1} sum|x|
    mean = s1 / D                  + one rounding
    c    = x - mean                err(mean) + rounding: the variance-cancellation
                                   term; relative to the row's spread it grows
                                   with |mean| / std, which the bound shows honestly
    var  = sum(c * c) / D          products round, then the sum and the division
    rstd = rsqrt(var + eps)        eps itself is rounded to the compute dtype;
                                   rsqrt is evaluated at the worst end of the interval
    y    = (c * rstd) * scale + offset, then one rounding to the output dtype
(RMS norm: ms = sum(x*x)/D replaces mean/var, c = x.)

Backward (same replay): gs = g*scale; m1 = sum(gs)/D; m2 = sum(gs*xhat)/D;
dx = rstd * (gs - m1 - xhat*m2) rounded to x's dtype; dscale = sum over rows of
g*xhat and doffset = sum over rows of g, reduced in blocks of block_rows rows then
across blocks (blocked accumulation), rounded to the parameter dtype.

The kernel computes in f32 (``compute_dtype=float32``). xla_reference computes in
the input dtype: every elementwise step rounds to it and reductions (which jnp
accumulates in f32 for bf16/f16) round once to it, so the same replay with
``compute_dtype`` = the input dtype bounds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from pallascheck.oracles import algebra
from pallascheck.oracles.algebra import Bounded
from pallascheck.oracles.gradients import vjp64
from pallascheck.oracles.tolerance import SEQUENTIAL, Arithmetic, blocked, unit_roundoff

F32 = np.float32


def _f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def reference64(kind: str, x, scale, offset, eps: float):
    """The float64 function (numpy or jax.numpy inputs; used for values and VJPs)."""
    xp = np if isinstance(x, np.ndarray) else jnp
    if kind == "layer_norm":
        mean = xp.mean(x, axis=-1, keepdims=True)
        c = x - mean
        y = c / xp.sqrt(xp.mean(c * c, axis=-1, keepdims=True) + eps) * scale
        return y + offset
    return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


@dataclasses.dataclass(frozen=True)
class NormOracle:
    out: np.ndarray  # float64, x's shape
    kind: str
    x: np.ndarray  # [rows, D]
    scale: np.ndarray  # [D]
    offset: np.ndarray  # [D]
    eps: float


def oracle(kind: str, x: Any, scale: Any, offset: Any, eps: float) -> NormOracle:
    x2 = _f64(x).reshape(-1, np.shape(x)[-1])
    d = x2.shape[1]
    scale64 = np.ones(d) if scale is None else _f64(scale)
    offset64 = np.zeros(d) if offset is None else _f64(offset)
    out = reference64(kind, x2, scale64, offset64, eps).reshape(np.shape(x))
    return NormOracle(out, kind, x2, scale64, offset64, eps)


def _mean(terms: Bounded, *, arith: Arithmetic, dtype: Any) -> Bounded:
    total = algebra.reduce_sum(terms, 1, arith=arith, order=SEQUENTIAL, dtype=np.float32)
    total = algebra.round_to(total, dtype, arith) if np.dtype(dtype) != np.float32 else total
    d = Bounded.exact(np.full_like(total.value, terms.value.shape[1]))
    q = algebra.divide(total, d, arith=arith, dtype=dtype)
    return Bounded(q.value[:, None], q.err[:, None])


VARIANCES = ("two_pass", "one_pass")


def _forward_replay(
    ref: NormOracle, arith: Arithmetic, dtype: Any, variance: str = "two_pass"
) -> tuple[Bounded, Bounded, Bounded]:
    """(c, rstd, xhat) as the kernel computes them, each with its error bound.
    ``variance``: "two_pass" (sum((x - mean)^2) / D, the kernel's) or "one_pass"
    (sum(x^2) / D - mean^2, whose rounding errors scale with E[x^2], not the variance)."""
    if variance not in VARIANCES:
        raise ValueError(f"variance must be one of {VARIANCES}, got {variance!r}")
    x = algebra.operand(ref.x, arith=arith, dtype=dtype)
    kw = dict(arith=arith, dtype=dtype)
    if ref.kind == "layer_norm":
        mean = _mean(x, **kw)
        c = algebra.add(x, Bounded(-mean.value, mean.err), **kw)
        if variance == "two_pass":
            second = _mean(algebra.multiply(c, c, **kw), **kw)
        else:
            square_of_mean = algebra.multiply(mean, mean, **kw)
            second = algebra.add(
                _mean(algebra.multiply(x, x, **kw), **kw), Bounded(-square_of_mean.value, square_of_mean.err), **kw
            )
    else:
        c = x
        second = _mean(algebra.multiply(x, x, **kw), **kw)
    eps = Bounded(np.full_like(second.value, ref.eps), np.full_like(second.value, unit_roundoff(dtype) * ref.eps))
    rstd = algebra.rsqrt(algebra.add(second, eps, **kw), arith=arith, dtype=dtype)
    rstd = algebra.round_to(rstd, dtype, arith)  # rsqrt's own result rounds too
    return c, rstd, algebra.multiply(c, rstd, **kw)


def bound(
    ref: NormOracle, *, out_dtype: Any, arith: Arithmetic, compute_dtype: Any = F32, variance: str = "two_pass"
) -> np.ndarray:
    _, _, xhat = _forward_replay(ref, arith, compute_dtype, variance)
    kw = dict(arith=arith, dtype=compute_dtype)
    y = algebra.multiply(xhat, Bounded.exact(ref.scale[None, :]), **kw)
    if ref.kind == "layer_norm":
        y = algebra.add(y, Bounded.exact(ref.offset[None, :]), **kw)
    return algebra.round_to(y, out_dtype, arith).err


def _norm64(x: Any, scale: Any, offset: Any, kind: str, eps: float) -> Any:
    """``reference64`` with the parameters last, module-level so that gradients.vjp64
    compiles its VJP once per shape."""
    return reference64(kind, x, scale, offset, eps)


def oracle_vjp(ref: NormOracle, cotangent: Any, *, with_offset: bool) -> dict[str, np.ndarray]:
    g = _f64(cotangent).reshape(ref.x.shape)
    dx, dscale, doffset = vjp64(_norm64, (ref.x, ref.scale, ref.offset), g, static=(ref.kind, ref.eps))
    grads = {"dx": dx, "dscale": dscale}
    if with_offset:
        grads["doffset"] = doffset
    return grads


def gradient_bound(
    ref: NormOracle,
    cotangent: Any,
    *,
    x_dtype: Any,
    param_dtype: Any,
    block_rows: int,
    arith: Arithmetic,
    with_offset: bool,
    variance: str = "two_pass",
) -> dict[str, np.ndarray]:
    g = Bounded.exact(_f64(cotangent).reshape(ref.x.shape))
    kw: dict[str, Any] = dict(arith=arith, dtype=F32)
    _, rstd, xhat = _forward_replay(ref, arith, F32, variance)
    gs = algebra.multiply(g, Bounded.exact(ref.scale[None, :]), **kw)
    m2 = _mean(algebra.multiply(gs, xhat, **kw), **kw)
    projection = algebra.multiply(xhat, m2, **kw)
    t = gs
    if ref.kind == "layer_norm":  # the kernel's order: (gs - m1) - xhat*m2
        m1 = _mean(gs, **kw)
        t = algebra.add(t, Bounded(-m1.value, m1.err), **kw)
    t = algebra.add(t, Bounded(-projection.value, projection.err), **kw)
    dx = algebra.round_to(algebra.multiply(rstd, t, **kw), x_dtype, arith)
    order = blocked(block_rows)
    gx = algebra.multiply(g, xhat, **kw)
    dscale = algebra.reduce_sum(gx, 0, arith=arith, order=order, dtype=F32)
    bounds = {"dx": dx.err, "dscale": algebra.round_to(dscale, param_dtype, arith).err}
    if with_offset:
        doffset = algebra.reduce_sum(g, 0, arith=arith, order=order, dtype=F32)
        bounds["doffset"] = algebra.round_to(doffset, param_dtype, arith).err
    return bounds
