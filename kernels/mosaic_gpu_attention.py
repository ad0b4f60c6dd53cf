"""Flash attention on Hopper through Pallas' Mosaic GPU lowering (``plgpu``): forward
and FlashAttention-2 backward, with the semantics of ``kernels/attention.py``.

One warpgroup per program (``Config.consumers = 1``). Each kernel TMA-loads its
resident operands once and streams the other side through ``max_concurrent_steps``
SMEM slots (one TMA barrier per operand and slot; the copy for step ``i + stages`` is
issued into the slot of step ``i`` as soon as step ``i`` has finished reading it).
Every product is a ``wgmma``; 16-bit tiles sit in SMEM with the (8, 64) tiling and
the 128-byte swizzle wgmma reads, f32 tiles (bias, ds, GQA partials) with (8, 32) and
the same swizzle. A left operand computed in registers (p, ds) is rounded to the
input dtype and handed to wgmma from registers (in the Mosaic GPU interpreter, whose
wgmma reads SMEM only, through an SMEM tile: the same values). Results leave through
SMEM and a TMA store.

The warp-specialised forward (``consumers = 2``): a CTA of 2 x ``block_q`` queries,
two compute warpgroups of ``block_q`` rows each and a third that only issues the k/v
(and bias) TMA copies; each compute warpgroup hands a slot back through a barrier
the producer waits on, and the two take turns on the tensor core (one's softmax runs
while the other's products do; ``SharedPipeline``). Its arithmetic is the forward's
below, row for row.

Forward (grid batch x q heads x q blocks of ``block_q``; kv blocks of ``block_kv``):
    s     = wgmma(q, k^T) * sm_scale (+ b)         f32: bf16/f16 products are exact,
                                                   the head_dim sum is the tensor
                                                   core's f32 accumulation
    s     = where(visible, s, -inf)
    m_new = max(m, rowmax(s));  m_safe = 0 where m_new = -inf
    alpha = exp(m - m_safe);    p = exp(s - m_safe)
    l     = alpha * l + rowsum(p)                  p in f32
    acc   = wgmma(p.astype(dtype), v) onto alpha * acc
then ``out = acc / l`` (0 where l = 0), rounded once to the input dtype; the kernel
returns m_safe and l, and XLA forms ``lse = m_safe + log(l)`` (-inf where l = 0), f32.
The forward is compiled with approximate math (``approx_math``): exp is PTX's
``ex2.approx.ftz`` of the argument times log2(e) (within 2 ulp; subnormal results
flushed) and the division ``div.approx`` (within 2 ulp): the tolerance model charges
the log2(e) scaling (``Config.exp2``), the 2 ulp and the flush, and the log stays
XLA's. On the hardware the tensor core adds each block's ``block_kv`` exact products
of rounded p and v onto the running f32 accumulator (the interpreter adds the block's
f32 product in registers); either way one f32 accumulation chain over the keys, which
the GPU model takes as sequential with the tensor core's unit. ``b`` is the f32 sum
of ``bias`` with ``-inf`` where ``mask``
hides the key (one XLA array, exact). With causal, kv blocks past the last one a
query of the block sees are never loaded nor computed (that loop bound is dynamic;
blocks at or below the diagonal all go through the same masked step).

Backward (``delta = rowsum(dO * out)`` in XLA, f32, from the rounded out):
    dk/dv kernel (grid batch x q heads x kv blocks of ``block_kv_bwd``; q blocks of
    ``block_q_bwd`` streamed from the first one that sees the kv block):
      s^T = wgmma(k, q^T) * sm_scale (+ b^T);  p^T = exp(s^T - lse)   (lse -inf -> 0)
      dv += wgmma(p^T.astype(dtype), dO);  dp^T = wgmma(v, dO^T)
      ds^T = p^T * (dp^T - delta);         dk += wgmma(ds^T.astype(dtype), q)
      dk *= sm_scale at the end; ds^T (f32) is TMA-stored when there is a bias.
      With ``consumers_bwd = 2`` a CTA holds two kv blocks, one per compute
      warpgroup, and a third warpgroup streams the q blocks both read (the
      pipeline of the warp-specialised forward); each warpgroup's sums are the one-
      warpgroup kernel's bit for bit.
    dq kernel (grid batch x q heads x q blocks of ``block_q_bwd``; kv blocks of
    ``block_kv_bwd`` streamed up to the causal limit):
      the same p, dp, ds;  dq += wgmma(ds.astype(dtype), k);  dq *= sm_scale
The ``+=`` products accumulate onto the running f32 sums as in the forward
(``mma_onto``), and both kernels take exp with approximate math like the forward.
With GQA the dk/dv kernel writes f32 partials per q head and XLA sums each group in
f32 before rounding; ``dbias`` is XLA's f32 sum of ds (done by kernels/attention.py).
The logits of the backward are the forward's bit for bit (same products, same
scaling and bias addition), transposed in the dk/dv kernel.

Edges. Sequence lengths are padded with zeros in the wrapper to block multiples
(every TMA copy is a whole block; TMA's out-of-bounds fill is not relied on); padded
keys get -inf logits in the kernels, padded queries are sliced away (q = dO = delta
= 0 in their rows, so they add exactly 0 to dk and dv). head_dim is padded with zero
columns to a multiple of 64 (at most 256): exact for q.k, and the extra output
columns are sliced away.

Inputs bf16 or f16 only. f32 raises ``TypeError``: wgmma would take f32 operands as
tf32, and a tf32 q.k errs by ~1 at |s| ~ 1e3, a factor e in p (the Pallas kernels use
precision HIGHEST there); use backend ``triton``/``interpret`` for f32.

Kernel steps are swappable (``Bodies``): test variants reuse the tiling, the
pipeline and the wiring and change one step function.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallascheck.kernels import tiling
from pallascheck.kernels.backends import Backend, get_backend

NEG_INF = float("-inf")
BLOCKS = (64, 128)  # wgmma: one warpgroup owns 64-row multiples; larger tiles spill registers
# The widest head_dim any config fits: padded to 192 columns, the smallest config
# (64-row blocks, two stages) needs 244 KiB of SMEM without a bias (``_smem_bytes``)
# where a block has 227 KiB; at 128, 164 KiB. wgmma alone would take 256.
MAX_HEAD_DIM = 128
_SWIZZLE = 128  # bytes: wgmma's widest swizzle; rows of 64 16-bit or 32 f32 elements
_SMEM_BYTES = tiling.GPU_SHARED_MEMORY_BYTES
# SMEM Mosaic GPU allocated beyond our tiles and barriers, measured (see _smem_bytes):
# the larger of the two measurements, 2816 bytes, rounded up to a KiB.
UNACCOUNTED_SMEM = 3072
# Every kernel takes exp as PTX's ex2.approx and divides with div.approx (Config.exp2)
APPROX_MATH = plgpu.CompilerParams(approx_math=True)


@dataclasses.dataclass(frozen=True)
class Config:
    """Blocks of the forward (``block_q`` queries x ``block_kv`` keys per step) and of
    both backward kernels, the number of SMEM slots the streamed operands cycle
    through (TMA copies in flight ahead of the step that reads them), and the forward's
    compute warpgroups: ``consumers = 2`` is the warp-specialised forward (two
    warpgroups of ``block_q`` queries each share the k/v stream that a third
    warpgroup issues), and ``consumers_bwd = 2`` the warp-specialised dk/dv kernel (two
    warpgroups of ``block_kv_bwd`` keys each share the q/dO stream)."""

    block_q: int = 64
    block_kv: int = 64
    max_concurrent_steps: int = 2
    block_q_bwd: int = 64
    block_kv_bwd: int = 64
    consumers: int = 1
    consumers_bwd: int = 1

    def __post_init__(self) -> None:
        for field in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value not in BLOCKS:
                raise ValueError(f"config.{field} must be one of {BLOCKS} (wgmma tiles), got {value!r}")
        steps = self.max_concurrent_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or not 2 <= steps <= 4:
            raise ValueError(f"config.max_concurrent_steps must be an int in [2, 4] (pipeline stages), got {steps!r}")
        if self.consumers not in (1, 2) or isinstance(self.consumers, bool):
            raise ValueError(f"config.consumers must be 1 or 2 (forward compute warpgroups), got {self.consumers!r}")
        if self.consumers == 2 and self.block_q != 64:
            raise ValueError(
                f"config.consumers = 2 needs block_q = 64 (each warpgroup's rows; 128 spills "
                f"registers), got block_q {self.block_q}"
            )
        if self.consumers_bwd not in (1, 2) or isinstance(self.consumers_bwd, bool):
            raise ValueError(
                f"config.consumers_bwd must be 1 or 2 (dk/dv compute warpgroups), got {self.consumers_bwd!r}"
            )
        if self.consumers_bwd == 2 and self.block_kv_bwd != 64:
            raise ValueError(
                f"config.consumers_bwd = 2 needs block_kv_bwd = 64 (each warpgroup's dk and dv "
                f"rows; 128 spills registers), got block_kv_bwd {self.block_kv_bwd}"
            )

    # The names the tolerance model reads (shared with attention.Config).
    @property
    def exp2(self) -> bool:
        """Every kernel's exp is PTX's ex2.approx of the log2(e)-scaled argument
        (``approx_math``; module docstring), which the model charges."""
        return True

    @property
    def block_k(self) -> int:
        return self.block_kv

    @property
    def block_k_bwd(self) -> int:
        return self.block_kv_bwd


def padded_head_dim(head_dim: int) -> int:
    return -(-head_dim // 64) * 64


def _smem_bytes(c: Config, width: int, itemsize: int, with_bias: bool) -> int:
    """SMEM a config needs on the GPU at ``width`` columns, the bias tiles counted when
    asked (p and ds reach wgmma from registers there: no SMEM tile for them)."""
    s = c.max_concurrent_steps
    rows = c.block_q * c.consumers  # the forward's queries per CTA
    fwd = (rows + 2 * s * c.block_kv) * width * itemsize + rows * 4
    dq = (2 * c.block_q_bwd + 2 * s * c.block_kv_bwd) * width * itemsize + 2 * c.block_q_bwd * 4
    keys = c.block_kv_bwd * c.consumers_bwd  # the dk/dv kernel's keys per CTA
    # f32 gradient tiles (GQA's partials): dk and dv with one warpgroup, one tile per
    # consumer warpgroup (dk, then dv) in the warp-specialised form
    dkdv = (
        2 * keys * width * itemsize
        + 2 * c.block_kv_bwd * width * 4
        + s * (2 * c.block_q_bwd * width * itemsize + 2 * c.block_q_bwd * 4)
    )
    if with_bias:
        fwd += s * rows * c.block_kv * 4
        dq += s * c.block_q_bwd * c.block_kv_bwd * 4
        dkdv += (s + 1) * c.block_q_bwd * keys * 4
    # Not in the tiles above: the barriers, one per slot of each streamed operand (at
    # most six: q, do, lse, delta, bias and k/v; the warp-specialised forward's k, v,
    # hand-back and two bias barriers are five) and the resident blocks' (two), and
    # UNACCOUNTED_SMEM. Measured on an H200 (jax 0.11.2), each refused at 232504 bytes:
    # the dk/dv kernel of Config(64, 64, 2, 128, 64) at head_dim 64 with a bias (tiles
    # 231424 bytes: 7 barriers and 1024 bytes more), and, with the barriers counted and
    # 1024 bytes allowed, a forward kernel: the space's only config then within 2 KiB of
    # the limit was Config(64, 128, 2, 64, 64) at head_dim 128 with a bias (tiles 229632
    # bytes: 7 barriers and 2816 bytes more; small f32 vectors padded to the 1 KiB
    # alignment of swizzled tiles would explain part of it).
    # (the warp-specialised dk/dv kernel: s more for the hand-backs, 2 more resident)
    barriers = (6 * s + 2 + (s + 2) * (c.consumers_bwd - 1)) * tiling.MBARRIER_BYTES
    return max(fwd, dq, dkdv) + barriers + UNACCOUNTED_SMEM


def configs(
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    backend: str | Backend | None = None,
    itemsize: int = 2,
    bias: bool = True,
) -> list[Config]:
    """Valid configs for these lengths and head_dim (the autotuning space): only configs
    whose SMEM fits one block's 227 KiB, bias tiles included unless ``bias`` is False
    (a call without bias or mask), on the interpreter too, which would run configs no
    GPU can. The interpreter gets at most two (each costs a compile): the default
    one-warpgroup config and the first that fits of the warp-specialised ones in both
    passes (a forward kv block of 128 or 3 stages, else 2 stages), so both forms of
    the forward and of the dk/dv kernel, with its 128 keys per CTA, are checked where
    the hardware could run them. (The warp-specialised dk/dv kernel with 128-row q
    blocks fits only without a bias and at head_dim <= 64, 133 KiB; with a bias it
    needs 325-709 KiB: the interpreter does not draw it.)"""
    be = get_backend(backend)
    width = padded_head_dim(head_dim)

    def fits(c: Config) -> bool:
        return _smem_bytes(c, width, itemsize, with_bias=bias) <= _SMEM_BYTES

    if be.is_interpreted:
        specialised = [
            Config(64, 64, 3, 64, 64, consumers=2, consumers_bwd=2),
            Config(64, 64, 2, 64, 64, consumers=2, consumers_bwd=2),
        ]
        if 128 in tiling.blocks_for(seq_kv, (64, 128)):
            specialised.insert(0, Config(64, 128, 2, 64, 64, consumers=2, consumers_bwd=2))
        return [c for c in [Config()] if fits(c)] + [c for c in specialised if fits(c)][:1]
    out = []
    for bq, bkv, steps, (bqb, bkvb), consumers, consumers_bwd in itertools.product(
        tiling.blocks_for(seq_q, (64, 128)),
        tiling.blocks_for(seq_kv, (64, 128)),
        (2, 3),
        ((64, 64), (64, 128), (128, 64)),
        (1, 2),
        (1, 2),
    ):
        if (consumers == 2 and bq != 64) or (consumers_bwd == 2 and bkvb != 64):
            continue
        c = Config(bq, bkv, steps, bqb, bkvb, consumers, consumers_bwd)
        if fits(c):
            out.append(c)
    return out


def _tiled(dtype: Any) -> tuple[Any, Any]:
    """SMEM transforms wgmma reads and the WGMMA register layout loads/stores from."""
    return (plgpu.TilingTransform((8, _SWIZZLE // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(_SWIZZLE))  # type: ignore[abstract]  # concrete; jax's Transform Protocol stubs transform_array


# ---------------------------------------------------------------------------------
# Static facts and building blocks shared by the kernel steps.


@dataclasses.dataclass(frozen=True)
class Tile:
    """Static facts of one call. Blocks here are the kernel's own (forward or backward).

    ``offset = seq_kv - seq_q``: query i sees key j under causality iff j <= i + offset.
    """

    seq_q: int
    seq_kv: int
    width: int  # head_dim padded to a multiple of 64
    causal: bool
    sm_scale: float
    bias_dims: tuple[int, int] | None  # (batch, heads) of the f32 logit bias; 1 = broadcast
    group: int  # q heads per kv head
    block_q: int
    block_kv: int
    stages: int
    dtype: str
    interpreted: bool  # the Mosaic GPU interpreter: p and ds reach wgmma through SMEM

    @property
    def offset(self) -> int:
        return self.seq_kv - self.seq_q

    @property
    def masked(self) -> bool:
        """Whether any logit needs the visibility mask (padded keys or causality)."""
        return self.causal or self.seq_kv % self.block_kv != 0

    def bias_window(self, bias_ref: Any, b: Any, h: Any, rows: Any, cols: Any) -> Any:
        if self.bias_dims is None:
            raise ValueError("bias_window: this call has no bias")
        bb, hb = self.bias_dims
        return bias_ref.at[b if bb > 1 else 0, h if hb > 1 else 0, rows, cols]

    def logits(
        self, s: jax.Array, q_start: Any, kv_start: Any, bias: jax.Array | None, *, transposed: bool = False
    ) -> jax.Array:
        """f32 logits from the raw wgmma product ``s`` ((block_q, block_kv), or
        (block_kv, block_q) when ``transposed``): scaled, biased, -inf where the key is
        padding or above the causal diagonal."""
        s = s * jnp.float32(self.sm_scale)
        if bias is not None:
            s = s + bias
        if not self.masked:
            return s
        q_axis, kv_axis = (1, 0) if transposed else (0, 1)
        rows = q_start + plgpu.broadcasted_iota(jnp.int32, s.shape, q_axis, layout=plgpu.Layout.WGMMA)
        cols = kv_start + plgpu.broadcasted_iota(jnp.int32, s.shape, kv_axis, layout=plgpu.Layout.WGMMA)
        visible = cols < self.seq_kv
        if self.causal:
            visible = visible & (cols <= rows + self.offset)
        return jnp.where(visible, s, NEG_INF)


def kv_blocks_seen(t: Tile, q_block: Any) -> Any:
    """How many kv blocks (from 0) hold a key that some real query of this q block sees."""
    total = pl.cdiv(t.seq_kv, t.block_kv)
    if not t.causal:
        return total
    last_col = jnp.minimum((q_block + 1) * t.block_q, t.seq_q) + t.offset  # exclusive
    return jnp.clip(lax.div(last_col + t.block_kv - 1, t.block_kv), 0, total)


def first_q_block_seeing(t: Tile, kv_block: Any) -> Any:
    """The first q block with a query that sees a key of this kv block."""
    if not t.causal:
        return 0
    first_row = jnp.maximum(kv_block * t.block_kv - t.offset, 0)
    return jnp.minimum(lax.div(first_row, t.block_q), pl.cdiv(t.seq_q, t.block_q))


def mma(a: Any, b: Any, shape: tuple[int, int], issued: Callable[[], None] = lambda: None) -> jax.Array:
    """wgmma(a, b) into a fresh f32 accumulator, read back into registers (which waits
    for the tensor core); ``issued`` runs between issuing the product and the wait."""

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        issued()
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def mma_onto(t: Tile, acc: jax.Array, a: Any, b: Any) -> jax.Array:
    """acc + wgmma(a, b): on the hardware the product is accumulated onto ``acc`` in
    the tensor core's f32 accumulator; the interpreter cannot run an initialised
    accumulator (``ACC.init``), so there the f32 product is added in registers. Both are
    one f32 accumulation chain over the keys, as the tolerance model has it on a GPU."""
    if t.interpreted:
        return acc + mma(a, b, cast(tuple[int, int], acc.shape))  # acc is 2-D
    return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b))(plgpu.ACC.init(acc))


def as_lhs(t: Tile, x: jax.Array, ref: Any) -> Any:
    """The left operand of a product computed in registers (p, ds), rounded to the
    input dtype: in registers on the hardware (wgmma reads a register A operand), in
    the SMEM tile ``ref``, fenced for the wgmma, in the interpreter (its wgmma reads
    SMEM only). The same rounded values either way."""
    if not t.interpreted:
        return x.astype(jnp.dtype(t.dtype))
    ref[...] = x.astype(ref.dtype)
    plgpu.commit_smem()
    return ref


def lhs_tile(t: Tile, shape: tuple[int, int]) -> Any:
    """The SMEM scratch ``as_lhs`` needs (None when the operand stays in registers)."""
    return _smem(shape, jnp.dtype(t.dtype)) if t.interpreted else None


def rows_of(vector: jax.Array, shape: tuple[int, int], axis: int) -> jax.Array:
    """A per-row (axis 0) or per-column (axis 1) vector broadcast to ``shape``."""
    return lax.broadcast_in_dim(vector, shape, [axis])


def guard_neg_inf(x: jax.Array) -> jax.Array:
    """x with -inf replaced by 0, so that exp(s - x) is 0 (not NaN) for s = -inf."""
    return jnp.where(x == NEG_INF, jnp.zeros_like(x), x)


def zeros(shape: tuple[int, ...], layout: Any) -> jax.Array:
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout)


@dataclasses.dataclass
class Stream:
    """One operand streamed through the SMEM slots: ``source(block)`` is the GMEM window
    of a block, ``smem`` has a leading slot axis, one TMA barrier per slot."""

    source: Callable[[Any], Any]
    smem: Any
    barriers: Any

    def fetch(self, block: Any, slot: Any) -> None:
        plgpu.copy_gmem_to_smem(self.source(block), self.smem.at[slot], self.barriers.at[slot])

    def wait(self, slot: Any) -> None:
        plgpu.barrier_wait(self.barriers.at[slot])

    def tile(self, slot: Any) -> Any:
        return self.smem.at[slot]


@dataclasses.dataclass
class Pipeline:
    """Blocks ``start .. start + count`` of the streams, step ``i`` in slot ``i % stages``;
    ``count`` is at most ``blocks``, the static number of blocks in the operands."""

    streams: dict[str, Stream]
    stages: int
    start: Any
    count: Any
    blocks: int

    def __getitem__(self, name: str) -> Stream:
        return self.streams[name]

    def slot(self, step: Any) -> Any:
        return lax.rem(step, jnp.asarray(self.stages, jnp.int32))

    def block(self, step: Any) -> Any:
        return self.start + step

    def _fetch(self, step: Any, slot: Any) -> None:
        for stream in self.streams.values():
            stream.fetch(self.block(step), slot)

    def prologue(self) -> None:
        for step in range(min(self.stages, self.blocks)):
            pl.when(step < self.count)(functools.partial(self._fetch, step, step))

    def refill(self, step: Any) -> None:
        """Issue step + stages into this step's slot; call once the step read its slot."""
        pl.when(step + self.stages < self.count)(lambda: self._fetch(step + self.stages, self.slot(step)))

    def qk_issued(self) -> None:
        """The forward step's q.k product is issued, not yet read back."""

    def pv_ready(self, slot: Any) -> None:
        """The forward step's p is ready: wait for the slot's v tile."""
        self["v"].wait(slot)

    def run(self, step_fn: Callable[[Any, Any], Any], carry: Any) -> Any:
        self.prologue()
        return lax.fori_loop(0, self.count, step_fn, carry)


