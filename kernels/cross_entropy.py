"""Fused softmax cross-entropy over the last axis, with Pallas forward and backward
kernels, label smoothing, an ignore index and a vocabulary-parallel mode.

Semantics (PyTorch's ``F.cross_entropy`` and Transformer Engine's convention). For a
token with logits ``z`` (V classes), label ``y`` and smoothing ``eps``:

    lse  = log(sum_j exp(z_j))
    loss = (1 - eps) * (lse - z_y) + eps * (lse - mean_j z_j)
         = lse - (1 - eps) * z_y - eps * (sum_j z_j) / V

i.e. the smoothed target puts ``1 - eps + eps/V`` on the label and ``eps/V`` on every
class. Tokens whose label equals ``ignore_index`` contribute loss 0 and gradient 0.
``reduction``: ``"none"`` (per-token, shape ``labels.shape``), ``"sum"``, or
``"mean"`` = sum / (number of non-ignored tokens); when every token is ignored the
mean is defined as 0 (not NaN) and the gradient is exactly 0. The loss is returned in
float32 whatever the logits dtype; the gradient has the logits' dtype.

Labels: integer array of shape ``logits.shape[:-1]``. A label outside ``[0, V)`` that
is not ``ignore_index`` raises ``ValueError`` when the labels are concrete. Under
``jit`` (traced labels) the check cannot run; such a token's loss and gradient are
NaN instead, so a bad label is never silently turned into a plausible number.
Logits must be finite or ``-inf`` (masked classes). With ``label_smoothing > 0`` the
sum of a row's logits must stay finite in float32 (and a ``-inf`` logit makes the
smoothed loss infinite, as it is mathematically).

Kernel (forward): a 1-D grid over blocks of ``config.block_t`` tokens. Each program
loops over the vocabulary in tiles of ``config.block_v`` columns and keeps, per
token, f32 running statistics of an online logsumexp:
    m   running max                     m' = max(m, max(tile))
    s   sum of exp(z - m)               s' = s * exp(m - m') + sum(exp(tile - m'))
    t   the target logit z_y            t' = t + sum(where(col == y, tile, 0))
    sd  sum of (z - m), for smoothing   sd' = sd + n * (m - m') + sum(tile - m')
(``n`` = the columns before this tile). The last tile hangs past V: its columns are
masked with ``jnp.where`` (to -inf for the max and the exp-sum, 0 for the sums)
before any arithmetic, because the padding is NaN in the interpreters and another
row's memory on Triton. The kernel writes the four statistics ([T] f32 each); the
loss is finished elementwise in XLA in f32, in exactly this order:
    loss = (log(s) + c1 * (m - t)) + c2 * (-(sd / V)),  c1 = f32(1 - eps), c2 = f32(eps)
(a term whose constant is exactly 0 is skipped, so -inf logits do not make 0 * inf).

Why this form and not ``lse - c1 * t - c2 * mean(z)`` (the formula JAX's and
PyTorch's references write, and ``xla_reference`` below): that one subtracts two
numbers of the size of the logits, so in f32 it loses everything at |z| ~ 1e8 (the
loss of logits [z, z, z-1, z-2], label 0, is 0.9176 at every z and that formula
gives 0.0 at z = 1e8, 0.914 at 1e5). Here every term is a difference to the row's
max, all three terms are >= 0 and nothing cancels: the error is relative to the
loss and to |z - max|, and adding a constant to a row's logits changes nothing but
the rounding of those differences. Every piece of ``sd`` is <= 0 as well.

Kernel (backward, ``custom_vjp``; residuals logits, labels, m, log(s)): the same
grid recomputes softmax tile by tile, ``p = exp((z - m) - log(s))`` (never
``exp(z - lse)``: ``lse = m + log(s)`` rounded to f32 drops log(s) at |m| ~ 1e8),
and writes
    dlogits = g * ((p - c1 * onehot(y)) - c3),  c3 = f32(eps / V)
rounded to the logits dtype, where ``g`` is the per-token cotangent (0 for ignored
tokens: a token with cotangent exactly 0 gets gradient exactly 0). No
softmax-sized tensor exists besides the logits and their gradient.

Vocabulary-parallel mode (``axis_name``): call inside ``shard_map`` with the last
axis of ``logits`` sharded over the mesh axis ``axis_name`` (equal shards, in device
order) and the labels replicated over it. Labels are global class indices. Each
device runs the kernel on its shard with ``labels - shard_offset`` (only the owning
shard matches the label), then the statistics are combined:
    M = pmax(m);  S = psum(s * exp(m - M));  t = psum(t);
    sd = psum(sd + V_local * (m - M));  V = V_local * n
(every re-pivoted piece of sd is still <= 0) and the loss is finished as above on
every device (it is replicated over the axis). The backward pass is local: each
device writes its shard's gradient with the global M, log(S) and V. Differentiate inside the ``shard_map`` body (the loss is the same on
every device of the axis). Build the ``shard_map`` with ``check_vma=False``
(``compat.shard_map_unchecked``): a ``pallas_call``'s outputs carry no varying-axes
type. Label range errors are not raised in this mode (the labels are traced); out
of range labels give NaN as under jit.

``xla_reference`` is what a careful user writes instead: plain ``jax.numpy`` with the
logits upcast to f32 (``jax.nn.logsumexp``), ``lse - c1 z_y - c2 mean(z)``, autodiff
gradients. It is the baseline the kernel is compared with, kept as users write it:
it meets its own (implementation) bound and fails the accuracy contract at large
logits (oracles/cross_entropy.py).

Kernel bodies and the statistic combination are swappable
(``make_cross_entropy(forward_body=, backward_body=, combine=, finish=, reduce=)``)
so test variants reuse the tiling and the custom_vjp wiring and change one step.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels import block_io, pinning, validation
from pallascheck.kernels.backends import Backend, get_backend

REDUCTIONS = ("mean", "sum", "none")


@dataclasses.dataclass(frozen=True)
class Config:
    block_t: int = 16  # tokens per program
    block_v: int = 128  # vocabulary columns per loop step
    num_warps: int = 4  # GPU only
    num_stages: int = 1  # GPU only

    def __post_init__(self) -> None:
        validation.require_positive_power_of_two("config.block_t", self.block_t)
        validation.require_positive_power_of_two("config.block_v", self.block_v, 16)
        validation.require_positive_power_of_two("config.num_warps", self.num_warps)
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"config.num_stages must be an int >= 1, got {self.num_stages!r}")


# On GPU a (block_t, block_v) f32 tile and its exp live in registers: keep it small.
_GPU_MAX_TILE_ELEMENTS = 1 << 13


def configs(tokens: int, vocab: int, backend: str | Backend | None = None) -> list[Config]:
    """The autotuning space for ``tokens`` rows of ``vocab`` classes."""
    be = get_backend(backend)
    bts: tuple[int, ...]
    bvs: tuple[int, ...]
    warps: tuple[int, ...]
    stages: tuple[int, ...]
    if be.is_triton:
        bts, bvs, warps, stages = (4, 16, 32), (256, 1024, 2048), (4, 8), (1, 2)
    else:  # interpreters: keep the space small, every config costs a compile
        bts, bvs, warps, stages = (8, 16), (64, 128), (4,), (1,)
    bts = tuple(b for b in bts if b < 2 * max(tokens, 1)) or (min(bts),)
    bvs = tuple(b for b in bvs if b < 2 * max(vocab, 16)) or (min(bvs),)
    out = [Config(t, v, w, s) for t, v, w, s in itertools.product(bts, bvs, warps, stages)]
    if be.is_triton:
        out = [c for c in out if c.block_t * c.block_v <= _GPU_MAX_TILE_ELEMENTS] or [Config(4, 256)]
    return out


# ---------------------------------------------------------------------------------
# Kernel building blocks.


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Static facts about one program's rows and the vocabulary loop, and masked I/O."""

    tokens: int  # valid rows of the whole array
    vocab: int  # V of this (shard of the) logits
    block_t: int
    block_v: int
    masked_io: bool  # True on Triton: mask loads/stores at the array's edges

    @property
    def num_tiles(self) -> int:
        return pl.cdiv(self.vocab, self.block_v)

    def row_ok(self) -> jax.Array:
        first = pl.program_id(0) * self.block_t
        return first + lax.broadcasted_iota(jnp.int32, (self.block_t, 1), 0) < self.tokens

    def columns(self, j: Any) -> tuple[Any, jax.Array]:
        """(start of vocab tile j, its column indices (1, block_v))."""
        start = pl.multiple_of(j * self.block_v, self.block_v)
        return start, start + lax.broadcasted_iota(jnp.int32, (1, self.block_v), 1)

    def load_tile(self, ref: Any, start: Any, ok: jax.Array) -> jax.Array:
        """Vocab tile of ``ref`` as f32, exact zeros where ``ok`` is False."""
        return block_io.load(ref.at[:, pl.ds(start, self.block_v)], ok, masked_io=self.masked_io).astype(jnp.float32)

    def load_rows(self, ref: Any, ok: jax.Array) -> jax.Array:
        return block_io.load(ref, ok, masked_io=self.masked_io)

    def store_rows(self, ref: Any, value: jax.Array, ok: jax.Array) -> None:
        block_io.store(ref, value, ok, masked_io=self.masked_io)

    def store_tile(self, ref: Any, start: Any, value: jax.Array, ok: jax.Array) -> None:
        block_io.store(ref.at[:, pl.ds(start, self.block_v)], value, ok, masked_io=self.masked_io)


