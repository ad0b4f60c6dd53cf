"""Argument checks shared by the kernels: each error names the argument and the rule."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp

SUPPORTED_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def require_array(name: str, value: Any) -> None:
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(value).__name__}")


def require_float_dtype(name: str, dtype: Any, allowed: Iterable[Any] = SUPPORTED_FLOATS) -> None:
    allowed = tuple(jnp.dtype(d) for d in allowed)
    if jnp.dtype(dtype) not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {jnp.dtype(dtype).name}")


def require_rank(name: str, value: Any, rank: int, hint: str = "") -> None:
    if value.ndim != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(value.shape)}{hint}")


def require_positive_power_of_two(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value!r}")


def require_nonempty(name: str, shape: tuple[int, ...]) -> None:
    if any(d == 0 for d in shape):
        raise ValueError(f"{name} must not have a zero-sized dimension, got shape {shape}")
