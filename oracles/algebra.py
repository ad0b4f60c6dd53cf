"""A small algebra of error-carrying values from which kernel bounds are built.

A :class:`Bounded` pairs the exact (float64) value of an intermediate the kernel
computes with a bound on how far the kernel's computed value can be from it. Each
operation returns the exact result and the propagated bound plus its own rounding,
so a kernel's bound reads like the kernel's arithmetic:

    z = dot(value, magnitude, n=K, arith=..., operand_dtype=bf16, order=blocked(bk))
    y = round_to(z, out_dtype, arith)

First-order propagation is made rigorous where it is cheap (exp, rsqrt and division
use the worst point of the error interval, not the derivative at the centre).

Every operation computes in its operands' namespace: numpy on the host, jax.numpy
for device arrays (oracles/numeric.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.oracles.numeric import namespace
from pallascheck.oracles.tolerance import (
    Accumulation,
    Arithmetic,
    largest_finite,
    smallest_normal,
    unit_roundoff,
)


def _f64(value: Any) -> Any:
    """``value`` as float64 in its own namespace (a device array stays on its device)."""
    return namespace(value).asarray(value, dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class Bounded:
    value: np.ndarray  # exact value of the intermediate
    err: np.ndarray  # |computed - value| <= err, elementwise

    @staticmethod
    def exact(value: Any) -> Bounded:
        value = _f64(value)
        return Bounded(value, namespace(value).zeros_like(value))

    @property
    def magnitude(self) -> np.ndarray:
        """Largest possible |computed value|."""
        return namespace(self.value).abs(self.value) + self.err


def operand(value: Any, *, arith: Arithmetic, dtype: Any = np.float32) -> Bounded:
    """An input as the hardware reads it: exact, except that with
    denormals-are-zero a subnormal operand may be read as 0 (error |x|)."""
    value = _f64(value)
    err = subnormal_part(value, dtype) if arith.flush_subnormals else namespace(value).zeros_like(value)
    return Bounded(value, err)


# subnormal_part, rounding and times return an array of their operands' kind: numpy on
# the host, a JAX array on the device
def subnormal_part[A: (np.ndarray, jax.Array)](value: A, dtype: Any = np.float32) -> A:
    """|x| where x is subnormal in ``dtype`` (what denormals-are-zero may drop), else 0.
    A JAX array's in one compiled program (a whole input's, in a streamed oracle run
    operation by operation, would hold its |x| beside the result: oracles/chunks.py)."""
    if isinstance(value, jax.Array):
        return _subnormal_part_of_array(value, smallest_normal(dtype))
    magnitude = np.abs(np.asarray(value, dtype=np.float64))
    return np.where(magnitude < smallest_normal(dtype), magnitude, 0.0)


@jax.jit
def _subnormal_part_of_array(value: jax.Array, tiny: float) -> jax.Array:
    value = jnp.abs(jnp.asarray(value, dtype=np.float64))
    return jnp.where(value < tiny, value, 0.0)


def underflow_floor(dtype: Any, arith: Arithmetic) -> float:
    """Absolute error of one rounding near zero: with flush-to-zero a result below
    the smallest normal may become 0 (error < smallest normal); with gradual
    underflow the subnormal spacing is 2u * smallest normal, half of which is lost."""
    tiny = smallest_normal(dtype)
    return tiny if arith.flush_subnormals else unit_roundoff(dtype) * tiny


def rounding[A: (np.ndarray, jax.Array)](magnitude: A, dtype: Any, arith: Arithmetic) -> A:
    """Error of one rounding of a result of at most ``magnitude``; unbounded where
    the result may overflow to infinity."""
    err = unit_roundoff(dtype) * magnitude + underflow_floor(dtype, arith)
    return namespace(magnitude).where(magnitude <= largest_finite(dtype), err, np.inf)


def times[A: (np.ndarray, jax.Array)](a: A | float, b: A | float) -> A:
    """a * b for non-negative error terms, with 0 * inf = inf: an unbounded error
    means the value may have overflowed to inf, and the kernel's exact zero times it
    is then NaN (IEEE), so the product stays unbounded; ``checks.compare`` admits any
    result under an infinite bound. A NaN factor is kept (a bug in a model to show)."""
    xp = namespace(a, b)
    a, b = xp.asarray(a, dtype=np.float64), xp.asarray(b, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        product = a * b
    return xp.where(xp.isnan(product) & ~xp.isnan(a) & ~xp.isnan(b), np.inf, product)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b for non-negative error terms, with 0 * inf = inf in every product (as
    ``times``). Of non-negative terms only 0 * inf makes a NaN (inf + inf is inf), so
    a NaN entry of the plain product whose row of a and column of b hold no NaN is
    unbounded. (A NaN bound fails every error, the kernel's exact zeros included: a
    linear cross-entropy's dx and dw bounds did in a GPU soak, before 0 * inf had a
    value here.)"""
    xp = namespace(a, b)
    a, b = xp.asarray(a, dtype=np.float64), xp.asarray(b, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        product = a @ b
    nan_in = xp.isnan(a).any(axis=-1)[..., :, None] | xp.isnan(b).any(axis=-2)[..., None, :]
    return xp.where(xp.isnan(product) & ~nan_in, np.inf, product)


def round_to(x: Bounded, dtype: Any, arith: Arithmetic) -> Bounded:
    """One rounding of the computed value to ``dtype`` (u|y| plus the subnormal floor)."""
    return Bounded(x.value, x.err + rounding(x.magnitude, dtype, arith))


def dot(
    value: Any,
    magnitude: Any,
    n: int,
    *,
    arith: Arithmetic,
    operand_dtype: Any,
    order: Accumulation,
    acc_dtype: Any = np.float32,
    flushed_magnitude: Any = 0.0,
) -> Bounded:
    """A length-n dot product accumulated in ``acc_dtype``; ``magnitude = sum|a_i b_i|``.

    ``flushed_magnitude`` = sum of |a_i b_i| over products with a subnormal operand
    (:func:`subnormal_part`): with denormals-are-zero those products may be lost whole.

    Operands the hardware rounds first (f32 -> tf32) perturb each product by
    (1+d1)(1+d2): 2u + u^2 relative. Products of bf16/f16 are exact in f32. The sum
    of n terms then errs by gamma_k(u_acc) times the sum of the (perturbed)
    magnitudes, and each of n products and n - 1 additions may underflow.
    """
    magnitude = _f64(magnitude)
    u_op = arith.operand_unit(operand_dtype)
    operand_rel = 2.0 * u_op + u_op * u_op
    acc = arith.gamma(order.depth(n), arith.mma_unit(acc_dtype))
    floor = 2 * n * underflow_floor(acc_dtype, arith)
    err = times(operand_rel, magnitude) + times(acc, (1.0 + operand_rel) * magnitude) + floor
    if arith.flush_subnormals:
        err = err + _f64(flushed_magnitude)
    return Bounded(_f64(value), err)


def reduce_sum(
    terms: Bounded, axis: int, *, arith: Arithmetic, order: Accumulation, dtype: Any = np.float32
) -> Bounded:
    """Sum computed terms along ``axis`` in ``dtype`` (elementwise IEEE additions)."""
    n = terms.value.shape[axis]
    depth = order.depth(n)
    err = (
        terms.err.sum(axis)
        + times(arith.gamma(depth, unit_roundoff(dtype)), terms.magnitude.sum(axis))
        + max(n - 1, 0) * underflow_floor(dtype, arith)
    )
    return Bounded(terms.value.sum(axis), err)


def add(a: Bounded, b: Bounded, *, arith: Arithmetic, dtype: Any = np.float32) -> Bounded:
    value = a.value + b.value
    err = a.err + b.err
    return Bounded(value, err + rounding(namespace(value).abs(value) + err, dtype, arith))


def multiply(a: Bounded, b: Bounded, *, arith: Arithmetic, dtype: Any = np.float32) -> Bounded:
    """|a^ b^ - ab| <= |a| eb + |b| ea + ea eb, then one rounding."""
    xp = namespace(a.value, b.value, a.err, b.err)
    value = a.value * b.value
    err = times(xp.abs(a.value), b.err) + times(xp.abs(b.value), a.err) + times(a.err, b.err)
    return Bounded(value, err + rounding(xp.abs(value) + err, dtype, arith))


def divide(a: Bounded, b: Bounded, *, arith: Arithmetic, dtype: Any = np.float32) -> Bounded:
    """|a^/b^ - a/b| <= (ea + |a/b| eb) / (|b| - eb); unbounded if b^ may be 0."""
    xp = namespace(a.value, b.value, a.err, b.err)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = a.value / b.value
        room = xp.abs(b.value) - b.err
        err = xp.where(room > 0, (a.err + xp.abs(value) * b.err) / room, np.inf)
    return Bounded(value, err + rounding(xp.abs(value) + err, dtype, arith))


def exp(x: Bounded, *, arith: Arithmetic, dtype: Any = np.float32) -> Bounded:
    """exp(x + d) - exp(x) = exp(x) expm1(d): an absolute error d in the argument is
    a relative error expm1(|d|) ~ d in the result; the exp itself adds its ulps."""
    xp = namespace(x.value, x.err)
    value = xp.exp(x.value)
    with np.errstate(over="ignore", invalid="ignore"):
        propagated = value * xp.expm1(x.err)
        # exp(x) underflowed to 0 while expm1(e) overflowed: the gap itself, exp(x + e) - exp(x)
        propagated = xp.where(xp.isnan(propagated), xp.exp(x.value + x.err) - value, propagated)
    err = propagated + arith.transcendental_rel(dtype) * (value + propagated)
    return Bounded(value, err + underflow_floor(dtype, arith))


def rsqrt(x: Bounded, *, arith: Arithmetic, dtype: Any = np.float32) -> Bounded:
    """rsqrt is decreasing, so over [x - e, x + e] it errs most at x - e."""
    xp = namespace(x.value, x.err)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = 1.0 / xp.sqrt(x.value)
        low = x.value - x.err
        worst = xp.where(low > 0, 1.0 / xp.sqrt(xp.where(low > 0, low, 1.0)), np.inf)
        propagated = worst - value
    err = propagated + arith.transcendental_rel(dtype) * worst
    return Bounded(value, err)


def apply(
    x: Bounded,
    fn: Callable[[np.ndarray], np.ndarray],
    *,
    lipschitz: float,
    evaluation_error: Callable[[np.ndarray], np.ndarray],
) -> Bounded:
    """An elementwise function with Lipschitz constant L, evaluated with an absolute
    error ``evaluation_error(|computed input|)``: error L e + evaluation error."""
    return Bounded(fn(x.value), lipschitz * x.err + evaluation_error(x.magnitude))