NEG_INF = float("-inf")


def pivot(m: jax.Array) -> jax.Array:
    """The max to subtract: 0 for a row that is -inf so far (no -inf - -inf)."""
    return jnp.where(m == NEG_INF, 0.0, m)


def online_update(
    carry: tuple, z: jax.Array, col_ok: jax.Array, cols: jax.Array, labels: jax.Array, seen: Any
) -> tuple:
    """One vocab tile of the online logsumexp: (m, s, t, sd) -> updated, all (bt, 1) f32.

    ``z``: the tile in f32 with exact zeros outside ``col_ok``; ``seen``: the number
    of valid columns before this tile (the terms of ``sd`` to re-pivot)."""
    m, s, t, sd = carry
    masked = jnp.where(col_ok, z, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(masked, axis=1, keepdims=True))
    old, new = pivot(m), pivot(m_new)
    s = s * jnp.exp(m - new) + jnp.sum(jnp.exp(masked - new), axis=1, keepdims=True)
    t = t + jnp.sum(jnp.where(cols == labels, z, 0.0), axis=1, keepdims=True)
    # sum of (z - max so far): the old terms move to the new max, this tile's join
    # (every piece <= 0, so the sum never cancels).
    sd = sd + jnp.asarray(seen, jnp.float32) * (old - new)
    sd = sd + jnp.sum(jnp.where(col_ok, z - new, 0.0), axis=1, keepdims=True)
    return m_new, s, t, sd


