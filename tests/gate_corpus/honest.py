"""Honest candidates: our kernels, the examples, JAX's bundled Pallas ops that run in
Pallas' interpreter, and plain Pallas kernels of the kind a kernel writer submits. Each
takes a task's inputs and options (task.signature); ``HONEST`` lists (task, name)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.gpu import softmax as jax_softmax

from examples.blocked_cumsum import blocked_cumsum
from examples.linear_attention import linear_attention as example_linear_attention
from examples.rmsnorm_matmul import rmsnorm_matmul as example_rmsnorm_matmul
from examples.rope import rope as example_rope
from examples.softcap_attention import softcap_attention as example_softcap_attention
from pallascheck.kernels.attention import attention as our_attention
from pallascheck.kernels.cross_entropy import cross_entropy as our_cross_entropy
from pallascheck.kernels.gated_linear_unit import gated_linear_unit
from pallascheck.kernels.matmul import matmul
from pallascheck.kernels.norms import layer_norm as our_layer_norm
from pallascheck.kernels.norms import rms_norm as our_rms_norm
from pallascheck.kernels.ragged_dot import ragged_dot as our_ragged_dot
from pallascheck.kernels.top_k import top_k as our_top_k

# ---- our kernels (their backend: $PALLASCHECK_BACKEND or the interpreter)


def ours_rms_norm(x, scale):
    return our_rms_norm(x, scale, eps=1e-6)


def ours_layer_norm(x, scale, offset):
    return our_layer_norm(x, scale, offset, eps=1e-5)


def ours_cross_entropy(logits, labels):
    return our_cross_entropy(logits, labels, reduction="none")


def ours_attention(q, k, v, *, causal):
    return our_attention(q, k, v, causal=causal)


def ours_matmul(x, y, *, activation):
    return matmul(x, y, activation=activation)


def ours_glu(x, weights):
    return gated_linear_unit(x, weights, activation="silu")


def ours_ragged_dot(lhs, rhs, group_sizes):
    return our_ragged_dot(lhs, rhs, group_sizes)


def ours_top_k(logits, *, k):
    return our_top_k(logits, k)[0]


# ---- the examples


def example_rope_kernel(x, interpret=False):
    return example_rope(x, interpret=interpret)


def example_cumsum(x, interpret=False):
    return blocked_cumsum(x, interpret=interpret)


def example_rmsnorm_matmul_kernel(x, g, w, interpret=False):
    return example_rmsnorm_matmul(x, g, w, interpret=interpret)


def example_linear_attention_kernel(q, k, v, interpret=False):
    return example_linear_attention(q, k, v, interpret=interpret)


def example_softcap_attention_kernel(q, k, v, interpret=False):
    return example_softcap_attention(q, k, v, interpret=interpret)


# ---- JAX's bundled Pallas ops


def jax_softmax_kernel(x, interpret=False):
    return jax_softmax.softmax(x, axis=-1, interpret=interpret)


# ---- plain Pallas kernels, as a kernel writer submits them


def _softmax_rows(x_ref, o_ref):
    x = x_ref[...].astype(jnp.float32)
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    o_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(o_ref.dtype)


def pallas_softmax(x, interpret=False):
    return pl.pallas_call(_softmax_rows, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x)


def _fake_quantize_rows(x_ref, o_ref):
    z = x_ref[...].astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(z), axis=-1, keepdims=True) / 127.0, 2.0**-126)
    o_ref[...] = (jnp.clip(jnp.round(z / scale), -127.0, 127.0) * scale).astype(o_ref.dtype)


def pallas_fake_quantize(x, interpret=False):
    return pl.pallas_call(_fake_quantize_rows, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x)


def _matmul_tile(x_ref, y_ref, o_ref, *, activation):
    z = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
    if activation == "gelu_tanh":
        z = jax.nn.gelu(z, approximate=True)
    o_ref[...] = z.astype(o_ref.dtype)


def pallas_matmul(x, y, *, activation, interpret=False):
    return pl.pallas_call(
        functools.partial(_matmul_tile, activation=activation),
        out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype),
        interpret=interpret,
    )(x, y)


def _cumsum_rows(x_ref, o_ref):
    o_ref[...] = jnp.cumsum(x_ref[...].astype(jnp.float32), axis=-1).astype(o_ref.dtype)


def pallas_cumsum(x, interpret=False):
    return pl.pallas_call(_cumsum_rows, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x)


def _rope_rows(x_ref, o_ref):
    s, d = x_ref.shape
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    theta = jnp.arange(s, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    x = x_ref[...].astype(jnp.float32)
    x1, x2 = x[:, : d // 2], x[:, d // 2 :]
    o_ref[...] = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(o_ref.dtype)


def pallas_rope(x, interpret=False):
    return pl.pallas_call(_rope_rows, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x)


def _top_k_rows(x_ref, o_ref, *, k):
    o_ref[...] = jax.lax.top_k(x_ref[...], k)[0]


def pallas_top_k(logits, *, k, interpret=False):
    return pl.pallas_call(
        functools.partial(_top_k_rows, k=k),
        out_shape=jax.ShapeDtypeStruct((logits.shape[0], k), logits.dtype),
        interpret=interpret,
    )(logits)


HONEST: list[tuple[str, str]] = [
    ("rms_norm", "ours_rms_norm"),
    ("layer_norm", "ours_layer_norm"),
    ("cross_entropy", "ours_cross_entropy"),
    ("attention", "ours_attention"),
    ("matmul_epilogue", "ours_matmul"),
    ("glu", "ours_glu"),
    ("ragged_dot", "ours_ragged_dot"),
    ("top_k", "ours_top_k"),
    ("rope", "example_rope_kernel"),
    ("cumsum", "example_cumsum"),
    ("rmsnorm_matmul", "example_rmsnorm_matmul_kernel"),
    ("linear_attention", "example_linear_attention_kernel"),
    ("softcap_attention", "example_softcap_attention_kernel"),
    ("softmax", "jax_softmax_kernel"),
    ("softmax", "pallas_softmax"),
    ("fake_quantize", "pallas_fake_quantize"),
    ("matmul_epilogue", "pallas_matmul"),
    ("cumsum", "pallas_cumsum"),
    ("rope", "pallas_rope"),
    ("top_k", "pallas_top_k"),
]
