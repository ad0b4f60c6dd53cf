"""Flash attention: Pallas forward and backward kernels (online softmax, FlashAttention-2).

    out[b, i, h, :] = sum_j softmax_j(s[b, h, i, :]) v[b, j, h // group, :]
    s[b, h, i, j]   = sm_scale * (q[b, i, h, :] . k[b, j, h // group, :]) + bias[b, h, i, j]

Layout ``[batch, seq, heads, head_dim]`` for q, k, v and the output. Grouped-query /
multi-query attention: ``heads_q`` is a multiple ``group`` of ``heads_kv`` and q head
``h`` reads kv head ``h // group``. ``bias`` (float) and ``mask`` (bool, True = the key
is visible) broadcast to ``[batch, heads_q, seq_q, seq_kv]`` (rank <= 4, numpy rules).

Semantics chosen here:
- causal with ``seq_q != seq_kv`` is aligned bottom-right (FlashAttention >= 2.1,
  cuDNN): query i sees key j iff ``j <= i + seq_kv - seq_q``. With seq_q > seq_kv the
  first ``seq_q - seq_kv`` queries see nothing.
- a logit is masked when the mask says so, when causality hides it, or when its bias
  is ``-inf``. A **fully masked row** (no visible key) has output 0, logsumexp
  ``-inf`` and gradient 0 for every input; never NaN. A bias of ``+inf`` or NaN is
  outside the contract (it propagates NaN).
- ``sm_scale`` defaults to ``1 / sqrt(head_dim)``; it is rounded to f32 once.

Forward (grid: batch x q heads x q blocks of ``block_q``; a ``fori_loop`` over kv
blocks of ``block_k``, all state in f32):
    s     = dot(q, k^T) * sm_scale (+ bias)        f32 accumulate, inputs in their dtype
                                                   (f32 inputs: precision HIGHEST, not tf32)
    s     = where(visible, s, -inf)                before any other arithmetic
    m_new = max(m, rowmax(s));  m_safe = 0 where m_new = -inf (no key seen yet)
    alpha = exp(m - m_safe);    p = exp(s - m_safe)
    l     = alpha * l + rowsum(p)                  p in f32
    acc   = alpha * acc + dot(p.astype(v.dtype), v)
and at the end ``out = acc / l`` (0 where l = 0), rounded once to q's dtype, and the
f32 residual ``lse = m_safe + log(l)`` (``-inf`` where l = 0). ``p`` is rounded to
the input dtype before the p.v dot (bf16/f16 tensor-core MMAs take such operands);
``l`` sums the unrounded f32 ``p``. With causal, the loop stops after the last kv
block any query of the block can see.

Backward (FlashAttention-2; ``custom_vjp``; residuals q, k, v, bias, mask, out, lse):
    delta = rowsum(dO * out)                       XLA, f32, from the rounded out
    p     = exp(s - lse)  (s recomputed; lse = -inf is replaced by 0, where s = -inf)
    dp    = dot(dO, v^T);   ds = p * (dp - delta)  f32
    dv    = sum_i p.astype(dtype)^T dO;    dk = sm_scale * sum_i ds.astype(dtype)^T q
    dq    = sm_scale * sum_j ds.astype(dtype) k
One kernel per (batch, q head, kv block) loops over q blocks for dk, dv (and writes
``ds`` into an f32 ``[batch, heads, seq_q, seq_kv]`` buffer when there is a bias); one
kernel per (batch, q head, q block) loops over kv blocks for dq. Block sizes
``block_q_bwd`` / ``block_k_bwd`` serve both. With GQA the dk/dv kernels write f32
partials per q head and XLA sums each group of ``group`` heads in f32 before rounding
to k's dtype; ``dbias`` is XLA's f32 sum of ``ds`` over the dimensions the bias
broadcasts along, rounded to the bias dtype. The mask gets no gradient.

Edges: sequence lengths need not be multiples of the blocks and head_dim need not be a
power of two (blocks are ``D_padded`` = the next power of two >= max(head_dim, 16)
wide). Every load is masked with ``jnp.where`` to the rows and columns that exist
(padding holds NaN in interpret mode and garbage on Triton, and 0 * NaN = NaN);
padded kv columns and padded q rows are also excluded from the softmax. On the GPU the
loads and stores at the array's edges are masked ``load``/``store`` (kernels/block_io.py).

On ``mosaic_gpu`` and ``mosaic_gpu_interpret`` the same public ``attention`` (and its
custom_vjp) runs the Hopper kernels of ``kernels/mosaic_gpu_attention.py`` (TMA,
wgmma, bf16/f16 only) and takes a ``mosaic_gpu_attention.Config``; ``configs`` lists
those for these backends. Its module docstring gives that arithmetic.

Kernel bodies are swappable (``make_attention(forward_body=, dkdv_body=, dq_body=)``)
so that test variants reuse the tiling, the custom_vjp wiring and the public signature
and change only the arithmetic; ``Tile`` carries the static facts and the building
blocks (``logits``, ``load_rows``...).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels import block_io, mosaic_gpu_attention, tiling, validation
from pallascheck.kernels.backends import Backend, get_backend, resolve_config

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class Config:
    block_q: int = 64
    block_k: int = 64
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps: int = 4  # GPU only
    num_stages: int = 2  # GPU only

    def __post_init__(self) -> None:
        # 16 is the smallest tile Triton's tensor-core dot accepts.
        for field in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            validation.require_positive_power_of_two(f"config.{field}", getattr(self, field), 16)
        validation.require_positive_power_of_two("config.num_warps", self.num_warps)
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"config.num_stages must be an int >= 1, got {self.num_stages!r}")


def padded_head_dim(head_dim: int) -> int:
    """D_padded: the next power of two >= max(head_dim, 16) (the width of every block)."""
    return max(16, 1 << max(0, (head_dim - 1).bit_length()))


def configs(
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    backend: str | Backend | None = None,
    itemsize: int = 2,
    bias: bool = True,
) -> list[Config] | list[mosaic_gpu_attention.Config]:
    """The autotuning space for the given lengths and head_dim of ``itemsize``-byte inputs
    (``mosaic_gpu_attention.Config`` on the Mosaic GPU backends); ``bias=False`` adds the
    GPU configs whose tiles fit shared memory only without a bias or mask."""
    be = get_backend(backend)
    if be.is_mosaic_gpu:
        return mosaic_gpu_attention.configs(seq_q, seq_kv, head_dim, be, itemsize, bias)
    width = padded_head_dim(head_dim)
    if not be.is_triton:  # interpreters: keep the space small, every config costs a compile
        qs, ks = tiling.blocks_for(seq_q, (16, 32)), tiling.blocks_for(seq_kv, (16, 32))
        fwd = list(itertools.product(qs, ks))
        # backward blocks: the forward ones, and one transposed pair to vary them
        return [Config(bq, bk, bq, bk) for bq, bk in fwd] + [Config(qs[0], ks[0], ks[-1], qs[-1])]
    out = []
    for bq, bk, (bqb, bkb), warps, stages in itertools.product(
        tiling.blocks_for(seq_q, (64, 128)),
        tiling.blocks_for(seq_kv, (32, 64, 128)),
        ((64, 64), (32, 64), (64, 128)),
        (4, 8),
        (2, 3),
    ):
        # Fitted to what Triton requested when it refused f32 configs on an H200 (jax
        # 0.11.2; 245760, 262144, 278528, 393216 bytes): the forward pipelines k and v
        # (q stays in registers) plus the f32 bias tile per stage, or without a bias
        # one tile for p; the backward pipelines q and dO, holds k and v, plus the
        # bias tile per stage. Exact for four of those refusals, above the other two.
        tile = bq * bk
        fwd_bytes = stages * 2 * bk * width * itemsize + (stages * tile * 4 if bias else tile * itemsize)
        bwd_bytes = (stages * 2 * bqb + 2 * bkb) * width * itemsize + (stages * bqb * bkb * 4 if bias else 0)
        if max(fwd_bytes, bwd_bytes) <= tiling.GPU_SHARED_MEMORY_BYTES:
            out.append(Config(bq, bk, bqb, bkb, warps, stages))
    return out


# ---------------------------------------------------------------------------------
# Kernel building blocks


@dataclasses.dataclass(frozen=True)
class Tile:
    """Static facts shared by the kernel bodies, and their masked loads.

    ``offset = seq_kv - seq_q``: query i sees key j under causality iff j <= i + offset.
    """

    seq_q: int
    seq_kv: int
    head_dim: int
    width: int  # D_padded
    causal: bool
    sm_scale: float
    has_bias: bool
    has_mask: bool
    masked_io: bool

    @property
    def offset(self) -> int:
        return self.seq_kv - self.seq_q

    def col_ok(self) -> jax.Array:
        return lax.broadcasted_iota(jnp.int32, (1, self.width), 1) < self.head_dim

    def positions(self, start: Any, size: int, axis: int) -> jax.Array:
        shape = (size, 1) if axis == 0 else (1, size)
        return start + lax.broadcasted_iota(jnp.int32, shape, axis)

    def load_rows(self, ref: Any, start: Any, size: int, length: int) -> tuple[jax.Array, jax.Array]:
        """Rows [start, start+size) of a (rows, D_padded) ref, zeros past ``length``
        and past head_dim; returns (block, row_ok (size, 1))."""
        rows = self.positions(start, size, 0)
        row_ok = rows < length
        block = block_io.load(ref.at[pl.ds(start, size), :], row_ok & self.col_ok(), masked_io=self.masked_io)
        return block, row_ok

    def load_vector(self, ref: Any, start: Any, size: int) -> jax.Array:
        """Entries [start, start+size) of a (seq_q,) f32 residual, as a (size, 1) column."""
        ok = self.positions(start, size, 0)[:, 0] < self.seq_q
        vec = block_io.load(ref.at[pl.ds(start, size)], ok, masked_io=self.masked_io)
        return vec[:, None]

    def logits(
        self,
        q: jax.Array,
        k: jax.Array,
        bias_ref: Any,
        mask_ref: Any,
        q_start: Any,
        k_start: Any,
        window: tuple[Any, Any],
    ) -> jax.Array:
        """f32 logits of the (block_q, block_k) tile of queries from ``q_start`` and
        keys from ``k_start``, -inf where the key is not visible: past seq_kv, past
        seq_q (padded query rows), masked, above the causal diagonal, or given a -inf
        bias. ``bias_ref``/``mask_ref`` (or None) are read at ``window`` = the tile's
        (first row, first column) inside the refs' blocks."""
        block_q, block_k = q.shape[0], k.shape[0]
        rows = self.positions(q_start, block_q, 0)
        cols = self.positions(k_start, block_k, 1)
        visible = (rows < self.seq_q) & (cols < self.seq_kv)
        # f32 logits at full f32 precision (IEEE on Triton, not tf32): logit errors are
        # exponentiated, and a tf32 q.k errs by ~1 at |s| ~ 1e3 (a factor e in p).
        precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
        s = s * jnp.float32(self.sm_scale)
        window = (pl.ds(window[0], block_q), pl.ds(window[1], block_k))
        if self.has_bias:
            bias = block_io.load(bias_ref.at[window], visible, masked_io=self.masked_io)
            s = s + bias.astype(jnp.float32)
        if self.has_mask:
            mask = block_io.load(mask_ref.at[window], visible, masked_io=self.masked_io)
            visible = visible & (mask != 0)
        if self.causal:
            visible = visible & (cols <= rows + self.offset)
        return jnp.where(visible, s, NEG_INF)

    def kv_blocks_seen(self, q_block: Any, block_q: int, block_k: int) -> Any:
        """How many kv blocks (from 0) hold a key some query of this q block sees."""
        total = pl.cdiv(self.seq_kv, block_k)
        if not self.causal:
            return total
        last_col = (q_block + 1) * block_q + self.offset  # exclusive
        return jnp.clip(lax.div(last_col + block_k - 1, block_k), 0, total)

    def first_q_block_seeing(self, kv_block: Any, block_q: int, block_k: int) -> Any:
        """The first q block with a query that sees a key of this kv block."""
        if not self.causal:
            return 0
        first_row = kv_block * block_k - self.offset
        return jnp.clip(lax.div(jnp.maximum(first_row, 0), block_q), 0, pl.cdiv(self.seq_q, block_q))