def initial_stats(block_t: int) -> tuple:
    """(m, s, t, sd) before the first tile: -inf and zeros, (block_t, 1) f32."""
    shape = (block_t, 1)
    return (jnp.full(shape, NEG_INF, jnp.float32),) + tuple(jnp.zeros(shape, jnp.float32) for _ in range(3))


def softmax_tile(z: jax.Array, m: jax.Array, log_s: jax.Array) -> jax.Array:
    """p = exp((z - m) - log(s)): the row's max and log-sum, never their rounded sum."""
    return jnp.exp((z - m) - log_s)


def _forward_kernel(logits_ref, labels_ref, m_ref, s_ref, t_ref, sd_ref, *, tiles: Tiles):
    row_ok = tiles.row_ok()
    labels = tiles.load_rows(labels_ref, row_ok)

    def step(j, carry):
        start, cols = tiles.columns(j)
        col_ok = cols < tiles.vocab
        z = tiles.load_tile(logits_ref, start, row_ok & col_ok)
        return online_update(carry, z, col_ok, cols, labels, start)

    stats = lax.fori_loop(0, tiles.num_tiles, step, initial_stats(tiles.block_t))
    for ref, value in zip((m_ref, s_ref, t_ref, sd_ref), stats):
        tiles.store_rows(ref, value, row_ok)


def _backward_kernel(
    logits_ref, labels_ref, m_ref, log_s_ref, g_ref, dlogits_ref, *, tiles: Tiles, c1: float, c3: float
):
    row_ok = tiles.row_ok()
    labels = tiles.load_rows(labels_ref, row_ok)
    m = tiles.load_rows(m_ref, row_ok)
    log_s = tiles.load_rows(log_s_ref, row_ok)
    g = tiles.load_rows(g_ref, row_ok)

    def step(j, carry):
        start, cols = tiles.columns(j)
        ok = row_ok & (cols < tiles.vocab)
        z = tiles.load_tile(logits_ref, start, ok)
        d = softmax_tile(z, m, log_s) - jnp.where(cols == labels, c1, 0.0)
        if c3 != 0.0:
            d = d - c3
        d = jnp.where(g == 0.0, 0.0, g * d)  # cotangent 0 (ignored token): exactly 0
        tiles.store_tile(dlogits_ref, start, d, ok)
        return carry

    lax.fori_loop(0, tiles.num_tiles, step, 0)


