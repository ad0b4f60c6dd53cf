"""Chunked causal linear attention as a Pallas kernel.

o_t = sum_{s <= t} (q_t . k_s) v_s, computed the way chunked kernels (GLA, Mamba-2's
SSD without decay) do: the sequence is cut into chunks of ``CHUNK``; within a chunk
the causal part is a masked (q k^T) v, and the chunks before it enter through the
running state S = sum_s k_s^T v_s, carried from chunk to chunk (o_chunk = q S +
masked intra-chunk part). ``bug=True`` plants an off-by-one in the intra-chunk mask
(strictly causal: each position no longer attends to itself).

Its dots ask for ``HIGHEST`` precision: it states f32 arithmetic (``Facts(compute_dtype=
"float32")``), and at the default a GPU feeds f32 operands to tensor cores as tf32
(unit roundoff 2^-11, not 2^-24).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

CHUNK = 8


def linear_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    t = q.shape[0]
    scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    return jnp.dot(jnp.where(causal, scores, 0.0), v.astype(jnp.float32)).astype(q.dtype)


F32_DOT = functools.partial(jnp.dot, precision=lax.Precision.HIGHEST)


def _kernel(q_ref, k_ref, v_ref, o_ref, *, bug: bool):
    t, d = q_ref.shape
    rows = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    cols = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
    mask = rows > cols if bug else rows >= cols

    def chunk(c, state):
        sl = pl.ds(c * CHUNK, CHUNK)
        q, k, v = (r[sl, :].astype(jnp.float32) for r in (q_ref, k_ref, v_ref))
        intra = F32_DOT(jnp.where(mask, F32_DOT(q, k.T), 0.0), v)
        o_ref[sl, :] = (F32_DOT(q, state) + intra).astype(o_ref.dtype)
        return state + F32_DOT(k.T, v)

    lax.fori_loop(0, t // CHUNK, chunk, jnp.zeros((d, v_ref.shape[1]), jnp.float32))


@functools.partial(jax.jit, static_argnames=("interpret", "bug"))
def linear_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool = False, bug: bool = False
) -> jax.Array:
    if q.shape != k.shape or q.shape[0] != v.shape[0] or q.shape[0] % CHUNK:
        raise ValueError(f"q, k: [T, D] alike, v: [T, E], T a multiple of {CHUNK}; got {q.shape} {k.shape} {v.shape}")
    return pl.pallas_call(
        functools.partial(_kernel, bug=bug),
        interpret=interpret,
        out_shape=jax.ShapeDtypeStruct((q.shape[0], v.shape[1]), q.dtype),
    )(q, k, v)


# ---- check (the whole of it) ----
from pallascheck.specs import Facts, from_reference  # noqa: E402


def spec(kernel=linear_attention):
    inputs = {"q": (32, 16), "k": (32, 16), "v": (32, 16)}
    kinds = ("normal", "subnormal", "few_distinct", "positive")  # cubic: large values overflow
    facts = Facts(compute_dtype="float32")
    return from_reference(
        kernel, linear_attention_reference, name="example_linear_attention", inputs=inputs, facts=facts, kinds=kinds
    )


SPEC = spec()  # the kernel as shipped (spec(functools.partial(linear_attention, bug=True)): its planted bug)
