"""Float64 activations and the constants their error bounds need.

For each activation ``f`` computed in f32 by a kernel epilogue:
- ``lipschitz``: max |f'| (an error e in the input moves the output by <= L e);
- ``evaluation_error(|z|, u, t)``: absolute error of evaluating f in f32 with
  unit roundoff u and transcendental relative accuracy t (derivations inline);
- ``curvature``: max |f''|, for the error of f'(z) in the backward pass;
- ``derivative_error(u, t)``: absolute error of evaluating f' in f32.
Constants are maxima of the exact functions, rounded up (checked on a dense grid
by the tests). Every evaluation error includes ``_FLUSH``: a result that
underflows may be flushed to zero, losing up to the smallest normal f32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import erf as jax_erf
from scipy.special import erf as scipy_erf
from scipy.special import expit as scipy_expit

_SQRT_HALF = 0.7071067811865476
_FLUSH = float(np.finfo(np.float32).tiny)
_SQRT_2_OVER_PI = 0.7978845608028654


@dataclasses.dataclass(frozen=True)
class ActivationModel:
    fn: Callable  # works on numpy float64 and on jax float64 arrays (for oracle VJPs)
    lipschitz: float
    evaluation_error: Callable[[np.ndarray, float, float], np.ndarray]
    curvature: float  # max |f''|; inf when f' jumps (relu)
    derivative_error: Callable[[float, float], float]


def _xp(z):
    """numpy for float64 oracle values, jax.numpy when traced for an oracle VJP."""
    return np if isinstance(z, (np.ndarray, np.generic, float)) else jnp


def _gelu(z):
    erf = scipy_erf if _xp(z) is np else jax_erf
    return 0.5 * z * (1.0 + erf(z * _SQRT_HALF))


def _gelu_tanh(z):
    xp = _xp(z)
    return 0.5 * z * (1.0 + xp.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)))


def _sigmoid(z):  # overflow-free forms: 1/(1+exp(-z)) has NaN gradients for z < -709
    return scipy_expit(z) if _xp(z) is np else jax.nn.sigmoid(z)


ACTIVATION_MODELS: dict[str, ActivationModel] = {
    "none": ActivationModel(lambda z: z, 1.0, lambda m, u, t: 0.0 * m, 0.0, lambda u, t: 0.0),
    "relu": ActivationModel(lambda z: _xp(z).maximum(z, 0.0), 1.0, lambda m, u, t: 0.0 * m, np.inf, lambda u, t: 0.0),
    # 0.5 z (1 + erf(z/sqrt2)): the erf argument carries u (one product), which erf
    # maps to <= max|t erf'(t)| u = 0.48u; erf adds t (abs, result O(1)); 1 + erf
    # rounds (2u abs). Times 0.5|z|, then two roundings of a result <= |z|.
    "gelu": ActivationModel(
        _gelu,
        1.13,
        lambda m, u, t: m * (0.5 * (t + 2.5 * u) + 2.0 * u) + _FLUSH,
        0.8,
        lambda u, t: 2.0 * t + 8.0 * u,
    ),
    # tanh's argument c(z + a z^3) has relative error <= 5u (five roundings, terms of
    # one sign), mapped by max|s sech^2 s| = 0.45 to 2.3u abs; tanh adds t; 1 + tanh
    # rounds (2u). Times 0.5|z|, then two roundings.
    "gelu_tanh": ActivationModel(
        _gelu_tanh,
        1.13,
        lambda m, u, t: m * (0.5 * (t + 4.3 * u) + 2.0 * u) + _FLUSH,
        0.8,
        # f' holds (1 - tanh)(1 + tanh) z s'(z): max |z s'| ~ 8 times the two factors
        # amplifies tanh's error t about 16-fold (measured 59.6u at z = 4.87): 20t + 10u.
        lambda u, t: 20.0 * t + 10.0 * u,
    ),
    # z * logistic(z): logistic errs by <= t + 2u (absolute, value <= 1), times |z|,
    # plus the product's rounding u|z|.
    "silu": ActivationModel(
        lambda z: z * _sigmoid(z),
        1.1,
        lambda m, u, t: m * (t + 3.0 * u) + _FLUSH,
        0.5,
        lambda u, t: 2.0 * t + 8.0 * u,
    ),
    # logistic: 1/(1+exp(-z)) or 0.5 + 0.5 tanh(z/2) depending on the backend; either
    # errs by at most t + 2u in absolute terms for a value <= 1.
    "sigmoid": ActivationModel(
        _sigmoid,
        0.25,
        lambda m, u, t: 0.0 * m + (t + 2.0 * u),
        0.1,
        lambda u, t: 2.0 * t + 6.0 * u,
    ),
}


def activation_model(name: str) -> ActivationModel:
    if name not in ACTIVATION_MODELS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATION_MODELS)}, got {name!r}")
    return ACTIVATION_MODELS[name]
