"""Gated linear unit: silu(x @ w[:, 0]) * (x @ w[:, 1]), f32 accumulation."""

import jax
import jax.numpy as jnp

from pallascheck.bench.gate.task import Arg, Task


def glu(x: jax.Array, weights: jax.Array) -> jax.Array:
    gate = jnp.dot(x, weights[:, 0, :], preferred_element_type=jnp.float32)
    up = jnp.dot(x, weights[:, 1, :], preferred_element_type=jnp.float32)
    return (jax.nn.silu(gate) * up).astype(x.dtype)


TASK = Task(
    name="glu",
    reference=glu,
    inputs={"x": Arg(("m", "d"), reduction="d"), "weights": Arg(("d", 2, "f"), reduction="d")},
    dims={"m": (8, 16, 33), "d": (32, 64), "f": (16, 32, 64)},
    shown={"m": 16, "d": 64, "f": 32},
    kinds=("normal", "positive", "few_distinct"),
    signature="glu(x, weights [d, 2, f]) -> silu(x @ weights[:, 0]) * (x @ weights[:, 1]) in x's dtype",
)
