"""Per-token softmax cross-entropy of logits [tokens, vocab] against int32 labels.

Its contract (``gradient_formulations``): the reference's VJP, as JAX differentiates
it, computes dlogits as ``(g / s) e - g onehot``; fused kernels compute ``g (p -
onehot)`` or ``g p - g onehot``, with p as ``e / s`` or ``exp((z - m) - log s)``
(Liger's, Transformer Engine's and our own). Each is exact in real arithmetic and
rounds at other steps: judged by the reference's order alone, an f32 ``g (p - 1)``
used 1.07 of the bound on an H100. The bound is the largest of their derivations.
"""

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


def _softmax_parts(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(z - m, sum exp(z - m), exp(z - m), onehot(labels)) in f32."""
    z = logits.astype(jnp.float32)
    shifted = z - jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(shifted)
    onehot = (labels[:, None] == jnp.arange(z.shape[-1])[None, :]).astype(jnp.float32)
    return shifted, jnp.sum(e, axis=-1, keepdims=True), e, onehot


def _grad(logits: jax.Array, g: jax.Array, p: jax.Array, onehot: jax.Array, *, factored: bool) -> tuple[jax.Array]:
    g = g[:, None]
    d = g * (p - onehot) if factored else g * p - g * onehot
    return (d.astype(logits.dtype),)


def grad_factored(logits: jax.Array, labels: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    """g (e / s - onehot)."""
    _, s, e, onehot = _softmax_parts(logits, labels)
    return _grad(logits, g, e / s, onehot, factored=True)


def grad_expanded(logits: jax.Array, labels: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    """g (e / s) - g onehot."""
    _, s, e, onehot = _softmax_parts(logits, labels)
    return _grad(logits, g, e / s, onehot, factored=False)


def grad_factored_log(logits: jax.Array, labels: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    """g (exp((z - m) - log s) - onehot): p without a division."""
    shifted, s, _, onehot = _softmax_parts(logits, labels)
    return _grad(logits, g, jnp.exp(shifted - jnp.log(s)), onehot, factored=True)


def grad_expanded_log(logits: jax.Array, labels: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    """g exp((z - m) - log s) - g onehot."""
    shifted, s, _, onehot = _softmax_parts(logits, labels)
    return _grad(logits, g, jnp.exp(shifted - jnp.log(s)), onehot, factored=False)


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
    gradient_formulations=(grad_factored, grad_expanded, grad_factored_log, grad_expanded_log),
)
