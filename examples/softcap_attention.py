"""Attention with logit soft-capping and a causal sliding window, flash style, in Pallas.

s = cap * tanh(q k^T * scale / cap) (Gemma 2's soft-capping); query i sees keys j with
i - WINDOW < j <= i. The grid runs over query blocks; each loops over the key blocks
with an online softmax (running max, rescaled sum and accumulator in f32), and divides
once at the end. ``bug=True`` plants an off-by-one in the window (i - j <= WINDOW: one
key too many).

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

BLOCK = 16
WINDOW = 12
CAP = 30.0
F32_DOT = functools.partial(jnp.dot, precision=lax.Precision.HIGHEST)


def softcap_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    t, d = q.shape
    s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * (d**-0.5)
    s = CAP * jnp.tanh(s / CAP)
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    s = jnp.where((j <= i) & (i - j < WINDOW), s, -jnp.inf)
    return jnp.dot(jax.nn.softmax(s, axis=-1), v.astype(jnp.float32)).astype(q.dtype)


def _kernel(q_ref, k_ref, v_ref, o_ref, *, bug: bool):
    block, d = q_ref.shape
    qi = pl.program_id(0)
    q = q_ref[...].astype(jnp.float32)
    rows = qi * block + lax.broadcasted_iota(jnp.int32, (block, BLOCK), 0)

    def step(kb, carry):
        m, l, acc = carry
        k = k_ref[pl.ds(kb * BLOCK, BLOCK), :].astype(jnp.float32)
        v = v_ref[pl.ds(kb * BLOCK, BLOCK), :].astype(jnp.float32)
        s = F32_DOT(q, k.T) * (d**-0.5)
        s = CAP * jnp.tanh(s / CAP)
        cols = kb * BLOCK + lax.broadcasted_iota(jnp.int32, (block, BLOCK), 1)
        inside = (rows - cols <= WINDOW) if bug else (rows - cols < WINDOW)
        s = jnp.where((cols <= rows) & inside, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with no key yet: exp(-inf - 0) = 0, not NaN
        p = jnp.exp(s - shift)
        rescale = jnp.exp(m - shift)
        return m_new, l * rescale + p.sum(axis=1, keepdims=True), acc * rescale + F32_DOT(p, v)

    # key blocks that can hold a key in the window of this query block
    first = jnp.maximum(qi * block - WINDOW + 1, 0) // BLOCK
    start = (
        jnp.full((block, 1), -jnp.inf, jnp.float32),
        jnp.zeros((block, 1), jnp.float32),
        jnp.zeros((block, v_ref.shape[1]), jnp.float32),
    )
    _, l, acc = lax.fori_loop(first, qi + 1, step, start)
    o_ref[...] = (acc / l).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "bug"))
def softcap_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool = False, bug: bool = False
) -> jax.Array:
    t, d = q.shape
    if k.shape != q.shape or v.shape[0] != t or t % BLOCK:
        raise ValueError(f"q, k: [T, D] alike, v: [T, E], T a multiple of {BLOCK}; got {q.shape} {k.shape} {v.shape}")
    full = lambda i: (0, 0)  # noqa: E731 - keys and values stay whole in every program
    return pl.pallas_call(
        functools.partial(_kernel, bug=bug),
        grid=(t // BLOCK,),
        in_specs=[pl.BlockSpec((BLOCK, d), lambda i: (i, 0)), pl.BlockSpec(k.shape, full), pl.BlockSpec(v.shape, full)],
        out_specs=pl.BlockSpec((BLOCK, v.shape[1]), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((t, v.shape[1]), q.dtype),
        interpret=interpret,
    )(q, k, v)


# ---- check (the whole of it) ----
from pallascheck.specs import Facts, from_reference  # noqa: E402


def spec(kernel=softcap_attention):
    return from_reference(
        kernel,
        softcap_attention_reference,
        name="example_softcap_attention",
        inputs={"q": (32, 16), "k": (32, 16), "v": (32, 16)},
        facts=Facts(compute_dtype="float32"),
    )


SPEC = spec()  # the kernel as shipped (spec(functools.partial(softcap_attention, bug=True)): its planted bug)
