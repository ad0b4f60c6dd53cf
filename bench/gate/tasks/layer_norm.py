"""Layer norm over the last axis, with a scale and an offset; gradients checked."""

import jax
import jax.numpy as jnp

from pallascheck.bench.gate.task import Arg, Task

EPS = 1e-5


def layer_norm(x: jax.Array, scale: jax.Array, offset: jax.Array) -> jax.Array:
    z = x.astype(jnp.float32)
    centered = z - jnp.mean(z, axis=-1, keepdims=True)
    r = jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + EPS)
    return (centered * r * scale.astype(jnp.float32) + offset.astype(jnp.float32)).astype(x.dtype)


TASK = Task(
    name="layer_norm",
    reference=layer_norm,
    inputs={"x": Arg(("rows", "d"), reduction="d"), "scale": Arg(("d",)), "offset": Arg(("d",))},
    dims={"rows": (1, 8, 17, 32), "d": (32, 64, 128)},
    shown={"rows": 8, "d": 128},
    signature=f"layer_norm(x, scale, offset) -> (x - mean) / sqrt(var + {EPS}) * scale + offset; differentiable",
    gradients=True,
)