KernelBody = Callable[..., None]


class Stats(NamedTuple):
    """Per-token f32 statistics of one (shard of the) vocabulary, each shape [T]."""

    max: jax.Array
    sumexp: jax.Array  # sum exp(z - max)
    target: jax.Array  # z_label (0 if the label is not in this shard)
    shifted_sum: jax.Array  # sum (z - max), every term <= 0


def _specs(tiles: Tiles, padded_vocab: int):
    rows = pl.BlockSpec((tiles.block_t, padded_vocab), lambda i: (i, 0))
    col = pl.BlockSpec((tiles.block_t, 1), lambda i: (i, 0))
    return rows, col


def forward_call(
    logits: jax.Array, labels: jax.Array, *, config: Config, backend: Backend, body: KernelBody = _forward_kernel
) -> Stats:
    """Run the forward ``body`` over token blocks of logits [T, V]; labels [T] int32
    (indices into this array's columns; anything else matches no column)."""
    tokens, vocab = logits.shape
    tiles = Tiles(tokens, vocab, config.block_t, config.block_v, backend.is_triton)
    rows, col = _specs(tiles, tiles.num_tiles * config.block_v)
    stat = jax.ShapeDtypeStruct((tokens, 1), jnp.float32)
    outs = backend.pallas_call(
        functools.partial(body, tiles=tiles),
        grid=(pl.cdiv(tokens, config.block_t),),
        in_specs=[rows, col],
        out_specs=[col] * 4,
        out_shape=[stat] * 4,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        dimension_semantics=("parallel",),
        name="pallascheck_cross_entropy_fwd",
    )(logits, labels.reshape(tokens, 1))
    return Stats(*(o[:, 0] for o in outs))


