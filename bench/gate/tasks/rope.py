"""Rotary position embedding, half-split layout, positions 0..S-1, base 10000."""

import jax
import jax.numpy as jnp

from pallascheck.bench.gate.task import Arg, Task


def rope(x: jax.Array) -> jax.Array:
    s, d = x.shape
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    theta = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    x1, x2 = x[:, : d // 2].astype(jnp.float32), x[:, d // 2 :].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


TASK = Task(
    name="rope",
    reference=rope,
    inputs={"x": Arg(("s", "d"))},
    dims={"s": (16, 32, 48, 64), "d": (32, 64)},
    shown={"s": 32, "d": 64},
    signature="rope(x [S, D]) -> x rotated pairwise (i, i + D/2) by pos * 10000^(-2i/D)",
)