@dataclasses.dataclass
class SharedPipeline(Pipeline):
    """The pipeline of the warp-specialised kernels (forward, dk/dv). One warpgroup
    issues every TMA copy (``produce``); the consumer warpgroups run the steps
    (``run``), and a step
    hands its slot back by arriving on the slot's ``consumed`` barrier (one arrival
    per consumer), which the producer waits on before it refills the slot. The step
    reads its products back (waiting for the tensor core) before it arrives, so the
    barrier need not order tensor-core work (``orders_tensor_core`` emits a Blackwell
    fence that sm_90a refuses).

    In the forward the consumers take turns on the tensor core through ``schedule``
    (one arrival each; the dk/dv kernel has none): a consumer passes it once after issuing its q.k product and once when its
    softmax is done, and consumer 1 passes it once before its first step (consumer 0
    once after its last), so one consumer's softmax runs while the other's products
    do."""

    consumed: Any = None
    schedule: Any = None

    def turn(self) -> None:
        plgpu.barrier_arrive(self.schedule)
        plgpu.barrier_wait(self.schedule)

    def qk_issued(self) -> None:
        self.turn()

    def pv_ready(self, slot: Any) -> None:
        plgpu.barrier_arrive(self.schedule)
        self["v"].wait(slot)
        plgpu.barrier_wait(self.schedule)

    def produce(self) -> None:
        def issue(step, carry):
            slot = self.slot(step)
            pl.when(step >= self.stages)(lambda: plgpu.barrier_wait(self.consumed.at[slot]))
            self._fetch(step, slot)
            return carry

        # After the last copy, observe the last steps' hand-backs too, so that every
        # barrier ends in the phase all its users saw (the interpreter checks this when
        # it frees them).
        def drain(step, carry):
            plgpu.barrier_wait(self.consumed.at[self.slot(step)])
            return carry

        lax.fori_loop(0, self.count, issue, jnp.int32(0))
        lax.fori_loop(jnp.maximum(self.count - self.stages, 0), self.count, drain, jnp.int32(0))

    def refill(self, step: Any) -> None:
        plgpu.barrier_arrive(self.consumed.at[self.slot(step)])

    def run(self, step_fn: Callable[[Any, Any], Any], carry: Any) -> Any:
        return lax.fori_loop(0, self.count, step_fn, carry)