def backward_call(
    logits: jax.Array,
    labels: jax.Array,
    m: jax.Array,
    log_s: jax.Array,
    g: jax.Array,
    *,
    c1: float,
    c3: float,
    config: Config,
    backend: Backend,
    body: KernelBody = _backward_kernel,
) -> jax.Array:
    """dlogits [T, V] in the logits dtype; m (the row max), log_s (log of the
    exp-sum) and g: [T] f32 (g = 0 for ignored tokens)."""
    tokens, vocab = logits.shape
    tiles = Tiles(tokens, vocab, config.block_t, config.block_v, backend.is_triton)
    rows, col = _specs(tiles, tiles.num_tiles * config.block_v)
    return backend.pallas_call(
        functools.partial(body, tiles=tiles, c1=c1, c3=c3),
        grid=(pl.cdiv(tokens, config.block_t),),
        in_specs=[rows, col, col, col, col],
        out_specs=rows,
        out_shape=jax.ShapeDtypeStruct(logits.shape, logits.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        dimension_semantics=("parallel",),
        name="pallascheck_cross_entropy_bwd",
    )(logits, *(a.reshape(tokens, 1) for a in (labels, m, log_s, g)))


# ---------------------------------------------------------------------------------
# Combining statistics (across shards) and finishing the loss, in XLA, f32.


def combine(stats: Stats, axis_name: Any, local_vocab: int) -> Stats:
    """Statistics of the whole vocabulary from each shard's (identity without an
    axis); ``local_vocab``: the columns of one shard."""
    if axis_name is None:
        return stats
    big = lax.pmax(stats.max, axis_name)
    sumexp = lax.psum(stats.sumexp * jnp.exp(stats.max - pivot(big)), axis_name)
    # each shard's sum of (z - its max), moved to the global max: pieces <= 0
    shifted = lax.psum(stats.shifted_sum + np.float32(local_vocab) * (pivot(stats.max) - pivot(big)), axis_name)
    return Stats(big, sumexp, lax.psum(stats.target, axis_name), shifted)


def constants(label_smoothing: float, vocab: int) -> tuple[float, float, float]:
    """(c1, c2, c3) = (1 - eps, eps, eps / V) as the f32 numbers the kernels use."""
    f32 = lambda v: float(np.float32(v))  # noqa: E731
    return f32(1.0 - label_smoothing), f32(label_smoothing), f32(label_smoothing / vocab)


def finish(stats: Stats, *, label_smoothing: float, vocab: int) -> tuple[jax.Array, jax.Array]:
    """(per-token loss, log of the exp-sum) from whole-vocabulary statistics, f32:
    ``(log s + c1 (m - t)) + c2 (-(sd / V))``, three terms >= 0 (module docstring)."""
    c1, c2, _ = constants(label_smoothing, vocab)
    log_s = jnp.log(stats.sumexp)
    loss = log_s
    if c1 != 0.0:
        loss = loss + c1 * (stats.max - stats.target)
    if c2 != 0.0:
        loss = loss + c2 * -(stats.shifted_sum / np.float32(vocab))
    return loss, log_s


def reduce(losses: jax.Array, counted: jax.Array, reduction: str) -> jax.Array:
    """losses [T] f32 (0 where ignored); counted [T] bool (not ignored)."""
    if reduction == "none":
        return losses
    total = jnp.sum(losses)
    if reduction == "sum":
        return total
    count = jnp.sum(counted.astype(jnp.int32))
    return total / jnp.maximum(count, 1).astype(jnp.float32)  # all ignored: 0 / 1 = 0


# ---------------------------------------------------------------------------------
# Wiring.


def _axis_size(axis_name: Any) -> int:
    """Devices along a mesh axis, as a Python int (psum of a constant is static)."""
    return int(lax.psum(1, axis_name))


def make_cross_entropy(
    forward_body: KernelBody = _forward_kernel,
    backward_body: KernelBody = _backward_kernel,
    combine: Callable[[Stats, Any, int], Stats] = combine,
    finish: Callable[..., tuple[jax.Array, jax.Array]] = finish,
    reduce: Callable[[jax.Array, jax.Array, str], jax.Array] = reduce,
) -> Callable[..., jax.Array]:
    """Build ``cross_entropy`` (same public signature) around the given pieces."""

    def token_losses(logits2d, labels, eps, ignore_index, axis_name, config, backend):
        """(per-token loss, (max, log-sum) for the backward pass, local labels, global
        vocab, ignored, invalid) without the custom_vjp."""
        local_vocab = vocab = logits2d.shape[1]
        local = labels
        if axis_name is not None:
            local = labels - lax.axis_index(axis_name) * local_vocab
            vocab = local_vocab * _axis_size(axis_name)
        stats = forward_call(logits2d, local, config=config, backend=backend, body=forward_body)
        stats = combine(stats, axis_name, local_vocab)
        loss, log_s = finish(stats, label_smoothing=eps, vocab=vocab)
        ignored = labels == ignore_index
        invalid = ~ignored & ((labels < 0) | (labels >= vocab))
        loss = jnp.where(ignored, 0.0, jnp.where(invalid, jnp.nan, loss))
        return loss, (stats.max, log_s), local, vocab, ignored, invalid

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
    def core(logits2d, labels, eps, ignore_index, axis_name, config, backend):
        return token_losses(logits2d, labels, eps, ignore_index, axis_name, config, backend)[0]

    def core_fwd(logits2d, labels, eps, ignore_index, axis_name, config, backend):
        loss, (m, log_s), local, _, ignored, invalid = token_losses(
            logits2d, labels, eps, ignore_index, axis_name, config, backend
        )
        return loss, (logits2d, labels, local, m, log_s, ignored, invalid)

    def core_bwd(eps, ignore_index, axis_name, config, backend, residuals, g):
        logits2d, labels, local, m, log_s, ignored, invalid = residuals
        vocab = logits2d.shape[1] * (1 if axis_name is None else _axis_size(axis_name))
        c1, _, c3 = constants(eps, vocab)
        g = jnp.where(ignored, 0.0, jnp.where(invalid, jnp.nan, g.astype(jnp.float32)))
        dlogits = backward_call(
            logits2d, local, m, log_s, g, c1=c1, c3=c3, config=config, backend=backend, body=backward_body
        )
        return dlogits, np.zeros(labels.shape, jax.dtypes.float0)

    core.defvjp(core_fwd, core_bwd)

    @functools.partial(jax.jit, static_argnames=("eps", "ignore_index", "reduction", "axis_name", "config", "backend"))
    def apply(logits, labels, *, eps, ignore_index, reduction, axis_name, config, backend):
        labels1d = labels.reshape(-1).astype(jnp.int32)
        logits2d = logits.reshape(-1, logits.shape[-1])
        losses = core(logits2d, labels1d, eps, ignore_index, axis_name, config, backend)
        out = reduce(losses, labels1d != ignore_index, reduction)
        return out.reshape(labels.shape) if reduction == "none" else out

    def cross_entropy(
        logits: jax.Array,
        labels: jax.Array,
        *,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        reduction: str = "mean",
        axis_name: Any = None,
        config: Config | None = None,
        backend: str | Backend | None = None,
    ) -> jax.Array:
        eps = validate(logits, labels, label_smoothing, ignore_index, reduction, config, axis_name)
        backend = get_backend(backend)
        config = pinning.choose(
            "cross_entropy",
            config,
            Config(),
            arrays={"logits": logits, "labels": labels},
            options={
                "label_smoothing": eps,
                "ignore_index": int(ignore_index),
                "reduction": reduction,
                "axis_name": axis_name,
            },
            backend=backend.name,
        )
        return apply(
            logits,
            labels,
            eps=eps,
            ignore_index=int(ignore_index),
            reduction=reduction,
            axis_name=axis_name,
            config=config,
            backend=backend,
        )

    cross_entropy.__doc__ = CROSS_ENTROPY_DOC
    return cross_entropy


CROSS_ENTROPY_DOC = """Softmax cross-entropy of ``logits`` [..., V] (f32, bf16 or f16) against
integer ``labels`` [...] (see the module docstring for the exact semantics).

``label_smoothing`` in [0, 1]; ``ignore_index``: label value of tokens that are
skipped; ``reduction``: "mean" (over non-ignored tokens; 0 if none), "sum" or "none".
``axis_name``: the mesh axis the vocabulary is sharded over (inside shard_map).
Returns float32. Differentiable in ``logits`` (Pallas backward kernel)."""


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def validate(
    logits: Any, labels: Any, label_smoothing: Any, ignore_index: Any, reduction: Any, config: Any, axis_name: Any
) -> float:
    """Check the arguments; returns label_smoothing as a float."""
    validation.require_array("logits", logits)
    validation.require_array("labels", labels)
    if logits.ndim < 1:
        raise ValueError(f"logits must have rank >= 1 (classes on the last axis), got shape {tuple(logits.shape)}")
    validation.require_nonempty("logits", tuple(logits.shape))
    validation.require_float_dtype("logits", logits.dtype)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"labels must have an integer dtype, got {jnp.dtype(labels.dtype).name}")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, got {tuple(labels.shape)}"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"label_smoothing must be a float in [0, 1], got {type(label_smoothing).__name__}")
    eps = float(label_smoothing)
    if not (math.isfinite(eps) and 0.0 <= eps <= 1.0):
        raise ValueError(f"label_smoothing must be a float in [0, 1], got {eps!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a cross_entropy.Config, got {type(config).__name__}")
    if axis_name is None and _is_concrete(labels):
        values = np.asarray(labels).astype(np.int64)
        bad = (values != int(ignore_index)) & ((values < 0) | (values >= logits.shape[-1]))
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"labels must lie in [0, V) = [0, {logits.shape[-1]}) or equal ignore_index={int(ignore_index)}; "
                f"labels{list(where)} = {int(values[where])}"
            )
    return eps


cross_entropy = make_cross_entropy()


@functools.partial(jax.jit, static_argnames=("label_smoothing", "ignore_index", "reduction"))
def xla_reference(
    logits: jax.Array,
    labels: jax.Array,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> jax.Array:
    """What a careful user writes instead: jax.numpy with the logits upcast to f32."""
    z = logits.astype(jnp.float32)
    vocab = z.shape[-1]
    lse = jax.nn.logsumexp(z, axis=-1)
    ignored = labels == ignore_index
    safe = jnp.where(ignored, 0, labels).astype(jnp.int32)
    target = jnp.take_along_axis(z, safe[..., None], axis=-1)[..., 0]
    c1, c2, _ = constants(label_smoothing, vocab)
    loss = lse
    if c1 != 0.0:
        loss = loss - c1 * target
    if c2 != 0.0:
        loss = loss - c2 * (jnp.sum(z, axis=-1) / np.float32(vocab))
    loss = jnp.where(ignored, 0.0, loss)
    return reduce(loss.reshape(-1), ~ignored.reshape(-1), reduction).reshape(
        labels.shape if reduction == "none" else ()
    )
