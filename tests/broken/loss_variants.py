"""Deliberately broken cross-entropy variants for the sensitivity meta-test.

Each variant swaps exactly one piece (a kernel body, the statistics combination, the
loss finish or the reduction) through ``make_cross_entropy`` (or one body of the
fused kernel) and keeps the tiling, custom_vjp wiring and public signature, so the
harness must catch it from the numbers alone. The unmerged-shard-max variant only
differs under ``axis_name``; its spec adds the multi-device relation (a child
process with 2 CPU devices, two cases: where every shard has the same max, e.g.
few distinct values, the bug is invisible), which the real kernel passes in
tests/test_losses.py.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
from jax import lax

from pallascheck.kernels import cross_entropy as ce
from pallascheck.kernels import linear_cross_entropy as lce
from pallascheck.oracles import cross_entropy as ce_oracle
from pallascheck.properties.families import cross_entropy_sharded
from pallascheck.properties.families.cross_entropy import make_spec
from pallascheck.properties.families.linear_cross_entropy import (
    make_spec as make_linear_spec,
)

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _no_max_subtraction_forward(logits_ref, labels_ref, m_ref, s_ref, t_ref, sd_ref, *, tiles):
    """sum(exp(z)) without the running max (the max is taken as 0): overflows for
    large logits."""
    row_ok = tiles.row_ok()
    labels = tiles.load_rows(labels_ref, row_ok)

    def step(j, carry):
        _, s, t, sd = carry
        start, cols = tiles.columns(j)
        col_ok = cols < tiles.vocab
        z = tiles.load_tile(logits_ref, start, row_ok & col_ok)
        s = s + jnp.sum(jnp.where(col_ok, jnp.exp(z), 0.0), axis=1, keepdims=True)  # BUG: exp(z), not exp(z - m)
        t = t + jnp.sum(jnp.where(cols == labels, z, 0.0), axis=1, keepdims=True)
        sd = sd + jnp.sum(jnp.where(col_ok, z, 0.0), axis=1, keepdims=True)
        return jnp.zeros_like(s), s, t, sd

    zeros = tuple(jnp.zeros((tiles.block_t, 1), jnp.float32) for _ in range(4))
    for ref, value in zip((m_ref, s_ref, t_ref, sd_ref), lax.fori_loop(0, tiles.num_tiles, step, zeros)):
        tiles.store_rows(ref, value, row_ok)


def _unmasked_last_tile_forward(logits_ref, labels_ref, m_ref, s_ref, t_ref, sd_ref, *, tiles):
    """Only the rows are masked: the last tile's padding columns (NaN in the
    interpreters, another row's memory on Triton) enter the statistics."""
    row_ok = tiles.row_ok()
    labels = tiles.load_rows(labels_ref, row_ok)

    def step(j, carry):
        start, cols = tiles.columns(j)
        z = tiles.load_tile(logits_ref, start, row_ok)  # BUG: no column mask
        return ce.online_update(carry, z, jnp.ones_like(cols, bool), cols, labels, start)

    stats = lax.fori_loop(0, tiles.num_tiles, step, ce.initial_stats(tiles.block_t))
    for ref, value in zip((m_ref, s_ref, t_ref, sd_ref), stats):
        tiles.store_rows(ref, value, row_ok)


def _smoothing_over_v_minus_one_finish(stats, *, label_smoothing, vocab):
    """The smoothing mass spread over V - 1 classes instead of V."""
    return ce.finish(
        stats, label_smoothing=label_smoothing * vocab / (vocab - 1) if vocab > 1 else label_smoothing, vocab=vocab
    )


def _mean_over_all_tokens(losses, counted, reduction):
    """'mean' divides by every token, ignored ones included."""
    if reduction != "mean":
        return ce.reduce(losses, counted, reduction)
    return jnp.sum(losses) / losses.shape[0]  # BUG: not the non-ignored count


def _backward_without_smoothing(logits_ref, labels_ref, m_ref, log_s_ref, g_ref, dlogits_ref, *, tiles, c1, c3):
    """The backward kernel forgets the uniform eps / V part of the smoothed target."""
    del c3
    ce._backward_kernel(logits_ref, labels_ref, m_ref, log_s_ref, g_ref, dlogits_ref, tiles=tiles, c1=c1, c3=0.0)


def _unmerged_shard_max_combine(stats, axis_name, local_vocab):
    """Across shards: sums of exp(z - m_local) added without rescaling to the global max."""
    if axis_name is None:
        return stats
    return ce.Stats(
        stats.max,
        lax.psum(stats.sumexp, axis_name),  # BUG: no pmax, no rescale
        lax.psum(stats.target, axis_name),
        lax.psum(stats.shifted_sum, axis_name),
    )