@dataclasses.dataclass
class RowSplitStream:
    """A stream whose slot holds one tile per consumer warpgroup (the bias rows of its
    queries, or of its keys in the dk/dv kernel), each with its own TMA barrier; ``consumer`` is set in a consumer's view.
    ``source(block, c)`` is the GMEM window of consumer ``c``."""

    source: Callable[[Any, int], Any]
    smem: Any  # (stages, consumers, rows, cols)
    barriers: Any  # stages * consumers
    consumers: int
    consumer: Any = None

    def fetch(self, block: Any, slot: Any) -> None:
        for c in range(self.consumers):
            plgpu.copy_gmem_to_smem(
                self.source(block, c), self.smem.at[slot, c], self.barriers.at[slot * self.consumers + c]
            )

    def wait(self, slot: Any) -> None:
        plgpu.barrier_wait(self.barriers.at[slot * self.consumers + self.consumer])

    def tile(self, slot: Any) -> Any:
        return self.smem.at[slot, self.consumer]


def _warpgroups(consumers: int) -> dict[str, Any]:
    """plgpu.kernel's arguments for a kernel of ``consumers`` compute warpgroups: none
    for one, one producer warpgroup more (axis "wg") for a warp-specialised kernel."""
    return {} if consumers == 1 else {"num_threads": consumers + 1, "thread_name": "wg"}


