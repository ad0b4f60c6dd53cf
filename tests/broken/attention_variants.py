"""Deliberately broken flash-attention variants for the sensitivity meta-test.

Each variant swaps one kernel body (forward, dk/dv or dq) through
``attention.make_attention(Bodies(...))`` and keeps the tiling, the custom_vjp wiring and
the public signature, so the harness must catch it from the numbers alone. Logit-level
bugs are injected through a ``Tile`` subclass that the default bodies call.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels import attention, block_io
from pallascheck.kernels.attention import (
    NEG_INF,
    Bodies,
    Tile,
    dot_f32,
    guard_neg_inf,
    store_forward,
)
from pallascheck.properties.families.attention import make_spec


def _as(tile: Tile, cls: type, **changes) -> Tile:
    return cls(**{**{f.name: getattr(tile, f.name) for f in dataclasses.fields(Tile)}, **changes})


class _OffByOneCausalTile(Tile):
    def logits(self, q, k, bias_ref, mask_ref, q_start, k_start, window):
        s = Tile.logits(dataclasses.replace(self, causal=False), q, k, bias_ref, mask_ref, q_start, k_start, window)
        if not self.causal:
            return s
        rows = self.positions(q_start, q.shape[0], 0)
        cols = self.positions(k_start, k.shape[0], 1)
        return jnp.where(cols < rows + self.offset, s, NEG_INF)  # BUG: < instead of <=


class _DropsLastKvBlockTile(Tile):
    def kv_blocks_seen(self, q_block, block_q, block_k):
        full = self.seq_kv // block_k  # BUG: floor, the ragged last block is never visited
        return jnp.minimum(Tile.kv_blocks_seen(self, q_block, block_q, block_k), full)


def _with_tile(cls: type, body=attention._forward_kernel, **changes):
    def wrapped(*refs, tile, **kw):
        body(*refs, tile=_as(tile, cls, **changes), **kw)

    return wrapped


def _scale_twice_forward(*refs, tile, **kw):
    attention._forward_kernel(*refs, tile=dataclasses.replace(tile, sm_scale=tile.sm_scale * tile.sm_scale), **kw)


def _forward_variant(q_ref, k_ref, v_ref, bias_ref, mask_ref, o_ref, lse_ref, *, tile, block_k, bug):
    """The default forward body with one of several bugs switched on."""
    block_q = q_ref.shape[0]
    i = pl.program_id(2)
    q_start = i * block_q
    q = block_io.load(
        q_ref, (tile.positions(q_start, block_q, 0) < tile.seq_q) & tile.col_ok(), masked_io=tile.masked_io
    )
    acc_dtype = jnp.float16 if bug == "f16_accumulator" else jnp.float32

    def step(j, carry):
        m, l, acc = carry
        k_start = pl.multiple_of(j * block_k, block_k)
        if bug == "unmasked_kv_padding":  # BUG: padding rows of k and v read as they are
            k = k_ref[pl.ds(k_start, block_k), :]
            v = v_ref[pl.ds(k_start, block_k), :]
        else:
            k, _ = tile.load_rows(k_ref, k_start, block_k, tile.seq_kv)
            v, _ = tile.load_rows(v_ref, k_start, block_k, tile.seq_kv)
        if bug == "mask_after_exp":
            # BUG: the max runs over masked logits too; the mask is applied to exp's result
            s = tile.logits(q, k, bias_ref, mask_ref, q_start, k_start, (0, k_start))
            unmasked = Tile.logits(
                dataclasses.replace(tile, causal=False, has_mask=False),
                q,
                k,
                bias_ref,
                None,
                q_start,
                k_start,
                (0, k_start),
            )
            m_new = jnp.maximum(m, jnp.max(unmasked, axis=1, keepdims=True))
            m_safe = guard_neg_inf(m_new)
            p = jnp.where(s == NEG_INF, 0.0, jnp.exp(unmasked - m_safe))
        else:
            s = tile.logits(q, k, bias_ref, mask_ref, q_start, k_start, (0, k_start))
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            m_safe = guard_neg_inf(m_new)
            p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m - m_safe)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        pv = dot_f32(p.astype(v.dtype), v)
        if bug == "missing_rescale":
            acc = acc + pv  # BUG: acc keeps its old scale when the running max grows
        else:
            acc = (alpha * acc.astype(jnp.float32) + pv).astype(acc_dtype)
        return m_new, l, acc

    init = (
        jnp.full((block_q, 1), NEG_INF, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
        jnp.zeros((block_q, tile.width), acc_dtype),
    )
    m, l, acc = lax.fori_loop(0, tile.kv_blocks_seen(i, block_q, block_k), step, init)
    store_forward(tile, o_ref, lse_ref, q_start, m, l, acc.astype(jnp.float32))


def _forward_bug(bug: str):
    def body(*refs, tile, block_k):
        _forward_variant(*refs, tile=tile, block_k=block_k, bug=bug)

    return body


def _dkdv_missing_delta(
    q_ref,
    do_ref,
    k_ref,
    v_ref,
    lse_ref,
    delta_ref,
    bias_ref,
    mask_ref,
    dk_ref,
    dv_ref,
    ds_ref,
    *,
    tile,
    block_q,
):
    """ds = p * dp: the - delta term of the softmax Jacobian is dropped (dk, dbias wrong)."""
    block_k = k_ref.shape[0]
    j = pl.program_id(2)
    k_start = j * block_k
    kv_ok = (tile.positions(k_start, block_k, 0) < tile.seq_kv) & tile.col_ok()
    k = block_io.load(k_ref, kv_ok, masked_io=tile.masked_io)
    v = block_io.load(v_ref, kv_ok, masked_io=tile.masked_io)

    def step(i, carry):
        dk, dv = carry
        q_start = pl.multiple_of(i * block_q, block_q)
        q, _ = tile.load_rows(q_ref, q_start, block_q, tile.seq_q)
        do, _ = tile.load_rows(do_ref, q_start, block_q, tile.seq_q)
        s = tile.logits(q, k, bias_ref, mask_ref, q_start, k_start, (q_start, 0))
        p = jnp.exp(s - guard_neg_inf(tile.load_vector(lse_ref, q_start, block_q)))
        dv = dv + dot_f32(p.astype(do.dtype), do, (0, 0))
        ds = p * dot_f32(do, v, (1, 1))  # BUG: no - delta
        dk = dk + dot_f32(ds.astype(q.dtype), q, (0, 0))
        if ds_ref is not None:
            attention.store_ds(tile, ds_ref, ds, q_start, k_start)
        return dk, dv

    zeros = jnp.zeros((block_k, tile.width), jnp.float32)
    if ds_ref is not None:

        def zero_ds(i, carry):
            attention.store_ds(tile, ds_ref, jnp.zeros((block_q, block_k), jnp.float32), i * block_q, k_start)
            return carry

        lax.fori_loop(0, pl.cdiv(tile.seq_q, block_q), zero_ds, 0)
    dk, dv = lax.fori_loop(
        tile.first_q_block_seeing(j, block_q, block_k), pl.cdiv(tile.seq_q, block_q), step, (zeros, zeros)
    )
    attention.store_kv_grads(tile, dk_ref, dv_ref, dk * jnp.float32(tile.sm_scale), dv, k_start)


def _dq_missing_scale(*refs, tile, block_k):
    """dq without the final sm_scale factor."""
    attention._dq_kernel(*refs, tile=dataclasses.replace(tile, sm_scale=1.0), block_k=block_k)


VARIANT_BODIES = {
    "missing_rescale": Bodies(forward=_forward_bug("missing_rescale")),
    "mask_after_exp": Bodies(forward=_forward_bug("mask_after_exp")),
    "causal_off_by_one": Bodies(forward=_with_tile(_OffByOneCausalTile)),
    "sm_scale_twice": Bodies(forward=_scale_twice_forward),
    "drops_last_kv_block": Bodies(forward=_with_tile(_DropsLastKvBlockTile)),
    "f16_accumulator": Bodies(forward=_forward_bug("f16_accumulator")),
    "unmasked_kv_padding": Bodies(forward=_forward_bug("unmasked_kv_padding")),
    "dq_missing_sm_scale": Bodies(dq=_dq_missing_scale),
    "dkdv_missing_delta": Bodies(dkdv=_dkdv_missing_delta),
}
# Each variant is checked in one dtype where it is wrong beyond that dtype's rounding
# (every compile costs seconds in interpret mode). An f16 accumulator keeps more
# mantissa than a bf16 output and as much as an f16 one: it is a bug only in f32.
_DTYPES = {"f16_accumulator": ("float32",)}
# On Triton an f32 dot runs at tf32, whose 11-bit significand is f16's: the kernel's
# own p.v products already err as much as an f16 accumulator adds, and the bound
# (which charges tf32 there) covers both. Seen on the H200: the variant passed every
# check in 12 examples.
NOT_ON = {
    "f16_accumulator": {
        "triton": "f32 dots run at tf32 (f16's precision): an f16 accumulator costs no more "
        "than the kernel's own p.v products, inside the bound"
    },
}
DEFAULT_DTYPES = ("bfloat16",)
EXAMPLES = 12

# Variants that are wrong only on some inputs draw from those inputs (every example
# that cannot show the bug costs a full set of checks).
_ONLY = {"causal_off_by_one": lambda case: case.params["causal"]}


def _spec(name: str, bodies: Bodies):
    spec = make_spec(attention.make_attention(bodies), name=f"attention[{name}]")
    if name in _ONLY:
        base = spec.cases
        spec = dataclasses.replace(spec, cases=lambda dtype, backend: base(dtype, backend).filter(_ONLY[name]))
    return spec


VARIANTS = {
    name: (_spec(name, bodies), _DTYPES.get(name, DEFAULT_DTYPES), EXAMPLES) for name, bodies in VARIANT_BODIES.items()
}
