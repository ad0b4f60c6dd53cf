"""Fused ``cross_entropy(x @ w, labels)`` that never writes the [tokens, vocab] logits.

``linear_softmax_cross_entropy(x [T, H], w [H, V], labels [T], *, label_smoothing,
ignore_index, reduction, config, backend)`` has exactly the semantics of
``cross_entropy(x @ w, labels, ...)`` (kernels/cross_entropy.py: smoothing
convention, ignored tokens, "mean" over non-ignored tokens, 0 when all are ignored,
f32 loss, bad labels) with the logits formed in f32 from ``x`` and ``w`` of the same
dtype (f32, bf16 or f16). There is no vocabulary-parallel mode here: shard the
vocabulary with ``cross_entropy(..., axis_name=)`` on materialised logit shards.

Forward kernel: a 1-D grid over blocks of ``block_t`` tokens. For each vocabulary
tile of ``block_v`` columns the program forms the logits tile in registers,
    z = sum over H chunks of block_h:  dot(x[:, chunk], w[chunk, tile])   (f32 accumulate)
(rows past T, H columns past H and vocabulary columns past V masked to zero on load),
and feeds it to the same online-logsumexp update as the cross-entropy kernel
(running max, rescaled exp-sum, target logit, sum of logits minus the max). Only the
[T] statistics are written; the loss is finished in XLA exactly as in cross_entropy
(every term a difference to the row's max, so large logits lose nothing).

Backward kernels (``custom_vjp``; residuals x, w, labels, the row max m and log of
the exp-sum). Both recompute logits tiles and
``dlogits = g * ((exp((z - m) - log s) - c1 onehot) - c3)`` in f32, round it
to the input dtype (the dot operands must share a dtype), and contract it into an
f32 output that the program owns, one H chunk at a time (read, add, write):
- dx: grid over token blocks; for each vocabulary tile in order:
  dx[rows, chunk] += dlogits_tile @ w[chunk, tile]^T
- dw: grid over vocabulary tiles; for each token block in order:
  dw[chunk, tile] += x[rows, chunk]^T @ dlogits_tile
then XLA rounds dx and dw once to the input dtype. Each backward kernel recomputes
the logits once, so forward + backward costs about four x @ w products and the
memory stays O(T H + H V) (plus f32 copies of dx and dw).

``xla_reference`` is the naive path a user writes: ``jnp.dot(x, w,
preferred_element_type=f32)`` materialising the logits, then
``cross_entropy.xla_reference``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels import block_io, pinning, validation
from pallascheck.kernels import cross_entropy as ce
from pallascheck.kernels.backends import Backend, get_backend


@dataclasses.dataclass(frozen=True)
class Config:
    block_t: int = 16
    block_v: int = 64
    block_h: int = 32
    num_warps: int = 4  # GPU only
    num_stages: int = 1  # GPU only

    def __post_init__(self) -> None:
        # 16 is the smallest tile Triton's tensor-core dot accepts.
        for field in ("block_t", "block_v", "block_h"):
            validation.require_positive_power_of_two(f"config.{field}", getattr(self, field), 16)
        validation.require_positive_power_of_two("config.num_warps", self.num_warps)
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"config.num_stages must be an int >= 1, got {self.num_stages!r}")


def configs(tokens: int, hidden: int, vocab: int, backend: str | Backend | None = None) -> list[Config]:
    """The autotuning space for x [tokens, hidden] @ w [hidden, vocab]."""
    be = get_backend(backend)
    bts: tuple[int, ...]
    warps: tuple[int, ...]
    stages: tuple[int, ...]
    if be.is_triton:
        bts, bvs, bhs, warps, stages = (32, 64), (64, 128), (32, 64), (4, 8), (1, 2)
    else:  # interpreters: keep the space small, every config costs a compile
        bts, bvs, bhs, warps, stages = (16,), (32, 64), (16, 32), (4,), (1,)

    def fit(size: int, choices: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(b for b in choices if b < 2 * max(size, 16)) or (min(choices),)

    return [
        Config(t, v, h, w, s)
        for t, v, h, w, s in itertools.product(fit(tokens, bts), fit(vocab, bvs), fit(hidden, bhs), warps, stages)
    ]


@dataclasses.dataclass(frozen=True)
class Dims:
    """Static sizes and masks shared by the three kernels."""

    tokens: int
    hidden: int
    vocab: int
    config: Config
    masked_io: bool

    @property
    def h_chunks(self) -> int:
        return pl.cdiv(self.hidden, self.config.block_h)

    @property
    def v_tiles(self) -> int:
        return pl.cdiv(self.vocab, self.config.block_v)

    @property
    def t_blocks(self) -> int:
        return pl.cdiv(self.tokens, self.config.block_t)

    def iota(self, start: Any, size: int, axis: int) -> jax.Array:
        shape = (size, 1) if axis == 0 else (1, size)
        return start + lax.broadcasted_iota(jnp.int32, shape, axis)

    def load(self, ref: Any, rows: Any, cols: Any, ok: jax.Array) -> jax.Array:
        return block_io.load(ref.at[rows, cols], ok, masked_io=self.masked_io)

    def logits_tile(
        self, x_ref: Any, w_ref: Any, x_row: Any, w_col: Any, row_ok: jax.Array, col_ok: jax.Array
    ) -> jax.Array:
        """f32 (block_t, block_v) tile of x @ w from rows ``x_row``.. of the x block and
        columns ``w_col``.. of the w block (offsets inside the refs), zero padding."""
        bt, bv, bh = self.config.block_t, self.config.block_v, self.config.block_h

        def chunk(k, acc):
            h0 = pl.multiple_of(k * bh, bh)
            x = self.load(x_ref, pl.ds(x_row, bt), pl.ds(h0, bh), row_ok & (self.iota(h0, bh, 1) < self.hidden))
            w = self.load(w_ref, pl.ds(h0, bh), pl.ds(w_col, bv), (self.iota(h0, bh, 0) < self.hidden) & col_ok)
            return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

        return lax.fori_loop(0, self.h_chunks, chunk, jnp.zeros((bt, bv), jnp.float32))

    def dlogits_tile(
        self,
        z: jax.Array,
        cols: jax.Array,
        labels: jax.Array,
        m: jax.Array,
        log_s: jax.Array,
        g: jax.Array,
        c1: float,
        c3: float,
    ) -> jax.Array:
        """g * ((exp((z - m) - log s) - c1 onehot) - c3) in f32, exactly 0 where g == 0 or past V."""
        d = ce.softmax_tile(z, m, log_s) - jnp.where(cols == labels, c1, 0.0)
        if c3 != 0.0:
            d = d - c3
        return jnp.where((g == 0.0) | (cols >= self.vocab), 0.0, g * d)

    def accumulate(self, ref: Any, rows: Any, cols: Any, ok: jax.Array, update: jax.Array, first: Any) -> None:
        """ref[rows, cols] (f32) = update on the first visit, += update after."""
        old = block_io.load(ref.at[rows, cols], ok, masked_io=self.masked_io)
        total = jnp.where(first, update, old + update)
        block_io.store(ref.at[rows, cols], total, ok, masked_io=self.masked_io)


def _forward_kernel(x_ref, w_ref, labels_ref, m_ref, s_ref, t_ref, sd_ref, *, dims: Dims):
    """x block: this program's token rows; w: whole."""
    bt, bv = dims.config.block_t, dims.config.block_v
    row_ok = dims.iota(pl.program_id(0) * bt, bt, 0) < dims.tokens
    labels = block_io.load(labels_ref, row_ok, masked_io=dims.masked_io)

    def step(j, carry):
        v0 = pl.multiple_of(j * bv, bv)
        cols = dims.iota(v0, bv, 1)
        z = dims.logits_tile(x_ref, w_ref, 0, v0, row_ok, cols < dims.vocab)
        return ce.online_update(carry, z, cols < dims.vocab, cols, labels, v0)

    stats = lax.fori_loop(0, dims.v_tiles, step, ce.initial_stats(bt))
    for ref, value in zip((m_ref, s_ref, t_ref, sd_ref), stats):
        block_io.store(ref, value, row_ok, masked_io=dims.masked_io)


