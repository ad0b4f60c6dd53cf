"""Sliding-window causal attention with tanh logit soft-capping (Gemma-2 style)."""

import jax
import jax.numpy as jnp

from pallascheck.bench.gate.task import Arg, Task

WINDOW = 12
CAP = 30.0


def softcap_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    t, d = q.shape
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * (d**-0.5)
    s = CAP * jnp.tanh(s / CAP)
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    s = jnp.where((j <= i) & (i - j < WINDOW), s, -jnp.inf)
    return jnp.dot(jax.nn.softmax(s, axis=-1), v.astype(jnp.float32)).astype(q.dtype)


TASK = Task(
    name="softcap_attention",
    reference=softcap_attention,
    inputs={"q": Arg(("t", "d"), reduction="d"), "k": Arg(("t", "d"), reduction="d"), "v": Arg(("t", "d"))},
    dims={"t": (16, 32, 48), "d": (16, 32)},
    shown={"t": 32, "d": 16},
    signature=f"softcap_attention(q, k, v) -> causal window {WINDOW}, logits {CAP} tanh(s / {CAP}), [T, D]",
)
