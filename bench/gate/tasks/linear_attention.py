"""Causal linear attention (no softmax): (mask . q k^T) v, accumulated in f32."""

import jax
import jax.numpy as jnp

from pallascheck.bench.gate.task import Arg, Task


def linear_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    t = q.shape[0]
    scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    return jnp.dot(jnp.where(causal, scores, 0.0), v.astype(jnp.float32)).astype(q.dtype)


TASK = Task(
    name="linear_attention",
    reference=linear_attention,
    inputs={"q": Arg(("t", "d"), reduction="d"), "k": Arg(("t", "d"), reduction="d"), "v": Arg(("t", "e"))},
    dims={"t": (16, 32, 48), "d": (16, 32), "e": (16, 32)},
    shown={"t": 32, "d": 16, "e": 16},
    kinds=("normal", "subnormal", "few_distinct", "positive"),  # cubic in the inputs: large ones overflow
    signature="linear_attention(q, k, v) -> causal (q k^T) v without softmax, in q's dtype",
)
