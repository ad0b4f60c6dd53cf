"""Softmax over the last axis of x [rows, cols]."""

import jax
import jax.numpy as jnp

from pallascheck.bench.gate.task import Arg, Task


def softmax(x: jax.Array) -> jax.Array:
    z = x.astype(jnp.float32)
    e = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
    return (e / jnp.sum(e, axis=-1, keepdims=True)).astype(x.dtype)


TASK = Task(
    name="softmax",
    reference=softmax,
    inputs={"x": Arg(("rows", "cols"), reduction="cols")},
    dims={"rows": (1, 8, 13, 32), "cols": (16, 100, 128, 256)},
    shown={"rows": 8, "cols": 128},
    signature="softmax(x) -> softmax over the last axis, in x's dtype",
)
