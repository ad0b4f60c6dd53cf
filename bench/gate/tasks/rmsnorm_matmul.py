"""RMS norm fused into the matmul that follows it (the normed rows rounded to x's dtype first)."""

import jax
import jax.numpy as jnp

from pallascheck.bench.gate.task import Arg, Task

EPS = 1e-6
WEIGHT_KINDS = ("normal", "subnormal", "few_distinct", "positive")


def rmsnorm_matmul(x: jax.Array, g: jax.Array, w: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS) * g.astype(jnp.float32)
    return jnp.dot(normed.astype(x.dtype), w, preferred_element_type=jnp.float32).astype(x.dtype)


TASK = Task(
    name="rmsnorm_matmul",
    reference=rmsnorm_matmul,
    inputs={
        "x": Arg(("m", "k"), reduction="k"),
        "g": Arg(("k",), reduction="k", kinds=WEIGHT_KINDS),
        "w": Arg(("k", "n"), reduction="k", kinds=WEIGHT_KINDS),
    },
    dims={"m": (8, 16, 32), "k": (16, 64), "n": (16, 32)},
    shown={"m": 16, "k": 64, "n": 32},
    signature=f"rmsnorm_matmul(x, g, w) -> (rms_norm(x, eps={EPS}) * g).astype(x.dtype) @ w in x's dtype",
)
