"""Float64 oracle and error bounds for elementwise activations ``y = f(x)``, f one of
oracles/activations.py's models, evaluated in a compute dtype c and stored in the
output dtype (x's).

Every output element depends on its own input element alone, and that input is
exact (up to denormals-are-zero reading a subnormal as 0: error |x|, moving f by
L |x|), so the whole error is f's evaluation plus the store:

    y  = f(x) in c          the model's evaluation_error(|x|, u_c, t_c): operations
                            round with unit u_c (u_c + u32 (1 + u_c) below f32, which
                            may round to f32 first), transcendentals err by 3 ulps t_c
    store to the out dtype  c != out: one rounding u_out |y| plus the underflow floor;
                            c == out: the last operation's rounding is the store, only
                            the out dtype's floor is added
    dx = f'(x) g in c       f' errs by derivative_error(u_c, t_c) + max|f''| e_x (relu:
                            1 where x is, or may be read as, 0); times g with its
                            rounding; stored like y

A kernel evaluates in f32 (``compute_dtype="float32"``, also the accuracy contract);
xla_reference in x's own dtype (``compute_dtype=None``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np

from pallascheck.oracles import algebra
from pallascheck.oracles.activations import activation_model
from pallascheck.oracles.gradients import vjp64
from pallascheck.oracles.tolerance import Arithmetic, unit_roundoff

F32 = np.dtype(np.float32)


def _f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def _np_dtype(dtype: Any) -> np.dtype:
    """A numpy dtype from a name ("bfloat16" is ml_dtypes') or a dtype."""
    return np.dtype(getattr(ml_dtypes, dtype) if isinstance(dtype, str) and dtype == "bfloat16" else dtype)


@dataclasses.dataclass(frozen=True)
class ElementwiseOracle:
    out: np.ndarray  # f(x) in float64
    x: np.ndarray  # the input upcast exactly: |x| is what f's evaluation error scales with


def oracle(x: Any, activation: str) -> ElementwiseOracle:
    x = _f64(x)
    return ElementwiseOracle(activation_model(activation).fn(x), x)


def _units(dtype: np.dtype, arith: Arithmetic) -> tuple[float, float]:
    """(u, t): the relative error of one of f's operations evaluated in ``dtype``,
    and of a transcendental. Each result is rounded to ``dtype``; below f32 it may be
    rounded to f32 first (XLA evaluates bf16/f16 operations in f32, and may keep the
    f32 result where excess precision is allowed), and two roundings err by
    (1 + d32)(1 + d) - 1, so u = u_d + u32 (1 + u_d). Transcendentals: 3 ulps of ``dtype``
    (Arithmetic.transcendental_rel), which covers one evaluated in f32 and rounded
    twice (t32 + u (1 + t32) < 2 u_d for bf16 and f16)."""
    u = unit_roundoff(dtype)
    if u > unit_roundoff(F32):
        u = u + unit_roundoff(F32) * (1.0 + u)
    return u, arith.transcendental_rel(dtype)


def _stored(y: algebra.Bounded, compute: np.dtype, out: np.dtype, arith: Arithmetic) -> algebra.Bounded:
    """The result stored in the output dtype. Computed in another dtype: one more
    rounding (u_out |y| plus the underflow floor). Computed in the output dtype: the
    last operation's rounding is the store, already in the evaluation error, whose
    underflow term is f32's; the output dtype's floor is added (f16's is 2^13 times
    f32's smallest normal)."""
    if compute == out:
        return algebra.Bounded(y.value, y.err + algebra.underflow_floor(out, arith))
    return algebra.round_to(y, out, arith)


def _compute_dtype(out_dtype: Any, compute_dtype: Any | None) -> np.dtype:
    """The dtype f is evaluated in: ``compute_dtype``, or the output (x's) dtype for None."""
    return _np_dtype(out_dtype) if compute_dtype is None else _np_dtype(compute_dtype)


def bound(
    ref: ElementwiseOracle, activation: str, *, compute_dtype: Any | None, out_dtype: Any, arith: Arithmetic
) -> np.ndarray:
    """|kernel - oracle| elementwise, for f evaluated in the compute dtype c
    (``compute_dtype``; x's dtype for xla_reference, None):

    x is read exactly, except that a subnormal (in c) may be read as 0 under
    denormals-are-zero (algebra.operand: error |x|, moving f by L |x|). f's
    operations round with unit u_c (``_units``: for xla_reference in bf16/f16 each
    operation rounds to x's dtype, possibly after f32: measured on XLA:CPU, jit and
    op-by-op agree and differ from one final rounding), its transcendentals err by
    t_c: the model's evaluation_error(|x|, u_c, t_c). The result is stored in x's
    dtype (``_stored``). A kernel (``compute_dtype="float32"``) thus errs by
    evaluation_error(|x|, u32, t32) + u_out |y| + floor: f in f32, rounded once.
    """
    out, compute = _np_dtype(out_dtype), _compute_dtype(out_dtype, compute_dtype)
    u, t = _units(compute, arith)
    model = activation_model(activation)
    x = algebra.operand(ref.x, arith=arith, dtype=compute)
    y = algebra.apply(
        x,
        model.fn,
        lipschitz=model.lipschitz,
        evaluation_error=lambda magnitude: model.evaluation_error(magnitude, u, t),
    )
    return _stored(y, compute, out, arith).err


def contract(ref: ElementwiseOracle, activation: str, *, out_dtype: Any, arith: Arithmetic) -> np.ndarray:
    """The accuracy contract: f evaluated in f32 and rounded once to the output dtype
    (the implementation bound at ``compute_dtype="float32"``): what any kernel achieves
    that upcasts, evaluates f with the usual f32 operations and 3-ulp transcendentals,
    and casts back."""
    return bound(ref, activation, compute_dtype=F32, out_dtype=out_dtype, arith=arith)


def oracle_vjp(ref: ElementwiseOracle, activation: str, cotangent: Any) -> dict[str, np.ndarray]:
    """dx = f'(x) g in float64, and the slope f'(x) the bound needs."""
    (slope,) = vjp64(activation_model(activation).fn, (ref.x,), np.ones_like(ref.x))
    return {"dx": slope * _f64(cotangent), "slope": slope}


def gradient_bound(
    ref: ElementwiseOracle,
    activation: str,
    slope: Any,
    cotangent: Any,
    *,
    compute_dtype: Any | None,
    out_dtype: Any,
    arith: Arithmetic,
) -> dict[str, np.ndarray]:
    """|kernel dx - oracle dx| for dx = f'(x) g computed in c = ``compute_dtype``
    (``slope``: the oracle's f'(x), from ``oracle_vjp``):

    f'(x) in c errs by the model's derivative_error(u_c, t_c), plus max|f''| |x| where
    a subnormal x is read as 0; relu's f' jumps at 0, so where x is 0 (or read as 0)
    the slope may be anything in [0, 1] (the oracle's is jax's 1/2): error 1 there, as
    the GLU and matmul gradient bounds treat the kink. The product with g (read like
    x) in c: |f'| e_g + |g| e_f' + e_f' e_g plus its rounding (algebra.multiply); then
    stored in x's dtype (``_stored``: one rounding u_x |dx| plus the floor).
    xla_reference's autodiff graph in bf16/f16 is not this computation (and its f16
    gelu_tanh gradient is NaN for |x| >= 1211, where z * z overflows and meets a zero
    sech^2: measured), so only its forward is checked.
    """
    out, compute = _np_dtype(out_dtype), _compute_dtype(out_dtype, compute_dtype)
    u, t = _units(compute, arith)
    model = activation_model(activation)
    x = algebra.operand(ref.x, arith=arith, dtype=compute)
    if np.isinf(model.curvature):  # f' jumps at 0
        slope_err = np.where(np.abs(ref.x) <= x.err, 1.0, 0.0)
    else:
        slope_err = model.curvature * x.err + model.derivative_error(u, t)
    g = algebra.operand(cotangent, arith=arith, dtype=compute)
    dx = algebra.multiply(algebra.Bounded(slope, slope_err), g, arith=arith, dtype=compute)
    return {"dx": _stored(dx, compute, out, arith).err}


def gradient_contract(
    ref: ElementwiseOracle, activation: str, slope: Any, cotangent: Any, *, out_dtype: Any, arith: Arithmetic
) -> dict[str, np.ndarray]:
    """dx = f'(x) g with f' and the product in f32, rounded once to x's dtype."""
    return gradient_bound(ref, activation, slope, cotangent, compute_dtype=F32, out_dtype=out_dtype, arith=arith)
