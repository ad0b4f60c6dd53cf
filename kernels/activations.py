"""Elementwise activations that kernels fuse into their epilogue, evaluated in f32."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

_SQRT_HALF = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654


def _relu(z: jax.Array) -> jax.Array:
    return jnp.maximum(z, 0.0)


def _gelu(z: jax.Array) -> jax.Array:  # exact: z * Phi(z)
    return 0.5 * z * (1.0 + lax.erf(z * _SQRT_HALF))


def _gelu_tanh(z: jax.Array) -> jax.Array:
    return 0.5 * z * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)))


def _sigmoid(z: jax.Array) -> jax.Array:
    # lax.logistic, not 1/(1+exp(-z)): its derivative s(1-s) stays finite where
    # exp(-z) overflows (z < -88 in f32), which would give 0*inf = NaN gradients.
    return lax.logistic(z)


def _silu(z: jax.Array) -> jax.Array:
    return z * _sigmoid(z)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "none": lambda z: z,
    "relu": _relu,
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": _silu,
    "sigmoid": _sigmoid,
}


def get_activation(name: str) -> Callable[[jax.Array], jax.Array]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]
