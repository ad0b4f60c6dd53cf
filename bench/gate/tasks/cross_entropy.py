"""Per-token softmax cross-entropy of logits [tokens, vocab] against int32 labels."""

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.bench.gate.task import Arg, Dims, Task


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    z = logits.astype(jnp.float32)
    target = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
    return jax.nn.logsumexp(z, axis=-1) - target


def _labels(rng: np.random.Generator, dims: Dims, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return rng.integers(0, dims["vocab"], shape).astype(dtype)


TASK = Task(
    name="cross_entropy",
    reference=cross_entropy,
    inputs={
        "logits": Arg(("tokens", "vocab"), reduction="vocab"),
        "labels": Arg(("tokens",), dtype="int32", values=_labels, differentiable=False),
    },
    dims={"tokens": (1, 8, 13, 32), "vocab": (64, 100, 256)},
    shown={"tokens": 8, "vocab": 256},
    signature="cross_entropy(logits, labels) -> f32 [tokens]: logsumexp(logits) - logits[label]; differentiable",
    gradients=True,
)