def guard_neg_inf(x: jax.Array) -> jax.Array:
    """x with -inf replaced by 0, so that exp(s - x) is 0 (not NaN) for s = -inf."""
    return jnp.where(x == NEG_INF, jnp.zeros_like(x), x)


def dot_f32(a: jax.Array, b: jax.Array, contract: tuple[int, int] = (1, 0)) -> jax.Array:
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------
# Default kernel bodies. Refs (None where absent):
#   forward: q (block_q, Dp), k, v (seq_kv_padded, Dp), bias, mask (block_q, seq_kv_padded)
#            -> out (block_q, Dp), lse (block_q,)
#   dkdv:    q, do (seq_q_padded, Dp), k, v (block_k_bwd, Dp), lse, delta (seq_q_padded,),
#            bias, mask (seq_q_padded, block_k_bwd) -> dk, dv (block_k_bwd, Dp), ds (seq_q_padded, block_k_bwd)
#   dq:      q, do (block_q_bwd, Dp), k, v (seq_kv_padded, Dp), lse, delta (block_q_bwd,),
#            bias, mask (block_q_bwd, seq_kv_padded) -> dq (block_q_bwd, Dp)


def _forward_kernel(q_ref, k_ref, v_ref, bias_ref, mask_ref, o_ref, lse_ref, *, tile: Tile, block_k: int):
    block_q = q_ref.shape[0]
    i = pl.program_id(2)
    q_start = i * block_q
    q = block_io.load(
        q_ref, (tile.positions(q_start, block_q, 0) < tile.seq_q) & tile.col_ok(), masked_io=tile.masked_io
    )

    def step(j, carry):
        m, l, acc = carry
        k_start = pl.multiple_of(j * block_k, block_k)
        k, _ = tile.load_rows(k_ref, k_start, block_k, tile.seq_kv)
        v, _ = tile.load_rows(v_ref, k_start, block_k, tile.seq_kv)
        s = tile.logits(q, k, bias_ref, mask_ref, q_start, k_start, (0, k_start))
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        m_safe = guard_neg_inf(m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        acc = alpha * acc + dot_f32(p.astype(v.dtype), v)
        return m_new, l, acc

    init = (
        jnp.full((block_q, 1), NEG_INF, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
        jnp.zeros((block_q, tile.width), jnp.float32),
    )
    m, l, acc = lax.fori_loop(0, tile.kv_blocks_seen(i, block_q, block_k), step, init)
    store_forward(tile, o_ref, lse_ref, q_start, m, l, acc)


def store_forward(tile: Tile, o_ref, lse_ref, q_start, m, l, acc) -> None:
    """out = acc / l (0 where l = 0: fully masked row), lse = m + log(l) (-inf there)."""
    block_q = acc.shape[0]
    empty = l == 0.0
    l_safe = jnp.where(empty, jnp.ones_like(l), l)
    rows_ok = tile.positions(q_start, block_q, 0) < tile.seq_q
    block_io.store(o_ref, acc / l_safe, rows_ok & tile.col_ok(), masked_io=tile.masked_io)
    lse = jnp.where(empty, jnp.full_like(l, NEG_INF), guard_neg_inf(m) + jnp.log(l_safe))
    block_io.store(lse_ref, lse[:, 0], rows_ok[:, 0], masked_io=tile.masked_io)


def _dkdv_kernel(
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
    tile: Tile,
    block_q: int,
):
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
        dp = dot_f32(do, v, (1, 1))
        ds = p * (dp - tile.load_vector(delta_ref, q_start, block_q))
        dk = dk + dot_f32(ds.astype(q.dtype), q, (0, 0))
        if ds_ref is not None:
            store_ds(tile, ds_ref, ds, q_start, k_start)
        return dk, dv

    zeros = jnp.zeros((block_k, tile.width), jnp.float32)
    first = tile.first_q_block_seeing(j, block_q, block_k)
    if ds_ref is not None:  # q blocks above the causal diagonal are not visited: their ds is 0

        def zero_ds(i, carry):
            store_ds(tile, ds_ref, jnp.zeros((block_q, block_k), jnp.float32), i * block_q, k_start)
            return carry

        lax.fori_loop(0, first, zero_ds, 0)
    dk, dv = lax.fori_loop(first, pl.cdiv(tile.seq_q, block_q), step, (zeros, zeros))
    store_kv_grads(tile, dk_ref, dv_ref, dk * jnp.float32(tile.sm_scale), dv, k_start)


def store_ds(tile: Tile, ds_ref, ds, q_start, k_start) -> None:
    """ds rows of this q block into the kv block's (seq_q_padded, block_k) window."""
    block_q, block_k = ds.shape
    ok = (tile.positions(q_start, block_q, 0) < tile.seq_q) & (tile.positions(k_start, block_k, 1) < tile.seq_kv)
    block_io.store(ds_ref.at[pl.ds(q_start, block_q), :], ds, ok, masked_io=tile.masked_io)


def store_kv_grads(tile: Tile, dk_ref, dv_ref, dk, dv, k_start) -> None:
    ok = (tile.positions(k_start, dk.shape[0], 0) < tile.seq_kv) & tile.col_ok()
    block_io.store(dk_ref, dk, ok, masked_io=tile.masked_io)
    block_io.store(dv_ref, dv, ok, masked_io=tile.masked_io)


def _dq_kernel(
    q_ref,
    do_ref,
    k_ref,
    v_ref,
    lse_ref,
    delta_ref,
    bias_ref,
    mask_ref,
    dq_ref,
    *,
    tile: Tile,
    block_k: int,
):
    block_q = q_ref.shape[0]
    i = pl.program_id(2)
    q_start = i * block_q
    rows_ok = (tile.positions(q_start, block_q, 0) < tile.seq_q) & tile.col_ok()
    q = block_io.load(q_ref, rows_ok, masked_io=tile.masked_io)
    do = block_io.load(do_ref, rows_ok, masked_io=tile.masked_io)
    lse = guard_neg_inf(load_block_vector(tile, lse_ref, q_start))
    delta = load_block_vector(tile, delta_ref, q_start)

    def step(j, dq):
        k_start = pl.multiple_of(j * block_k, block_k)
        k, _ = tile.load_rows(k_ref, k_start, block_k, tile.seq_kv)
        v, _ = tile.load_rows(v_ref, k_start, block_k, tile.seq_kv)
        s = tile.logits(q, k, bias_ref, mask_ref, q_start, k_start, (0, k_start))
        p = jnp.exp(s - lse)
        ds = p * (dot_f32(do, v, (1, 1)) - delta)
        return dq + dot_f32(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, tile.kv_blocks_seen(i, block_q, block_k), step, jnp.zeros((block_q, tile.width), jnp.float32))
    block_io.store(dq_ref, dq * jnp.float32(tile.sm_scale), rows_ok, masked_io=tile.masked_io)


def load_block_vector(tile: Tile, ref, q_start) -> jax.Array:
    """A (block_q,) residual block as a (block_q, 1) column, zeros past seq_q."""
    ok = tile.positions(q_start, ref.shape[0], 0)[:, 0] < tile.seq_q
    return block_io.load(ref, ok, masked_io=tile.masked_io)[:, None]


KernelBody = Callable[..., None]


@dataclasses.dataclass(frozen=True)
class Bodies:
    forward: KernelBody = _forward_kernel
    dkdv: KernelBody = _dkdv_kernel
    dq: KernelBody = _dq_kernel


# ---------------------------------------------------------------------------------
# pallas_calls


@dataclasses.dataclass(frozen=True)
class Static:
    """Everything static about one call (hashable: a jit static argument)."""

    causal: bool
    sm_scale: float
    bias_shape: tuple[int, ...] | None  # rank 4, dims 1 or full
    has_mask: bool
    config: Config | mosaic_gpu_attention.Config
    backend: Backend
    bodies: Bodies
    mosaic_bodies: mosaic_gpu_attention.Bodies


def _tile(q, k, st: Static) -> Tile:
    return Tile(
        seq_q=q.shape[1],
        seq_kv=k.shape[1],
        head_dim=q.shape[3],
        width=padded_head_dim(q.shape[3]),
        causal=st.causal,
        sm_scale=st.sm_scale,
        has_bias=st.bias_shape is not None,
        has_mask=st.has_mask,
        masked_io=st.backend.is_triton,
    )


def _pair_spec(shape: tuple[int, ...], rows: int, cols: int, blocked_axis: int):
    """BlockSpec of (rows, cols) blocks over a rank-4 [b, h, seq_q, seq_kv] bias or
    mask whose batch/head dims are 1 or full (broadcast dims are read at index 0); the
    third grid index walks ``blocked_axis`` (0: seq_q, 1: seq_kv), the other is whole."""
    bb, hb = shape[0] > 1, shape[1] > 1

    def index(b, h, x):
        return (b if bb else 0, h if hb else 0, x if blocked_axis == 0 else 0, x if blocked_axis == 1 else 0)

    return pl.BlockSpec((None, None, rows, cols), index)


def _padded(n: int, block: int) -> int:
    """The length a whole-sequence block spans: a power of two >= n and >= block (the
    kernels only slice it in block steps and never touch past n, but Triton wants
    power-of-two block shapes)."""
    return max(block, 1 << max(0, (n - 1).bit_length()))


def _mosaic_args(st: Static) -> dict[str, Any]:
    return dict(causal=st.causal, sm_scale=st.sm_scale, config=st.config, backend=st.backend, bodies=st.mosaic_bodies)


def _pallas_config(st: Static) -> Config:
    """The config of a backend other than Mosaic GPU's (resolve_config picks it by backend)."""
    if not isinstance(st.config, Config):
        raise TypeError(f"attention on {st.backend} takes an attention.Config, got {type(st.config).__name__}")
    return st.config


def _forward(q, k, v, bias, mask, st: Static):
    if st.backend.is_mosaic_gpu:
        return mosaic_gpu_attention.forward(q, k, v, bias, mask, **_mosaic_args(st))
    config = _pallas_config(st)
    tile = _tile(q, k, st)
    (batch, seq_q, heads, _), seq_kv = q.shape, k.shape[1]
    group = heads // k.shape[2]
    bq, bk, w = config.block_q, config.block_k, tile.width
    kv_len = _padded(seq_kv, bk)
    row = pl.BlockSpec((None, bq, None, w), lambda b, h, i: (b, i, h, 0))
    kv = pl.BlockSpec((None, kv_len, None, w), lambda b, h, i: (b, 0, h // group, 0))
    in_specs, args = [row, kv, kv], [q, k, v]
    for extra in (bias, mask):
        if extra is not None:
            in_specs.append(_pair_spec(extra.shape, bq, kv_len, 0))
            args.append(extra)
    has_bias, has_mask = bias is not None, mask is not None

    def kernel(*refs):
        q_ref, k_ref, v_ref = refs[:3]
        rest = list(refs[3:])
        bias_ref = rest.pop(0) if has_bias else None
        mask_ref = rest.pop(0) if has_mask else None
        st.bodies.forward(q_ref, k_ref, v_ref, bias_ref, mask_ref, *rest, tile=tile, block_k=bk)

    out, lse = st.backend.pallas_call(
        kernel,
        grid=(batch, heads, pl.cdiv(seq_q, bq)),
        in_specs=in_specs,
        out_specs=[row, pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32)],
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        dimension_semantics=("parallel", "parallel", "parallel"),
        name="pallascheck_attention_fwd",
    )(*args)
    return out, lse


def _backward(q, k, v, bias, mask, out, lse, do, st: Static):
    if st.backend.is_mosaic_gpu:
        return mosaic_gpu_attention.backward(q, k, v, bias, mask, out, lse, do, **_mosaic_args(st))
    config = _pallas_config(st)
    tile = _tile(q, k, st)
    (batch, seq_q, heads, head_dim), seq_kv, heads_kv = q.shape, k.shape[1], k.shape[2]
    group = heads // heads_kv
    bq, bk, w = config.block_q_bwd, config.block_k_bwd, tile.width
    q_len, kv_len = _padded(seq_q, bq), _padded(seq_kv, bk)
    delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    has_bias, has_mask = bias is not None, mask is not None
    extras = [x for x in (bias, mask) if x is not None]
    sem = ("parallel", "parallel", "parallel")

    def split(refs, n_in):
        ins, outs = list(refs[:n_in]), list(refs[n_in:])
        fixed = ins[:6]
        rest = ins[6:]
        bias_ref = rest.pop(0) if has_bias else None
        mask_ref = rest.pop(0) if has_mask else None
        return fixed, bias_ref, mask_ref, outs

    # dk, dv: one program per kv block, looping over q blocks
    q_all = pl.BlockSpec((None, q_len, None, w), lambda b, h, j: (b, 0, h, 0))
    kv_block = pl.BlockSpec((None, bk, None, w), lambda b, h, j: (b, j, h // group, 0))
    vec_all = pl.BlockSpec((None, None, q_len), lambda b, h, j: (b, h, 0))
    in_specs = [q_all, q_all, kv_block, kv_block, vec_all, vec_all]
    in_specs += [_pair_spec(x.shape, q_len, bk, 1) for x in extras]
    kv_dtype = k.dtype if group == 1 else jnp.float32
    out_kv = pl.BlockSpec((None, bk, None, w), lambda b, h, j: (b, j, h, 0))
    out_specs = [out_kv, out_kv]
    out_shape = [jax.ShapeDtypeStruct((batch, seq_kv, heads, head_dim), kv_dtype)] * 2
    if has_bias:
        out_specs.append(pl.BlockSpec((None, None, q_len, bk), lambda b, h, j: (b, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, seq_q, seq_kv), jnp.float32))

    def dkdv_kernel(*refs):
        fixed, bias_ref, mask_ref, outs = split(refs, len(in_specs))
        ds_ref = outs[2] if has_bias else None
        st.bodies.dkdv(*fixed, bias_ref, mask_ref, outs[0], outs[1], ds_ref, tile=tile, block_q=bq)

    outs = st.backend.pallas_call(
        dkdv_kernel,
        grid=(batch, heads, pl.cdiv(seq_kv, bk)),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        dimension_semantics=sem,
        name="pallascheck_attention_dkdv",
    )(q, do, k, v, lse, delta, *extras)
    dk, dv = outs[0], outs[1]
    if group > 1:  # f32 partials per q head -> one sum per kv head
        dk = dk.reshape(batch, seq_kv, heads_kv, group, head_dim).sum(3).astype(k.dtype)
        dv = dv.reshape(batch, seq_kv, heads_kv, group, head_dim).sum(3).astype(v.dtype)
    ds = outs[2] if has_bias else None

    # dq: one program per q block, looping over kv blocks
    q_block = pl.BlockSpec((None, bq, None, w), lambda b, h, i: (b, i, h, 0))
    kv_all = pl.BlockSpec((None, kv_len, None, w), lambda b, h, i: (b, 0, h // group, 0))
    vec_block = pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))
    in_specs = [q_block, q_block, kv_all, kv_all, vec_block, vec_block]
    in_specs += [_pair_spec(x.shape, bq, kv_len, 0) for x in extras]

    def dq_kernel(*refs):
        fixed, bias_ref, mask_ref, outs = split(refs, len(in_specs))
        st.bodies.dq(*fixed, bias_ref, mask_ref, outs[0], tile=tile, block_k=bk)

    dq = st.backend.pallas_call(
        dq_kernel,
        grid=(batch, heads, pl.cdiv(seq_q, bq)),
        in_specs=in_specs,
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        dimension_semantics=sem,
        name="pallascheck_attention_dq",
    )(q, do, k, v, lse, delta, *extras)
    return dq, dk, dv, ds


# ---------------------------------------------------------------------------------
# Wiring: custom_vjp, jit, validation, public signature.


def make_attention(
    bodies: Bodies = Bodies(), mosaic_bodies: mosaic_gpu_attention.Bodies = mosaic_gpu_attention.Bodies()
) -> Callable[..., jax.Array]:
    """Build ``attention`` (the public signature) around the given kernel bodies (the
    Pallas ones, and the Mosaic GPU steps the Mosaic GPU backends run)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
    def core(q, k, v, bias, mask, st):
        return _forward(q, k, v, bias, mask, st)[0]

    def core_fwd(q, k, v, bias, mask, st):
        out, lse = _forward(q, k, v, bias, mask, st)
        return out, (q, k, v, bias, mask, out, lse)

    def core_bwd(st, residuals, do):
        q, k, v, bias, mask, out, lse = residuals
        dq, dk, dv, ds = _backward(q, k, v, bias, mask, out, lse, do, st)
        dbias = None
        if bias is not None:  # sum ds over the dims the bias broadcasts along
            axes = tuple(a for a in range(4) if bias.shape[a] == 1 and ds.shape[a] != 1)
            dbias = jnp.sum(ds, axis=axes, keepdims=True).astype(bias.dtype)
        dmask = None if mask is None else np.zeros(mask.shape, jax.dtypes.float0)
        return dq, dk, dv, dbias, dmask

    core.defvjp(core_fwd, core_bwd)

    @functools.partial(jax.jit, static_argnames=("st",))
    def apply(q, k, v, bias, mask, *, st: Static):
        seq_q, seq_kv = q.shape[1], k.shape[1]
        if bias is not None:  # rank 4, seq dims materialised, batch/head dims kept at 1
            bias4 = bias.reshape(_rank4(bias.shape))
            if bias4.shape[2:] != (seq_q, seq_kv):  # dbias sums over a seq dim: keep it in f32
                bias4 = bias4.astype(jnp.float32)
            bias = jnp.broadcast_to(bias4, bias4.shape[:2] + (seq_q, seq_kv))
        if mask is not None:
            mask4 = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
            mask = jnp.broadcast_to(mask4, mask4.shape[:2] + (seq_q, seq_kv)).astype(jnp.int8)
        return core(q, k, v, bias, mask, st)

    def attention(q, k, v, *, bias=None, mask=None, causal=False, sm_scale=None, config=None, backend=None):
        be = get_backend(backend)
        sm_scale = _validate(q, k, v, bias, mask, causal, sm_scale)
        config = resolve_config(
            config,
            be,
            Config,
            mosaic_gpu_attention.Config,
            kernel="attention",
            arrays={"q": q, "k": k, "v": v, "bias": bias, "mask": mask},
            options={"causal": bool(causal), "sm_scale": sm_scale},
        )
        st = Static(
            causal=bool(causal),
            sm_scale=sm_scale,
            bias_shape=None if bias is None else _rank4(bias.shape),
            has_mask=mask is not None,
            config=config,
            backend=be,
            bodies=bodies,
            mosaic_bodies=mosaic_bodies,
        )
        return apply(q, k, v, bias, mask, st=st)

    attention.__doc__ = ATTENTION_DOC
    return attention


def _rank4(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (1,) * (4 - len(shape)) + tuple(shape)


ATTENTION_DOC = """Flash attention ``softmax(sm_scale * q k^T + bias, masked) v``.

q: [batch, seq_q, heads_q, head_dim]; k, v: [batch, seq_kv, heads_kv, head_dim] with
heads_q a multiple of heads_kv (GQA/MQA); all f32, bf16 or f16, one dtype. ``bias``
(float) and ``mask`` (bool, True = visible) broadcast to [batch, heads_q, seq_q,
seq_kv]. ``causal`` is aligned bottom-right (query i sees key j iff
j <= i + seq_kv - seq_q). A query that sees no key gets output 0 and zero gradients.
Differentiable in q, k, v and bias (Pallas backward kernels). See the module
docstring for the arithmetic."""

attention = make_attention()


def _validate(q, k, v, bias, mask, causal, sm_scale) -> float:
    for name, x in (("q", q), ("k", k), ("v", v)):
        validation.require_array(name, x)
        validation.require_rank(name, x, 4, " ([batch, seq, heads, head_dim])")
        validation.require_float_dtype(name, x.dtype)
        validation.require_nonempty(name, tuple(x.shape))
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head_dim must match: q.shape[3]={q.shape[3]} != k.shape[3]={k.shape[3]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"the number of kv heads must divide the number of q heads, got heads_q={q.shape[2]}, heads_kv={k.shape[2]}"
        )
    target = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    for name, x in (("bias", bias), ("mask", mask)):
        if x is None:
            continue
        validation.require_array(name, x)
        if x.ndim > 4 or any(d not in (1, t) for d, t in zip(_rank4(x.shape), target)):
            raise ValueError(
                f"{name} must broadcast to [batch, heads_q, seq_q, seq_kv] = {list(target)}, got shape {tuple(x.shape)}"
            )
    if bias is not None:
        validation.require_float_dtype("bias", bias.dtype)
    if mask is not None and mask.dtype != jnp.bool_:
        raise TypeError(f"mask must have dtype bool (True = visible), got {jnp.dtype(mask.dtype).name}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if sm_scale is None:
        return 1.0 / math.sqrt(q.shape[3])
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real) or not math.isfinite(sm_scale):
        raise TypeError(f"sm_scale must be a finite float or None, got {sm_scale!r}")
    return float(sm_scale)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale"))
def xla_reference(q, k, v, *, bias=None, mask=None, causal=False, sm_scale=None) -> jax.Array:
    """What a user writes instead: plain jax.numpy in the input dtype, same semantics.

    Logits and p.v are XLA dots accumulating in f32 and rounded to the input dtype,
    the logits after sm_scale multiplies them in f32 (rounded unscaled, float16 logits
    of about 1e3 after scaling overflowed at s4096 d128: rows of NaN), the bias adds
    in the input dtype; the softmax runs in
    the input dtype (jnp.sum accumulates its row sums in f32 and rounds once); a row
    with no visible key gives 0 (its max is replaced by 0 and its sum by 1).
    """
    dtype = q.dtype
    group = q.shape[2] // k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[3]) if sm_scale is None else sm_scale
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    s = (s * jnp.float32(scale)).astype(dtype)
    if bias is not None:
        s = s + bias.astype(dtype)
    seq_q, seq_kv = q.shape[1], k.shape[1]
    visible = jnp.ones((seq_q, seq_kv), bool)
    if causal:
        visible = jnp.arange(seq_kv)[None, :] <= jnp.arange(seq_q)[:, None] + (seq_kv - seq_q)
    if mask is not None:
        visible = visible & mask
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isneginf(m), jnp.zeros_like(m), m)
    e = jnp.exp(s - m)
    l = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(l == 0, jnp.ones_like(l), l)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=jnp.float32).astype(dtype)
