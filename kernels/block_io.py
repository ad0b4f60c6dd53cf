"""Masked block loads and stores that are right on every backend.

A block may hang over the array's edge (shapes that are not multiples of the block).
The interpreters pad such blocks (with NaN in interpret mode) and drop out-of-bounds
writes, so a plain ``ref[...]`` is memory-safe there. Triton does *not* bounds-check:
an unmasked load reads the neighbouring row's memory and an unmasked store overwrites
it. So on the GPU every edge access is a masked ``load``/``store``, and on every
backend the loaded value is forced to exact zeros outside ``mask`` with ``jnp.where``
(never a multiply: 0 * NaN = NaN).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as _pltriton

# pl.load and pl.store: the older jax's spelling, absent from the newer one's annotations
_triton_load = getattr(_pltriton, "load", None) or getattr(pl, "load")
_triton_store = getattr(_pltriton, "store", None) or getattr(pl, "store")


def load(ref: Any, mask: jax.Array, *, masked_io: bool) -> jax.Array:
    """The block in its own dtype, exact zeros where ``mask`` is False."""
    if masked_io:
        value = _triton_load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=0)
    else:
        value = ref[...]
    return jnp.where(mask, value, jnp.zeros_like(value))


def store(ref: Any, value: jax.Array, mask: jax.Array, *, masked_io: bool) -> None:
    """Write the block; what ``mask`` excludes may hold anything afterwards."""
    value = value.astype(ref.dtype)
    if masked_io:
        _triton_store(ref, value, mask=jnp.broadcast_to(mask, value.shape))
    else:
        ref[...] = value