def _dx_kernel(x_ref, w_ref, labels_ref, m_ref, log_s_ref, g_ref, dx_ref, *, dims: Dims, c1: float, c3: float):
    """x, dx (f32) blocks: this program's token rows; w: whole. For every vocabulary
    tile: dlogits tile, then dx[:, chunk] += dlogits @ w[chunk, tile]^T per H chunk."""
    bt, bv, bh = dims.config.block_t, dims.config.block_v, dims.config.block_h
    row_ok = dims.iota(pl.program_id(0) * bt, bt, 0) < dims.tokens
    labels, m, log_s, g = (
        block_io.load(r, row_ok, masked_io=dims.masked_io) for r in (labels_ref, m_ref, log_s_ref, g_ref)
    )

    def step(j, carry):
        v0 = pl.multiple_of(j * bv, bv)
        cols = dims.iota(v0, bv, 1)
        col_ok = cols < dims.vocab
        d = dims.dlogits_tile(dims.logits_tile(x_ref, w_ref, 0, v0, row_ok, col_ok), cols, labels, m, log_s, g, c1, c3)

        def chunk(k, c):
            h0 = pl.multiple_of(k * bh, bh)
            w = dims.load(w_ref, pl.ds(h0, bh), pl.ds(v0, bv), (dims.iota(h0, bh, 0) < dims.hidden) & col_ok)
            # (bt, bv) x (bh, bv) contracted over the vocabulary: dlogits @ w^T
            update = lax.dot_general(d.astype(w.dtype), w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            dims.accumulate(
                dx_ref, slice(None), pl.ds(h0, bh), row_ok & (dims.iota(h0, bh, 1) < dims.hidden), update, j == 0
            )
            return c

        return lax.fori_loop(0, dims.h_chunks, chunk, carry)

    lax.fori_loop(0, dims.v_tiles, step, 0)


def _dw_kernel(x_ref, w_ref, labels_ref, m_ref, log_s_ref, g_ref, dw_ref, *, dims: Dims, c1: float, c3: float):
    """w, dw (f32) blocks: this program's vocabulary tile; x, labels, m, log_s, g: whole.
    For every token block: dlogits tile, then dw[chunk, :] += x[rows, chunk]^T @ dlogits."""
    bt, bv, bh = dims.config.block_t, dims.config.block_v, dims.config.block_h
    cols = dims.iota(pl.program_id(0) * bv, bv, 1)
    col_ok = cols < dims.vocab

    def step(i, carry):
        t0 = pl.multiple_of(i * bt, bt)
        row_ok = dims.iota(t0, bt, 0) < dims.tokens
        labels, m, log_s, g = (
            dims.load(r, pl.ds(t0, bt), slice(None), row_ok) for r in (labels_ref, m_ref, log_s_ref, g_ref)
        )
        d = dims.dlogits_tile(dims.logits_tile(x_ref, w_ref, t0, 0, row_ok, col_ok), cols, labels, m, log_s, g, c1, c3)

        def chunk(k, c):
            h0 = pl.multiple_of(k * bh, bh)
            h_ok = dims.iota(h0, bh, 1) < dims.hidden
            x = dims.load(x_ref, pl.ds(t0, bt), pl.ds(h0, bh), row_ok & h_ok)
            # (bt, bh) x (bt, bv) contracted over the tokens: x^T @ dlogits
            update = lax.dot_general(x, d.astype(x.dtype), (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            dims.accumulate(
                dw_ref, pl.ds(h0, bh), slice(None), (dims.iota(h0, bh, 0) < dims.hidden) & col_ok, update, i == 0
            )
            return c

        return lax.fori_loop(0, dims.h_chunks, chunk, carry)

    lax.fori_loop(0, dims.t_blocks, step, 0)


def _padded(size: int, block: int) -> int:
    return pl.cdiv(size, block) * block


def _whole(shape: tuple[int, ...]) -> pl.BlockSpec:
    zeros = (0,) * len(shape)
    return pl.BlockSpec(shape, lambda i: zeros)


def forward_call(
    x, w, labels, *, config: Config, backend: Backend, body: Callable[..., None] = _forward_kernel
) -> ce.Stats:
    (tokens, hidden), vocab = x.shape, w.shape[1]
    dims = Dims(tokens, hidden, vocab, config, backend.is_triton)
    bt = config.block_t
    hp, vp = _padded(hidden, config.block_h), _padded(vocab, config.block_v)
    col = pl.BlockSpec((bt, 1), lambda i: (i, 0))
    stat = jax.ShapeDtypeStruct((tokens, 1), jnp.float32)
    outs = backend.pallas_call(
        functools.partial(body, dims=dims),
        grid=(dims.t_blocks,),
        in_specs=[pl.BlockSpec((bt, hp), lambda i: (i, 0)), _whole((hp, vp)), col],
        out_specs=[col] * 4,
        out_shape=[stat] * 4,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        dimension_semantics=("parallel",),
        name="pallascheck_linear_cross_entropy_fwd",
    )(x, w, labels.reshape(tokens, 1))
    return ce.Stats(*(o[:, 0] for o in outs))


def backward_call(
    x,
    w,
    labels,
    m,
    log_s,
    g,
    *,
    c1: float,
    c3: float,
    config: Config,
    backend: Backend,
    dx_body: Callable[..., None] = _dx_kernel,
    dw_body: Callable[..., None] = _dw_kernel,
):
    """(dx [T, H] in x.dtype, dw [H, V] in w.dtype); m (row max), log_s (log of the
    exp-sum), g: [T] f32. The kernels
    accumulate in f32 outputs, rounded once to the input dtype here."""
    (tokens, hidden), vocab = x.shape, w.shape[1]
    dims = Dims(tokens, hidden, vocab, config, backend.is_triton)
    bt, bv, bh = config.block_t, config.block_v, config.block_h
    tp, hp, vp = _padded(tokens, bt), _padded(hidden, bh), _padded(vocab, bv)
    columns = [a.reshape(tokens, 1) for a in (labels, m, log_s, g)]
    common: dict[str, Any] = dict(
        num_warps=config.num_warps, num_stages=config.num_stages, dimension_semantics=("parallel",)
    )
    token_rows = pl.BlockSpec((bt, hp), lambda i: (i, 0))
    dx = backend.pallas_call(
        functools.partial(dx_body, dims=dims, c1=c1, c3=c3),
        grid=(dims.t_blocks,),
        in_specs=[token_rows, _whole((hp, vp))] + [pl.BlockSpec((bt, 1), lambda i: (i, 0))] * 4,
        out_specs=token_rows,
        out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
        name="pallascheck_linear_cross_entropy_dx",
        **common,
    )(x, w, *columns)
    vocab_cols = pl.BlockSpec((hp, bv), lambda j: (0, j))
    dw = backend.pallas_call(
        functools.partial(dw_body, dims=dims, c1=c1, c3=c3),
        grid=(dims.v_tiles,),
        in_specs=[_whole((tp, hp)), vocab_cols] + [_whole((tp, 1))] * 4,
        out_specs=vocab_cols,
        out_shape=jax.ShapeDtypeStruct(w.shape, jnp.float32),
        name="pallascheck_linear_cross_entropy_dw",
        **common,
    )(x, w, *columns)
    return dx.astype(x.dtype), dw.astype(w.dtype)


def make_linear_softmax_cross_entropy(
    forward_body: Callable[..., None] = _forward_kernel,
    dx_body: Callable[..., None] = _dx_kernel,
    dw_body: Callable[..., None] = _dw_kernel,
) -> Callable[..., jax.Array]:
    """Build ``linear_softmax_cross_entropy`` (same public signature) around the given bodies."""

    def token_losses(x, w, labels, eps, ignore_index, config, backend):
        vocab = w.shape[1]
        stats = forward_call(x, w, labels, config=config, backend=backend, body=forward_body)
        loss, log_s = ce.finish(stats, label_smoothing=eps, vocab=vocab)
        ignored = labels == ignore_index
        invalid = ~ignored & ((labels < 0) | (labels >= vocab))
        return jnp.where(ignored, 0.0, jnp.where(invalid, jnp.nan, loss)), (stats.max, log_s), ignored, invalid

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
    def core(x, w, labels, eps, ignore_index, config, backend):
        return token_losses(x, w, labels, eps, ignore_index, config, backend)[0]

    def core_fwd(x, w, labels, eps, ignore_index, config, backend):
        loss, (m, log_s), ignored, invalid = token_losses(x, w, labels, eps, ignore_index, config, backend)
        return loss, (x, w, labels, m, log_s, ignored, invalid)

    def core_bwd(eps, ignore_index, config, backend, residuals, g):
        x, w, labels, m, log_s, ignored, invalid = residuals
        c1, _, c3 = ce.constants(eps, w.shape[1])
        g = jnp.where(ignored, 0.0, jnp.where(invalid, jnp.nan, g.astype(jnp.float32)))
        dx, dw = backward_call(
            x, w, labels, m, log_s, g, c1=c1, c3=c3, config=config, backend=backend, dx_body=dx_body, dw_body=dw_body
        )
        return dx, dw, np.zeros(labels.shape, jax.dtypes.float0)

    core.defvjp(core_fwd, core_bwd)

    @functools.partial(jax.jit, static_argnames=("eps", "ignore_index", "reduction", "config", "backend"))
    def apply(x, w, labels, *, eps, ignore_index, reduction, config, backend):
        labels = labels.astype(jnp.int32)
        losses = core(x, w, labels, eps, ignore_index, config, backend)
        return ce.reduce(losses, labels != ignore_index, reduction)

    def linear_softmax_cross_entropy(
        x: jax.Array,
        w: jax.Array,
        labels: jax.Array,
        *,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        reduction: str = "mean",
        config: Config | None = None,
        backend: str | Backend | None = None,
    ) -> jax.Array:
        """``cross_entropy(x @ w, labels, ...)`` for x [T, H], w [H, V] (same float dtype),
        labels [T], without materialising the logits. Returns float32; differentiable in
        x and w (Pallas backward kernels)."""
        eps = _validate(x, w, labels, label_smoothing, ignore_index, reduction, config)
        backend = get_backend(backend)
        config = pinning.choose(
            "linear_cross_entropy",
            config,
            Config(),
            arrays={"x": x, "w": w, "labels": labels},
            options={"label_smoothing": eps, "ignore_index": int(ignore_index), "reduction": reduction},
            backend=backend.name,
        )
        return apply(
            x, w, labels, eps=eps, ignore_index=int(ignore_index), reduction=reduction, config=config, backend=backend
        )

    return linear_softmax_cross_entropy


def _validate(
    x: Any, w: Any, labels: Any, label_smoothing: Any, ignore_index: Any, reduction: Any, config: Any
) -> float:
    for name, a in (("x", x), ("w", w)):
        validation.require_array(name, a)
        validation.require_rank(name, a, 2)
        validation.require_nonempty(name, tuple(a.shape))
        validation.require_float_dtype(name, a.dtype)
    if x.dtype != w.dtype:
        raise TypeError(f"x and w must have the same dtype, got {x.dtype} and {w.dtype}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"contracting dimensions must match: x.shape[1]={x.shape[1]} != w.shape[0]={w.shape[0]}")
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a linear_cross_entropy.Config, got {type(config).__name__}")
    logits_like = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
    return ce.validate(logits_like, labels, label_smoothing, ignore_index, reduction, ce.Config(), None)


linear_softmax_cross_entropy = make_linear_softmax_cross_entropy()


@functools.partial(jax.jit, static_argnames=("label_smoothing", "ignore_index", "reduction"))
def xla_reference(
    x: jax.Array,
    w: jax.Array,
    labels: jax.Array,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> jax.Array:
    """The naive path: f32 logits materialised by one XLA dot, then cross-entropy."""
    logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
    return ce.xla_reference(
        logits, labels, label_smoothing=label_smoothing, ignore_index=ignore_index, reduction=reduction
    )
