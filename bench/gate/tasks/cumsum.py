"""A scan: the cumulative sum along the last axis, accumulated in f32."""

import jax
import jax.numpy as jnp

from pallascheck.bench.gate.task import Arg, Task


def cumsum(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x.astype(jnp.float32), axis=-1).astype(x.dtype)


TASK = Task(
    name="cumsum",
    reference=cumsum,
    inputs={"x": Arg(("rows", "n"), reduction="n")},
    dims={"rows": (1, 4, 9), "n": (16, 48, 64)},
    shown={"rows": 4, "n": 48},
    kinds=("normal", "large", "subnormal", "positive"),
    signature="cumsum(x) -> the running sum along the last axis, in x's dtype",
)