def specialise(pipe: SharedPipeline, consumers: int, consume: Callable[[Any, SharedPipeline], None]) -> None:
    """Warpgroup ``consumers`` issues the pipeline's copies (with few registers);
    each warpgroup below it runs ``consume(wg, view)`` with the registers left, ``view``
    being the pipeline as that consumer reads it (its rows of a row-split stream)."""
    wg = lax.axis_index("wg")

    @pl.when(wg == consumers)
    def _produce():
        plgpu.set_max_registers(tiling.MEMORY_WARPGROUP_REGISTERS, action="decrease")
        pipe.produce()

    @pl.when(wg < consumers)
    def _consume():
        plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        streams = {
            name: dataclasses.replace(stream, consumer=wg) if isinstance(stream, RowSplitStream) else stream
            for name, stream in pipe.streams.items()
        }
        consume(wg, dataclasses.replace(pipe, streams=streams))


# ---------------------------------------------------------------------------------
# Default kernel steps (swappable through Bodies). Each reads its slot, computes, and
# hands the slot back to the pipeline with ``refill``.


@dataclasses.dataclass
class ForwardRefs:
    q: Any  # (block_q, width) SMEM, resident
    lhs: Any  # (block_q, block_kv) SMEM in the input dtype: p for the p.v wgmma
    q_start: Any


def forward_step(t: Tile, pipe: Pipeline, r: ForwardRefs, step: Any, carry: Any) -> Any:
    m, l, acc = carry
    slot = pipe.slot(step)
    kv_start = pipe.block(step) * t.block_kv
    pipe["k"].wait(slot)
    s = mma(r.q, pipe["k"].tile(slot).transpose((1, 0)), (t.block_q, t.block_kv), pipe.qk_issued)
    bias = None
    if t.bias_dims is not None:
        pipe["bias"].wait(slot)
        bias = plgpu.load(pipe["bias"].tile(slot), layout=plgpu.Layout.WGMMA)
    s = t.logits(s, r.q_start, kv_start, bias)
    m_new = jnp.maximum(m, s.max(axis=1))
    m_safe = guard_neg_inf(m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - rows_of(m_safe, cast(tuple[int, int], s.shape), 0))  # s is 2-D
    l = alpha * l + p.sum(axis=1)
    acc = acc * rows_of(alpha, acc.shape, 0)
    lhs = as_lhs(t, p, r.lhs)
    pipe.pv_ready(slot)
    acc = mma_onto(t, acc, lhs, pipe["v"].tile(slot))
    pipe.refill(step)
    return m_new, l, acc


@dataclasses.dataclass
class DkdvRefs:
    k: Any  # (block_kv, width) SMEM, resident
    v: Any
    lhs: Any  # (block_kv, block_q) SMEM in the input dtype: p^T, then ds^T
    ds: Any  # (block_kv, block_q) f32 SMEM for ds^T, or None without a bias
    ds_ref: Any  # GMEM [b, h, seq_kv, seq_q] f32, or None
    b: Any
    h: Any
    kv_start: Any


def dkdv_step(t: Tile, pipe: Pipeline, r: DkdvRefs, step: Any, carry: Any) -> Any:
    dk, dv = carry
    slot = pipe.slot(step)
    q_start = pipe.block(step) * t.block_q
    shape = (t.block_kv, t.block_q)
    for name in ("q", "do", "lse", "delta"):
        pipe[name].wait(slot)
    q, do = pipe["q"].tile(slot), pipe["do"].tile(slot)
    s = mma(r.k, q.transpose((1, 0)), shape)
    bias = None
    if t.bias_dims is not None:
        pipe["bias"].wait(slot)
        bias = plgpu.load(pipe["bias"].tile(slot), layout=plgpu.Layout.WGMMA)
    s = t.logits(s, q_start, r.kv_start, bias, transposed=True)
    lse = plgpu.load(pipe["lse"].tile(slot), layout=plgpu.Layout.WGMMA.reduce(0))
    p = jnp.exp(s - rows_of(lse, shape, 1))
    dv = mma_onto(t, dv, as_lhs(t, p, r.lhs), do)
    dp = mma(r.v, do.transpose((1, 0)), shape)
    delta = plgpu.load(pipe["delta"].tile(slot), layout=plgpu.Layout.WGMMA.reduce(0))
    ds = p * (dp - rows_of(delta, shape, 1))
    dk = mma_onto(t, dk, as_lhs(t, ds, r.lhs), q)
    if r.ds is not None:
        store_ds(t, r, ds, q_start)
    pipe.refill(step)
    return dk, dv


