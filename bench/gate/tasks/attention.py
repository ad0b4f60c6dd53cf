"""Multi-head attention softmax(q k^T / sqrt(d)) v, optionally causal, layout [batch, seq, heads, dim]."""

import jax
import jax.numpy as jnp

from pallascheck.bench.gate.task import Arg, Task
from pallascheck.oracles.derive import Facts


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False) -> jax.Array:
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * (q.shape[-1] ** -0.5)
    if causal:
        visible = jnp.arange(q.shape[1])[:, None] >= jnp.arange(k.shape[1])[None, :]
        s = jnp.where(visible, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(q.dtype)


TASK = Task(
    name="attention",
    reference=attention,
    inputs={
        "q": Arg(("b", "s", "h", "d"), reduction="d"),
        "k": Arg(("b", "s", "h", "d"), reduction="d"),
        "v": Arg(("b", "s", "h", "d"), reduction="s"),
    },
    dims={"b": (1, 2), "s": (16, 32, 48), "h": (1, 2), "d": (16, 32)},
    shown={"b": 1, "s": 32, "h": 2, "d": 32},
    options={"causal": (False, True)},
    # f32 softmax; the p.v dot may take p rounded to the input dtype (a bf16 MMA's operand)
    facts=Facts(compute_dtype="float32", dot_operands="inputs"),
    kinds=("normal", "few_distinct", "positive"),  # "large" logits are cross-entropy's test, not this one
    signature="attention(q, k, v, *, causal) -> softmax(q k^T / sqrt(d), causal mask) v; [batch, seq, heads, dim]",
)
