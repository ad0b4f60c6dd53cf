"""Rotary position embedding (RoPE, half-split layout) as a Pallas kernel.

x [S, D] is rotated pairwise: for i < D/2, (x_i, x_{i+D/2}) turns by the angle
pos * base^(-2i/D). The grid runs over blocks of ``BLOCK`` positions; each block
computes its positions from its grid index. ``bug=True`` plants the classic tiling
bug: positions counted from 0 in every block (the block's offset forgotten), so
every block after the first is rotated as if it started the sequence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

BLOCK = 16
BASE = 10000.0


def _angles(positions: jax.Array, d: int) -> jax.Array:
    inv_freq = 1.0 / (BASE ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    return positions[:, None].astype(jnp.float32) * inv_freq[None, :]


def rope_reference(x: jax.Array) -> jax.Array:
    """What the kernel computes, in plain jax.numpy."""
    s, d = x.shape
    theta = _angles(jnp.arange(s), d)
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    x1, x2 = x[:, : d // 2].astype(jnp.float32), x[:, d // 2 :].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _kernel(x_ref, o_ref, *, bug: bool):
    block, d = x_ref.shape
    offset = 0 if bug else pl.program_id(0) * block
    theta = _angles(offset + jnp.arange(block), d)
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    x = x_ref[...].astype(jnp.float32)
    x1, x2 = x[:, : d // 2], x[:, d // 2 :]
    o_ref[...] = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "bug"))
def rope(x: jax.Array, *, interpret: bool = False, bug: bool = False) -> jax.Array:
    s, d = x.shape
    if s % BLOCK or d % 2:
        raise ValueError(f"x: sequence length must be a multiple of {BLOCK} and D even, got {x.shape}")
    return pl.pallas_call(
        functools.partial(_kernel, bug=bug),
        grid=(s // BLOCK,),
        in_specs=[pl.BlockSpec((BLOCK, d), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((BLOCK, d), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        interpret=interpret,
    )(x)


# ---- check (the whole of it) ----
from pallascheck.specs import Facts, from_reference  # noqa: E402


def spec(kernel=rope):
    return from_reference(
        kernel, rope_reference, name="example_rope", inputs={"x": (32, 64)}, facts=Facts(compute_dtype="float32")
    )


SPEC = spec()  # the kernel as shipped (spec(functools.partial(rope, bug=True)): its planted bug)