def store_ds(t: Tile, r: DkdvRefs, ds: jax.Array, q_start: Any) -> None:
    """ds^T of this step to GMEM through SMEM: the previous step's TMA store must
    have read the SMEM tile before it is overwritten."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    r.ds[...] = ds
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(r.ds, r.ds_ref.at[r.b, r.h, pl.ds(r.kv_start, t.block_kv), pl.ds(q_start, t.block_q)])


@dataclasses.dataclass
class DqRefs:
    q: Any  # (block_q, width) SMEM, resident
    do: Any
    lhs: Any  # (block_q, block_kv) SMEM in the input dtype: ds
    lse: jax.Array  # (block_q,) f32 in registers, -inf replaced by 0
    delta: jax.Array
    q_start: Any


def dq_step(t: Tile, pipe: Pipeline, r: DqRefs, step: Any, dq: Any) -> Any:
    slot = pipe.slot(step)
    kv_start = pipe.block(step) * t.block_kv
    shape = (t.block_q, t.block_kv)
    pipe["k"].wait(slot)
    k = pipe["k"].tile(slot)
    s = mma(r.q, k.transpose((1, 0)), shape)
    bias = None
    if t.bias_dims is not None:
        pipe["bias"].wait(slot)
        bias = plgpu.load(pipe["bias"].tile(slot), layout=plgpu.Layout.WGMMA)
    s = t.logits(s, r.q_start, kv_start, bias)
    p = jnp.exp(s - rows_of(r.lse, shape, 0))
    pipe["v"].wait(slot)
    dp = mma(r.do, pipe["v"].tile(slot).transpose((1, 0)), shape)
    ds = p * (dp - rows_of(r.delta, shape, 0))
    dq = mma_onto(t, dq, as_lhs(t, ds, r.lhs), k)
    pipe.refill(step)
    return dq


def consumer_first_row(cta_first_row: Any, consumer: Any, block: int) -> Any:
    """The first row of a warp-specialised CTA's compute warpgroup ``consumer``."""
    return cta_first_row + consumer * block


@dataclasses.dataclass(frozen=True)
class Bodies:
    forward_step: Callable[..., Any] = forward_step
    dkdv_step: Callable[..., Any] = dkdv_step
    dq_step: Callable[..., Any] = dq_step
    kv_blocks_seen: Callable[[Tile, Any], Any] = kv_blocks_seen
    # the q rows the warp-specialised forward's compute warpgroups read
    forward_consumer_first_row: Callable[[Any, Any, int], Any] = consumer_first_row


# ---------------------------------------------------------------------------------
# Kernels: resident operands, the pipeline, the epilogue.


def _streams(t: Tile, named: Sequence[tuple[str, Callable[[Any], Any], Any]]) -> tuple[dict, list]:
    """Scratch for streamed operands: (name, source, SMEM type of one slot)."""
    return {name: source for name, source, _ in named}, [
        (ty, plgpu.Barrier(num_barriers=t.stages)) for _, _, ty in named
    ]


def _smem(shape: tuple[int, ...], dtype: Any, stages: int | None = None) -> Any:
    full = shape if stages is None else (stages, *shape)
    if len(shape) == 1:  # vectors: no tiling
        return plgpu.SMEM(full, dtype)
    return plgpu.SMEM(full, dtype, transforms=_tiled(dtype))


def _kv_streams(t: Tile, k_ref, v_ref, bias_ref, b, h, q_start):
    """The k, v (and bias) blocks a q block streams through the pipeline, for the
    forward and dq kernels: their sources and SMEM scratch."""
    kv_head = lax.div(h, jnp.int32(t.group))
    dtype = jnp.dtype(t.dtype)

    def kv_rows(j):
        return pl.ds(j * t.block_kv, t.block_kv)

    named = [
        ("k", lambda j: k_ref.at[b, kv_rows(j), kv_head], _smem((t.block_kv, t.width), dtype, t.stages)),
        ("v", lambda j: v_ref.at[b, kv_rows(j), kv_head], _smem((t.block_kv, t.width), dtype, t.stages)),
    ]
    if bias_ref is not None:
        named.append(
            (
                "bias",
                lambda j: t.bias_window(bias_ref, b, h, pl.ds(q_start, t.block_q), kv_rows(j)),
                _smem((t.block_q, t.block_kv), jnp.float32, t.stages),
            )
        )
    return _streams(t, named)