def _lse_minus_target_finish(stats, *, label_smoothing, vocab):
    """The textbook finish ``lse - z_y`` (the formula of JAX's and PyTorch's
    references): two numbers of the logits' size subtracted, so at |z| ~ 1e4 the loss
    keeps about 10 bits. It stays within the bound of its own arithmetic (the
    "textbook" model in oracles/cross_entropy.py); only the accuracy contract
    catches it. Drawn without smoothing (the variant has no logit sum)."""
    if label_smoothing != 0.0:
        raise ValueError("the lse_minus_target variant is drawn with label_smoothing = 0")
    log_s = jnp.log(stats.sumexp)
    return (stats.max + log_s) - stats.target, log_s  # BUG: lse rounded at the logits' size, then cancelled


no_max_subtraction = ce.make_cross_entropy(forward_body=_no_max_subtraction_forward)
unmasked_last_tile = ce.make_cross_entropy(forward_body=_unmasked_last_tile_forward)
smoothing_over_v_minus_one = ce.make_cross_entropy(finish=_smoothing_over_v_minus_one_finish)
mean_over_all_tokens = ce.make_cross_entropy(reduce=_mean_over_all_tokens)
backward_without_smoothing = ce.make_cross_entropy(backward_body=_backward_without_smoothing)
unmerged_shard_max = ce.make_cross_entropy(combine=_unmerged_shard_max_combine)
lse_minus_target = ce.make_cross_entropy(finish=_lse_minus_target_finish)


def _fused_dropped_last_hidden_chunk_forward(x_ref, w_ref, labels_ref, m_ref, s_ref, t_ref, sd_ref, *, dims):
    """The fused forward's logits miss the last (partial) chunk of the hidden dimension."""
    dropped = dataclasses.replace(dims, hidden=(dims.h_chunks - 1) * dims.config.block_h)  # BUG
    lce._forward_kernel(x_ref, w_ref, labels_ref, m_ref, s_ref, t_ref, sd_ref, dims=dropped)


fused_dropped_last_hidden_chunk = lce.make_linear_softmax_cross_entropy(
    forward_body=_fused_dropped_last_hidden_chunk_forward
)

_F32_BF16 = ("float32", "bfloat16")
# Variants whose implementation bound holds: only the accuracy contract (and the
# relations stated within it) can catch them (tests/test_sensitivity.py shows both).
CONTRACT_ONLY = ("lse_minus_target",)


def lse_minus_target_spec():
    """The textbook finish with the bound of its own arithmetic (a kernel author's
    implementation bound for it) and cross-entropy's accuracy contract, on logits
    with a large common offset."""

    def textbook_bound(case, ref, config, arith):
        return ce_oracle.loss_bound(
            ref, arith=arith, block_v=None if config is None else config.block_v, finish="textbook"
        )

    spec = make_spec(
        lse_minus_target, "ce_lse_minus_target", regime={"kind": "offset", "label_smoothing": 0.0, "ignored": 0.0}
    )
    return dataclasses.replace(spec, bound=textbook_bound)


# Each variant draws from the part of the input space where its bug shows (the same
# strategies and checks; only some choices pinned).
_SMOOTHED = {"label_smoothing": 0.1, "kind": "normal"}
VARIANTS = {
    "no_max_subtraction": (
        make_spec(no_max_subtraction, "ce_no_max_subtraction", regime={"kind": "large"}),
        _F32_BF16,
        2,
    ),
    "unmasked_last_tile": (make_spec(unmasked_last_tile, "ce_unmasked_last_tile"), _F32_BF16, 2),
    "smoothing_over_v_minus_one": (
        make_spec(smoothing_over_v_minus_one, "ce_smoothing_v_minus_one", regime={**_SMOOTHED, "ignored": 0.0}),
        _F32_BF16,
        2,
    ),
    "mean_over_all_tokens": (
        make_spec(mean_over_all_tokens, "ce_mean_over_all_tokens", regime={"ignored": 0.3, "reduction": "mean"}),
        _F32_BF16,
        3,
    ),
    "backward_without_smoothing": (
        make_spec(backward_without_smoothing, "ce_backward_without_smoothing", regime={**_SMOOTHED, "ignored": 0.0}),
        _F32_BF16,
        2,
    ),
    "unmerged_shard_max": (
        dataclasses.replace(
            make_spec(unmerged_shard_max, "ce_unmerged_shard_max", dtypes=("float32",)),
            relations=(cross_entropy_sharded.relation(f"{__name__}:unmerged_shard_max", import_path=TESTS_DIR),),
        ),
        ("float32",),
        1,
    ),
    "lse_minus_target": (lse_minus_target_spec(), _F32_BF16, 2),
    "fused_dropped_last_hidden_chunk": (
        make_linear_spec(fused_dropped_last_hidden_chunk, "lce_dropped_last_hidden_chunk"),
        _F32_BF16,
        4,
    ),
}
