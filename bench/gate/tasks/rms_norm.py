"""RMS norm over the last axis, with a scale; gradients checked."""

import jax
import jax.numpy as jnp

from pallascheck.bench.gate.task import Arg, Task

EPS = 1e-6


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    z = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(z * z, axis=-1, keepdims=True) + EPS)
    return (z * r * scale.astype(jnp.float32)).astype(x.dtype)


TASK = Task(
    name="rms_norm",
    reference=rms_norm,
    inputs={"x": Arg(("rows", "d"), reduction="d"), "scale": Arg(("d",))},
    dims={"rows": (1, 8, 17, 32), "d": (32, 64, 128)},
    shown={"rows": 8, "d": 128},
    signature=f"rms_norm(x, scale) -> x / sqrt(mean(x^2, -1) + {EPS}) * scale, in x's dtype; differentiable",
    gradients=True,
)