def _forward_init(t: Tile) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(m, l, acc) before the first kv block: -inf, 0, 0."""
    return (
        plgpu.layout_cast(jnp.full((t.block_q,), NEG_INF, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
        zeros((t.block_q,), plgpu.Layout.WGMMA.reduce(1)),
        zeros((t.block_q, t.width), plgpu.Layout.WGMMA),
    )


def _forward_epilogue(carry: Any, out_smem: Any, stats_smem: Any, out_gmem: Any, stats_gmem: Any) -> None:
    """out = acc / l (0 where l = 0: a fully masked row), and the row statistics m
    (0 where -inf) and l for the wrapper's lse, stored through SMEM (``out_smem`` may
    be the q tile: q is no longer read; ``stats_smem`` is (2, rows) f32)."""
    m, l, acc = carry
    l_safe = jnp.where(l == 0.0, jnp.ones_like(l), l)
    out_smem[...] = (acc / rows_of(l_safe, acc.shape, 0)).astype(out_smem.dtype)
    stats_smem.at[0][...] = guard_neg_inf(m)
    stats_smem.at[1][...] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem)
    plgpu.copy_smem_to_gmem(stats_smem, stats_gmem)
    plgpu.wait_smem_to_gmem(0)


def _forward_kernel(q_ref, k_ref, v_ref, *rest, t: Tile, bodies: Bodies):
    bias_ref = rest[0] if t.bias_dims is not None else None
    o_ref, stats_ref = rest[-2:]
    b, h, qi = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("blocks")
    q_start = qi * t.block_q
    rows = pl.ds(q_start, t.block_q)
    dtype = jnp.dtype(t.dtype)
    sources, scratch = _kv_streams(t, k_ref, v_ref, bias_ref, b, h, q_start)

    def body(q_smem, lhs_smem, stats_smem, q_barrier, *stream_scratch):
        streams = {name: Stream(sources[name], smem, bar) for name, (smem, bar) in zip(sources, stream_scratch)}
        pipe = Pipeline(streams, t.stages, 0, bodies.kv_blocks_seen(t, qi), pl.cdiv(t.seq_kv, t.block_kv))
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, q_barrier.at[0])
        plgpu.barrier_wait(q_barrier.at[0])
        refs = ForwardRefs(q_smem, lhs_smem, q_start)
        carry = pipe.run(lambda i, c: bodies.forward_step(t, pipe, refs, i, c), _forward_init(t))
        _forward_epilogue(carry, q_smem, stats_smem, o_ref.at[b, rows, h], stats_ref.at[b, h, :, rows])

    pl.run_scoped(
        body,
        _smem((t.block_q, t.width), dtype),
        lhs_tile(t, (t.block_q, t.block_kv)),
        plgpu.SMEM((2, t.block_q), jnp.float32),
        plgpu.Barrier(num_barriers=1),
        *scratch,
    )


# Compute warpgroups of the warp-specialised kernels (Config.consumers = 2,
# Config.consumers_bwd = 2); one more warpgroup issues their TMA copies.
CONSUMERS = 2
# Registers per thread of the warp-specialised kernels' compute warpgroups (forward and
# dk/dv), set after launch: 2 x 128 x 232 + 128 x 40 (tiling.MEMORY_WARPGROUP_REGISTERS)
# = 64512 of the SM's 65536 registers.
CONSUMER_REGISTERS = 232


def _forward_ws_kernel(q_ref, k_ref, v_ref, *rest, t: Tile, bodies: Bodies):
    """``consumers = 2``: a CTA of 2 x ``block_q`` queries; warpgroups 0 and 1 each
    run the forward steps on their ``block_q`` rows, warpgroup 2 issues the k/v (and
    bias) TMA copies. Both consumers walk the CTA's kv blocks; a block past one
    consumer's causal limit is fully masked for it and leaves m, l and acc exactly
    as they were (p = 0, alpha = 1)."""
    c = CONSUMERS
    bias_ref = rest[0] if t.bias_dims is not None else None
    o_ref, stats_ref = rest[-2:]
    b, h, ci = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("blocks")
    cta = dataclasses.replace(t, block_q=c * t.block_q)
    count = bodies.kv_blocks_seen(cta, ci)
    kv_head = lax.div(h, jnp.int32(t.group))
    dtype = jnp.dtype(t.dtype)

    def kv_rows(j):
        return pl.ds(j * t.block_kv, t.block_kv)

    def q_rows(w):
        return pl.ds(consumer_first_row(ci * cta.block_q, w, t.block_q), t.block_q)

    kv_tiles = _smem((t.block_kv, t.width), dtype, t.stages)
    scratch = [kv_tiles, plgpu.Barrier(num_barriers=t.stages)] * 2
    if bias_ref is not None:
        scratch += [
            plgpu.SMEM((t.stages, c, t.block_q, t.block_kv), jnp.float32, transforms=_tiled(jnp.float32)),
            plgpu.Barrier(num_barriers=t.stages * c),
        ]

    def body(q_smem, lhs_smem, stats_smem, q_barrier, consumed, schedule, k_smem, k_bar, v_smem, v_bar, *bias_scratch):
        streams = {
            "k": Stream(lambda j: k_ref.at[b, kv_rows(j), kv_head], k_smem, k_bar),
            "v": Stream(lambda j: v_ref.at[b, kv_rows(j), kv_head], v_smem, v_bar),
        }
        if bias_ref is not None:
            streams["bias"] = RowSplitStream(
                lambda j, w: t.bias_window(bias_ref, b, h, q_rows(w), kv_rows(j)), *bias_scratch, consumers=c
            )
        pipe = SharedPipeline(streams, t.stages, 0, count, pl.cdiv(t.seq_kv, t.block_kv), consumed, schedule)

        def consume(wg, view):
            q_tile = q_smem.at[wg]
            q_start = bodies.forward_consumer_first_row(ci * cta.block_q, wg, t.block_q)
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q_start, t.block_q), h], q_tile, q_barrier.at[wg])
            plgpu.barrier_wait(q_barrier.at[wg])
            refs = ForwardRefs(q_tile, None if lhs_smem is None else lhs_smem.at[wg], q_start)
            pl.when(wg == 1)(view.turn)
            carry = view.run(lambda i, cy: bodies.forward_step(t, view, refs, i, cy), _forward_init(t))
            pl.when(wg == 0)(view.turn)
            _forward_epilogue(
                carry, q_tile, stats_smem.at[wg], o_ref.at[b, q_rows(wg), h], stats_ref.at[b, h, :, q_rows(wg)]
            )

        specialise(pipe, c, consume)

    pl.run_scoped(
        body,
        plgpu.SMEM((c, t.block_q, t.width), dtype, transforms=_tiled(dtype)),
        plgpu.SMEM((c, t.block_q, t.block_kv), dtype, transforms=_tiled(dtype)) if t.interpreted else None,
        plgpu.SMEM((c, 2, t.block_q), jnp.float32),
        plgpu.Barrier(num_barriers=c),
        plgpu.Barrier(num_arrivals=c, num_barriers=t.stages),
        plgpu.Barrier(num_arrivals=c),
        *scratch,
        collective_axes="wg",
    )


def q_block_rows(t: Tile, i: Any) -> Any:
    return pl.ds(i * t.block_q, t.block_q)


def _q_streams(t: Tile, q_ref, do_ref, lse_ref, delta_ref, b, h) -> list:
    """The q, dO, lse and delta blocks the dk/dv kernels stream: (name, source, SMEM)."""
    dtype = jnp.dtype(t.dtype)
    return [
        ("q", lambda i: q_ref.at[b, q_block_rows(t, i), h], _smem((t.block_q, t.width), dtype, t.stages)),
        ("do", lambda i: do_ref.at[b, q_block_rows(t, i), h], _smem((t.block_q, t.width), dtype, t.stages)),
        ("lse", lambda i: lse_ref.at[b, h, q_block_rows(t, i)], _smem((t.block_q,), jnp.float32, t.stages)),
        ("delta", lambda i: delta_ref.at[b, h, q_block_rows(t, i)], _smem((t.block_q,), jnp.float32, t.stages)),
    ]


def _dkdv_kernel(
    q_ref,
    do_ref,
    k_ref,
    v_ref,
    lse_ref,
    delta_ref,
    *rest,
    t: Tile,
    bodies: Bodies,
    with_ds: bool,
):
    has_bias = t.bias_dims is not None
    bias_ref = rest[0] if has_bias else None
    dk_ref, dv_ref = rest[int(has_bias) : int(has_bias) + 2]
    ds_ref = rest[-1] if with_ds else None
    b, h, kj = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("blocks")
    kv_head = lax.div(h, jnp.int32(t.group))
    kv_start = kj * t.block_kv
    dtype = jnp.dtype(t.dtype)
    grad_dtype = dk_ref.dtype
    named = _q_streams(t, q_ref, do_ref, lse_ref, delta_ref, b, h)
    if has_bias:  # the transposed bias [b, h, seq_kv, seq_q]
        named.append(
            (
                "bias",
                lambda i: t.bias_window(bias_ref, b, h, pl.ds(kv_start, t.block_kv), q_block_rows(t, i)),
                _smem((t.block_kv, t.block_q), jnp.float32, t.stages),
            )
        )
    sources, scratch = _streams(t, named)

    def body(k_smem, v_smem, lhs_smem, dk_smem, dv_smem, ds_smem, kv_barrier, *stream_scratch):
        streams = {name: Stream(sources[name], smem, bar) for name, (smem, bar) in zip(sources, stream_scratch)}
        first = first_q_block_seeing(t, kj)
        blocks = pl.cdiv(t.seq_q, t.block_q)
        pipe = Pipeline(streams, t.stages, first, blocks - first, blocks)
        plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(kv_start, t.block_kv), kv_head], k_smem, kv_barrier.at[0])
        plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(kv_start, t.block_kv), kv_head], v_smem, kv_barrier.at[1])
        plgpu.barrier_wait(kv_barrier.at[0])
        plgpu.barrier_wait(kv_barrier.at[1])
        refs = DkdvRefs(k_smem, v_smem, lhs_smem, ds_smem, ds_ref, b, h, kv_start)
        init = (zeros((t.block_kv, t.width), plgpu.Layout.WGMMA),) * 2
        dk, dv = pipe.run(lambda i, carry: bodies.dkdv_step(t, pipe, refs, i, carry), init)
        if with_ds:
            plgpu.wait_smem_to_gmem(0)
        dk_smem[...] = (dk * jnp.float32(t.sm_scale)).astype(grad_dtype)
        dv_smem[...] = dv.astype(grad_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dk_smem, dk_ref.at[b, pl.ds(kv_start, t.block_kv), h])
        plgpu.copy_smem_to_gmem(dv_smem, dv_ref.at[b, pl.ds(kv_start, t.block_kv), h])
        plgpu.wait_smem_to_gmem(0)

    tile_kv = _smem((t.block_kv, t.width), dtype)
    tile_grad = _smem((t.block_kv, t.width), grad_dtype)
    ds_tile = _smem((t.block_kv, t.block_q), jnp.float32) if with_ds else None
    lhs = lhs_tile(t, (t.block_kv, t.block_q))
    pl.run_scoped(body, tile_kv, tile_kv, lhs, tile_grad, tile_grad, ds_tile, plgpu.Barrier(num_barriers=2), *scratch)


def _dkdv_ws_kernel(
    q_ref,
    do_ref,
    k_ref,
    v_ref,
    lse_ref,
    delta_ref,
    *rest,
    t: Tile,
    bodies: Bodies,
    with_ds: bool,
):
    """``consumers_bwd = 2``: a CTA of 2 x ``block_kv`` keys; warpgroups 0 and 1 each
    accumulate dk and dv of their ``block_kv`` keys, warpgroup 2 issues the q, dO, lse
    and delta (and bias) TMA copies both consumers read. Both walk the q blocks from the
    first one that sees the CTA's first key; a block before one consumer's first is
    fully masked for it (p = 0, so ds = 0) and adds exactly 0 to its dk and dv."""
    c = CONSUMERS
    has_bias = t.bias_dims is not None
    bias_ref = rest[0] if has_bias else None
    dk_ref, dv_ref = rest[int(has_bias) : int(has_bias) + 2]
    ds_ref = rest[-1] if with_ds else None
    b, h, ci = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("blocks")
    cta = dataclasses.replace(t, block_kv=c * t.block_kv)
    kv_head = lax.div(h, jnp.int32(t.group))
    dtype = jnp.dtype(t.dtype)
    grad_dtype = dk_ref.dtype

    def kv_rows(w):
        return pl.ds(consumer_first_row(ci * cta.block_kv, w, t.block_kv), t.block_kv)

    sources, scratch = _streams(t, _q_streams(t, q_ref, do_ref, lse_ref, delta_ref, b, h))
    if has_bias:
        scratch.append(
            (
                plgpu.SMEM((t.stages, c, t.block_kv, t.block_q), jnp.float32, transforms=_tiled(jnp.float32)),
                plgpu.Barrier(num_barriers=t.stages * c),
            )
        )

    def body(k_smem, v_smem, lhs_smem, grad_smem, ds_smem, kv_barrier, consumed, *stream_scratch):
        streams = {name: Stream(sources[name], smem, bar) for name, (smem, bar) in zip(sources, stream_scratch)}
        if has_bias:
            streams["bias"] = RowSplitStream(
                lambda i, w: t.bias_window(bias_ref, b, h, kv_rows(w), q_block_rows(t, i)),
                *stream_scratch[-1],
                consumers=c,
            )
        first = first_q_block_seeing(cta, ci)
        blocks = pl.cdiv(t.seq_q, t.block_q)
        pipe = SharedPipeline(streams, t.stages, first, blocks - first, blocks, consumed)

        def consume(wg, view):
            k_tile, v_tile, grad_tile = k_smem.at[wg], v_smem.at[wg], grad_smem.at[wg]
            plgpu.copy_gmem_to_smem(k_ref.at[b, kv_rows(wg), kv_head], k_tile, kv_barrier.at[2 * wg])
            plgpu.copy_gmem_to_smem(v_ref.at[b, kv_rows(wg), kv_head], v_tile, kv_barrier.at[2 * wg + 1])
            plgpu.barrier_wait(kv_barrier.at[2 * wg])
            plgpu.barrier_wait(kv_barrier.at[2 * wg + 1])
            refs = DkdvRefs(
                k_tile,
                v_tile,
                None if lhs_smem is None else lhs_smem.at[wg],
                ds_smem.at[wg] if with_ds else None,
                ds_ref,
                b,
                h,
                consumer_first_row(ci * cta.block_kv, wg, t.block_kv),
            )
            init = (zeros((t.block_kv, t.width), plgpu.Layout.WGMMA),) * 2
            dk, dv = view.run(lambda i, carry: bodies.dkdv_step(t, view, refs, i, carry), init)
            if with_ds:
                plgpu.wait_smem_to_gmem(0)
            # dk, then dv, through the consumer's one gradient tile (SMEM for a second
            # f32 tile per consumer is what the GQA case would lack)
            for grad, out_ref in ((dk * jnp.float32(t.sm_scale), dk_ref), (dv, dv_ref)):
                grad_tile[...] = grad.astype(grad_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(grad_tile, out_ref.at[b, kv_rows(wg), h])
                plgpu.wait_smem_to_gmem(0)

        specialise(pipe, c, consume)

    tiles_kv = _smem((c, t.block_kv, t.width), dtype)
    pl.run_scoped(
        body,
        tiles_kv,
        tiles_kv,
        _smem((c, t.block_kv, t.block_q), dtype) if t.interpreted else None,
        _smem((c, t.block_kv, t.width), grad_dtype),
        _smem((c, t.block_kv, t.block_q), jnp.float32) if with_ds else None,
        plgpu.Barrier(num_barriers=2 * c),
        plgpu.Barrier(num_arrivals=c, num_barriers=t.stages),
        *scratch,
        collective_axes="wg",
    )


def _dq_kernel(q_ref, do_ref, k_ref, v_ref, lse_ref, delta_ref, *rest, t: Tile, bodies: Bodies):
    bias_ref = rest[0] if t.bias_dims is not None else None
    dq_ref = rest[-1]
    b, h, qi = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("blocks")
    q_start = qi * t.block_q
    dtype = jnp.dtype(t.dtype)
    sources, scratch = _kv_streams(t, k_ref, v_ref, bias_ref, b, h, q_start)

    def body(q_smem, do_smem, lhs_smem, lse_smem, delta_smem, barriers, *stream_scratch):
        streams = {name: Stream(sources[name], smem, bar) for name, (smem, bar) in zip(sources, stream_scratch)}
        pipe = Pipeline(streams, t.stages, 0, bodies.kv_blocks_seen(t, qi), pl.cdiv(t.seq_kv, t.block_kv))
        rows = pl.ds(q_start, t.block_q)
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, barriers.at[0])
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem, barriers.at[1])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem, barriers.at[2])
        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem, barriers.at[3])
        for i in range(4):
            plgpu.barrier_wait(barriers.at[i])
        vector = plgpu.Layout.WGMMA.reduce(1)
        lse, delta = plgpu.load(lse_smem, layout=vector), plgpu.load(delta_smem, layout=vector)
        refs = DqRefs(q_smem, do_smem, lhs_smem, lse, delta, q_start)
        dq = pipe.run(
            lambda j, carry: bodies.dq_step(t, pipe, refs, j, carry), zeros((t.block_q, t.width), plgpu.Layout.WGMMA)
        )
        q_smem[...] = (dq * jnp.float32(t.sm_scale)).astype(dtype)  # q is no longer read
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, rows, h])
        plgpu.wait_smem_to_gmem(0)

    tile_q = _smem((t.block_q, t.width), dtype)
    vec = plgpu.SMEM((t.block_q,), jnp.float32)
    lhs = lhs_tile(t, (t.block_q, t.block_kv))
    pl.run_scoped(body, tile_q, tile_q, lhs, vec, vec, plgpu.Barrier(num_barriers=4), *scratch)


# ---------------------------------------------------------------------------------
# Wrappers: checks, padding, the plgpu.kernel calls.


def _check(q: jax.Array, backend: Backend) -> None:
    if not backend.is_mosaic_gpu:
        raise ValueError(f"mosaic_gpu_attention runs on mosaic_gpu or mosaic_gpu_interpret, got backend {backend}")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(
            f"attention on Mosaic GPU takes bfloat16 or float16 inputs, got {jnp.dtype(q.dtype).name}: wgmma "
            "would round float32 to tf32 and a tf32 logit error is exponentiated; use backend triton or "
            "interpret for float32"
        )
    if q.shape[3] > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim must be <= {MAX_HEAD_DIM} on Mosaic GPU (wider tiles fit no config in 227 KiB of SMEM), "
            f"got {q.shape[3]}: use backend triton for it"
        )
    backend.require_available()


def _pad(x: jax.Array, axis: int, size: int) -> jax.Array:
    if x.shape[axis] == size:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pads)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _logit_bias(bias: jax.Array | None, mask: jax.Array | None, rows: int, cols: int) -> jax.Array | None:
    """The f32 additive bias the kernels read, [b, h, rows, cols] with batch/head dims
    1 where both broadcast: bias (exact in f32), -inf where the mask hides the key;
    zeros in the padding (the kernels mask padded keys themselves)."""
    if bias is None and mask is None:
        return None
    parts = [x.reshape((1,) * (4 - x.ndim) + x.shape) for x in (bias, mask) if x is not None]
    shape = tuple(max(x.shape[d] for x in parts) for d in range(4))
    out = jnp.zeros(shape, jnp.float32)
    if bias is not None:
        out = out + parts[0].astype(jnp.float32)
    if mask is not None:
        out = jnp.where(parts[-1] != 0, out, NEG_INF)
    return _pad(_pad(out, 2, rows), 3, cols)


def _tile(
    q: jax.Array,
    k: jax.Array,
    bias: jax.Array | None,
    *,
    causal: bool,
    sm_scale: float,
    block_q: int,
    block_kv: int,
    stages: int,
    backend: Backend,
) -> Tile:
    return Tile(
        seq_q=q.shape[1],
        seq_kv=k.shape[1],
        width=padded_head_dim(q.shape[3]),
        causal=causal,
        sm_scale=float(sm_scale),
        bias_dims=None if bias is None else (bias.shape[0], bias.shape[1]),
        group=q.shape[2] // k.shape[2],
        block_q=block_q,
        block_kv=block_kv,
        stages=stages,
        dtype=jnp.dtype(q.dtype).name,
        interpreted=backend.is_interpreted,
    )


def _padded(x: jax.Array, rows: int, width: int) -> jax.Array:
    return _pad(_pad(x, 1, rows), 3, width)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "config", "backend", "bodies"))
def forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    *,
    causal: bool,
    sm_scale: float,
    config: Config,
    backend: Backend,
    bodies: Bodies = Bodies(),
) -> tuple[jax.Array, jax.Array]:
    """(out [b, seq_q, h, d], lse [b, h, seq_q] f32). ``bias``/``mask`` are rank 4 and
    broadcast to [b, h, seq_q, seq_kv] (batch/head dims 1 or full); mask True = visible."""
    _check(q, backend)
    (batch, seq_q, heads, head_dim), seq_kv = q.shape, k.shape[1]
    c = config
    cta_rows = c.block_q * c.consumers
    rows, cols = _round_up(seq_q, cta_rows), _round_up(seq_kv, c.block_kv)
    logit_bias = _logit_bias(bias, mask, rows, cols)
    t = _tile(
        q,
        k,
        logit_bias,
        causal=causal,
        sm_scale=sm_scale,
        block_q=c.block_q,
        block_kv=c.block_kv,
        stages=c.max_concurrent_steps,
        backend=backend,
    )
    args = [_padded(q, rows, t.width), _padded(k, cols, t.width), _padded(v, cols, t.width)]
    args += [logit_bias] if logit_bias is not None else []
    out, stats = plgpu.kernel(
        functools.partial(_forward_kernel if c.consumers == 1 else _forward_ws_kernel, t=t, bodies=bodies),
        out_type=(
            jax.ShapeDtypeStruct(args[0].shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads, 2, rows), jnp.float32),
        ),
        grid=(batch, heads, rows // cta_rows),
        grid_names=("batch", "heads", "blocks"),
        interpret=backend.interpret_arg(),
        compiler_params=APPROX_MATH,
        **_warpgroups(c.consumers),
    )(*args)
    m, l = stats[:, :, 0, :seq_q], stats[:, :, 1, :seq_q]
    empty = l == 0.0
    lse = jnp.where(empty, NEG_INF, m + jnp.log(jnp.where(empty, 1.0, l)))  # XLA's log: accurate
    return out[:, :seq_q, :, :head_dim], lse


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "config", "backend", "bodies"))
def backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    out: jax.Array,
    lse: jax.Array,
    do: jax.Array,
    *,
    causal: bool,
    sm_scale: float,
    config: Config,
    backend: Backend,
    bodies: Bodies = Bodies(),
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """(dq, dk, dv, ds): ds is the f32 [b, h, seq_q, seq_kv] gradient of the logits
    (None without a bias), which the caller sums over the bias' broadcast dims."""
    _check(q, backend)
    (batch, seq_q, heads, head_dim), (seq_kv, heads_kv) = q.shape, k.shape[1:3]
    group = heads // heads_kv
    c = config
    cta_cols = c.block_kv_bwd * c.consumers_bwd  # the dk/dv kernel's keys per CTA
    rows, cols = _round_up(seq_q, c.block_q_bwd), _round_up(seq_kv, cta_cols)
    logit_bias = _logit_bias(bias, mask, rows, cols)
    t = _tile(
        q,
        k,
        logit_bias,
        causal=causal,
        sm_scale=sm_scale,
        block_q=c.block_q_bwd,
        block_kv=c.block_kv_bwd,
        stages=c.max_concurrent_steps,
        backend=backend,
    )
    delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    vectors = [_pad(guard_neg_inf(lse), 2, rows), _pad(delta, 2, rows)]
    qp, dop = _padded(q, rows, t.width), _padded(do, rows, t.width)
    kp, vp = _padded(k, cols, t.width), _padded(v, cols, t.width)
    has_bias = bias is not None
    interpret = backend.interpret_arg()
    grid_names = ("batch", "heads", "blocks")

    grad_dtype = k.dtype if group == 1 else jnp.float32
    kv_grad = jax.ShapeDtypeStruct((batch, cols, heads, t.width), grad_dtype)
    out_type = [kv_grad, kv_grad]
    extra = []
    if logit_bias is not None:
        extra = [logit_bias.transpose(0, 1, 3, 2)]
    if has_bias:
        out_type.append(jax.ShapeDtypeStruct((batch, heads, cols, rows), jnp.float32))
    outs = plgpu.kernel(
        functools.partial(
            _dkdv_kernel if c.consumers_bwd == 1 else _dkdv_ws_kernel, t=t, bodies=bodies, with_ds=has_bias
        ),
        out_type=tuple(out_type),
        grid=(batch, heads, cols // cta_cols),
        grid_names=grid_names,
        interpret=interpret,
        compiler_params=APPROX_MATH,
        **_warpgroups(c.consumers_bwd),
    )(qp, dop, kp, vp, *vectors, *extra)
    dk, dv = (x[:, :seq_kv, :, :head_dim] for x in outs[:2])
    if group > 1:  # f32 partials per q head -> one sum per kv head
        dk = dk.reshape(batch, seq_kv, heads_kv, group, head_dim).sum(3).astype(k.dtype)
        dv = dv.reshape(batch, seq_kv, heads_kv, group, head_dim).sum(3).astype(v.dtype)
    ds = None
    if has_bias:
        ds = outs[2].transpose(0, 1, 3, 2)[:, :, :seq_q, :seq_kv]
        if causal:  # q blocks above the diagonal are never visited: their ds is 0
            visible = jnp.arange(seq_kv)[None, :] <= jnp.arange(seq_q)[:, None] + (seq_kv - seq_q)
            ds = jnp.where(visible, ds, 0.0)

    dq = plgpu.kernel(
        functools.partial(_dq_kernel, t=t, bodies=bodies),
        out_type=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        grid=(batch, heads, rows // c.block_q_bwd),
        grid_names=grid_names,
        interpret=interpret,
        compiler_params=APPROX_MATH,
    )(qp, dop, kp, vp, *vectors, *([logit_bias] if logit_bias is not None else []))
    return dq[:, :seq_q, :, :head_dim], dk, dv, ds
