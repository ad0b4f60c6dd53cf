"""The k largest values of each row of logits [tokens, vocab], in descending order."""

import jax
from jax import lax

from pallascheck.bench.gate.task import Arg, Task


def top_k(logits: jax.Array, *, k: int = 4) -> jax.Array:
    return lax.top_k(logits, k)[0]


TASK = Task(
    name="top_k",
    reference=top_k,
    inputs={"logits": Arg(("tokens", "vocab"))},
    dims={"tokens": (1, 8, 13), "vocab": (64, 100, 256)},
    shown={"tokens": 8, "vocab": 256},
    options={"k": (4, 8)},
    signature="top_k(logits, *, k) -> the k largest values of each row, descending",
)
