"""The ring collectives of kernels/collectives.py on NVIDIA GPUs (Mosaic GPU): the
same algorithms, with remote references and semaphores instead of remote DMAs.

One process drives every GPU of a 1-D mesh (``shard_map`` over the host's GPUs); a
kernel reaches a peer's buffer through ``plgpu.remote_ref`` (NVLink peer memory) and
signals a peer's semaphore with ``pl.semaphore_signal(..., device_id=...)``. Only
point-to-point copies and signals are used: no multicast or multimem instruction
(NVLink multicast can take a shared host's GPUs out of service;
tests/test_gpu_collectives_source.py reads this file to keep it so).

Data moves in boxes: TMA copies GMEM -> SMEM -> GMEM (the store may target a peer).
Each CTA owns a fixed set of boxes of every slot, the same on every device, so a
CTA depends only on the CTA of the same index on its left neighbour (a kernel's
scratch semaphores are per CTA, so CTA c on one device can signal exactly CTA c's
semaphores on another; a semaphore shared by CTAs is a ``pl.get_global``): CTA c signals
the right neighbour's semaphore ``c`` once per step, after its stores of that step
have completed (``wait_smem_to_gmem(0)``; the signal is a system-scope release), and
waits (decrementing) on its own semaphore ``c`` before forwarding a slot. Signals
from one sender arrive in step order, so one counting semaphore per CTA suffices.

Entry and exit: the Mosaic GPU custom call zero-fills the semaphore scratch and
then, because the kernel uses peer memory, runs a device barrier before the kernel
starts (XLA's collective-kernel launch), so no signal or write reaches a device that
has not entered the kernel. Every device waits for everything sent to it before it
returns, and every store is complete before its signal, so no write lands after a
device's kernel has ended.

- **all_gather** (ring, p devices, slot i of the output is device i's block): step 0
  stores the local block into the local slot i and the right neighbour's slot i;
  step s = 1 .. p-2 waits for slot (i - s) from the left and forwards it right; a
  last wait takes slot (i + 1). The block is viewed as rows of LANE elements (a
  bitcast), so any block whose size divides by LANE elements is gathered by the
  same boxes.
- **all_gather_matmul** ``all_gather(x, rows) @ w``: ``copy_ctas`` CTAs run the ring
  all-gather of x into a gathered buffer and also signal a per-slot semaphore of
  the receiving device once their boxes of that slot have landed; the other CTAs
  walk the output tiles step by step (slot (i - s) at step s, the local one first),
  waiting (without decrementing) until all ``copy_ctas`` boxes of the slot are in,
  and run kernels/mosaic_gpu_matmul.py's warp-specialised tile on it (a memory
  warpgroup and two consumer warpgroups; ``Config.consumers=1``: its one-warpgroup
  tile): communication overlaps the matmul of earlier slots.
- **matmul_reduce_scatter** (K sharded): output tile t of block c is owned by CTA
  (t mod ctas) on every device. At step s device i computes its f32 partial of
  tile t of block (i - s - 1); from step 1 on it waits for the running sum of that
  tile from the left (one signal per tile, in the same order on every device),
  adds it, and stores the sum into the right neighbour's receive slot s (one slot
  per step: a slot is never overwritten before it is read); at step p - 1 the sum
  of block i is complete and is rounded once to the output dtype.

Arithmetic: the gather moves bits. The matmuls are kernels/mosaic_gpu_matmul.py's
tiles (bf16/f16 operands, products exact, blocked f32 accumulation with block tile_k
inside one wgmma per K tile); the reduce-scatter adds the p f32 partials
in ring order (sequentially) and rounds once: oracles/collectives.py's models.

Runs on Hopper GPUs only. The Mosaic GPU interpreter has no remote references or
semaphores, so on the CPU these kernels are checked only by lowering them
(tests/test_gpu_collectives_source.py); the algorithms themselves are checked in
the TPU interpreter through kernels/collectives.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallascheck.kernels import mosaic_gpu_matmul as mm
from pallascheck.kernels import tiling

LANE = 128  # elements per row of a gathered block's 2-D view: 256 or 512 bytes a row
MAX_BOX_ROWS = 64  # a 64 x 128 f32 box is 32 KiB: four fit in SMEM beside nothing else
BOX_STAGES = 4  # SMEM boxes in flight per CTA (loads ahead of the store being issued)
MATMUL_STAGES = 3


@dataclasses.dataclass(frozen=True)
class Config:
    """``ctas``: CTAs of the gather (all_gather) or of the whole kernel (the
    matmuls; 0: one per SM). ``copy_ctas``: of those, the CTAs that move data in
    all_gather_matmul. ``tile_m`` x ``tile_n`` x ``tile_k``: the matmul tile."""

    ctas: int = 0
    copy_ctas: int = 16
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    # all_gather_matmul's compute CTAs: 2 (the default) is the warp-specialised tile
    # (tile_m x 2 tile_n), 1 the one-warpgroup tile; at 8192^3 per GPU on H100s the
    # first took 2.15-2.17 ms and the second 2.92-2.93 (docs/results.md).
    # matmul_reduce_scatter has the one-warpgroup tile only.
    consumers: int = 2

    def __post_init__(self) -> None:
        for name in ("ctas", "copy_ctas", "tile_m", "tile_n", "tile_k", "consumers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"config.{name} must be an int >= 0, got {value!r}")
        if self.copy_ctas < 1:
            raise ValueError(f"config.copy_ctas must be >= 1, got {self.copy_ctas}")
        # validated as the single-device matmul's tile (wgmma shapes, registers, consumers)
        self.matmul()

    def matmul(self, consumers: int | None = None) -> mm.Config:
        """The matmul tile (``consumers``: override, for a kernel with one form only)."""
        consumers = self.consumers if consumers is None else consumers
        return mm.Config(self.tile_m, self.tile_n, self.tile_k, MATMUL_STAGES, consumers=consumers)


def configs() -> list[Config]:
    """The tuning space: CTA counts of the gather, the copy/compute split of the
    overlapped matmul, and the matmul tiles."""
    return [
        Config(),
        Config(ctas=32),
        Config(copy_ctas=8),
        Config(copy_ctas=32),
        Config(tile_m=64, tile_n=128, consumers=1),
        Config(tile_m=128, tile_n=64),
        Config(consumers=1),
        Config(copy_ctas=8, consumers=1),
    ]


def sm_count() -> int:
    return int(jax.devices()[0].core_count)


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _box(rows: int, cols: int, itemsize: int) -> tuple[int, int]:
    """The TMA box for a (rows, cols) array: rows a power of two <= MAX_BOX_ROWS that
    divides ``rows``; cols the widest of 256 .. 16 bytes' worth that divides ``cols``
    (a TMA box is at most 256 elements a side and 16-byte aligned)."""
    box_rows = math.gcd(rows, MAX_BOX_ROWS) if rows % 2 == 0 else 1
    for box_cols in (256, 128, 64, 32, 16, 8):
        if cols % box_cols == 0 and box_cols * itemsize >= 16:
            return box_rows, box_cols
    raise ValueError(f"a ({rows}, {cols}) array of {itemsize}-byte elements cannot be moved in 16-byte TMA boxes")


@dataclasses.dataclass(frozen=True)
class Boxes:
    """The boxes of one (rows, cols) slot and which of them a CTA moves: box ``g``
    (row block g // per_row, column block g % per_row), CTA c moving c, c + ctas, ..."""

    rows: int
    cols: int
    box_rows: int
    box_cols: int
    ctas: int

    @property
    def count(self) -> int:
        return (self.rows // self.box_rows) * (self.cols // self.box_cols)

    @property
    def per_cta(self) -> int:
        return self.count // self.ctas

    def at(self, ref: Any, slot_row: Any, cta: Any, b: Any) -> Any:
        """Box ``b`` of CTA ``cta`` in the slot whose first row is ``slot_row``."""
        g = cta + b * self.ctas
        per_row = self.cols // self.box_cols
        r = slot_row + (g // per_row) * self.box_rows
        return ref.at[pl.ds(r, self.box_rows), pl.ds((g % per_row) * self.box_cols, self.box_cols)]


def plan_boxes(rows: int, cols: int, itemsize: int, max_ctas: int) -> Boxes:
    box_rows, box_cols = _box(rows, cols, itemsize)
    count = (rows // box_rows) * (cols // box_cols)
    return Boxes(rows, cols, box_rows, box_cols, _largest_divisor(count, max_ctas))


def move_boxes(
    boxes: Boxes, cta: Any, src: Callable[[Any], Any], dsts: Callable[[Any], list[Any]], smem: Any, loaded: Any
) -> None:
    """Copy this CTA's boxes ``src(b)`` -> every ``dsts(b)`` through a ring of SMEM
    boxes: the loads of the next boxes are in flight while a box is stored; a slot
    is refilled once its store has read it. Returns with every store issued (not
    complete)."""
    n, stages = boxes.per_cta, smem.shape[0]
    ahead = min(stages, n)

    def load(b: Any, slot: Any) -> None:
        plgpu.copy_gmem_to_smem(src(b), smem.at[slot], loaded.at[slot])

    for b in range(ahead):
        load(b, b)

    @pl.loop(0, n)
    def _box(b):
        slot = lax.rem(b, ahead)
        plgpu.barrier_wait(loaded.at[slot])
        for dst in dsts(b):
            plgpu.copy_smem_to_gmem(smem.at[slot], dst)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(b + ahead < n)
        def _refill():
            load(b + ahead, slot)


def _slot(axis: str, p: int, offset: Any) -> Any:
    """The ring slot ``offset`` places from this device's own (mod p)."""
    return lax.rem(lax.axis_index(axis) + offset + 2 * p, p)


@dataclasses.dataclass(frozen=True)
class Ring:
    """The decisions that make the kernels a ring, one function each, so that each
    can be checked (and, in tests/broken/, changed) on its own: where a device sends,
    which slot it forwards at step s, which receive slot step s's sum lands in, the
    wait before forwarding, and the signals per completed step."""

    step: int = 1  # the device data goes to: +1 places along the axis
    signals: int = 1  # per CTA and step
    forward_lag: int = 0  # forward slot (i - s + forward_lag) at step s
    recv_slots: int = 0  # receive slots reused round-robin (0: one per step, never reused)
    wait_forward: bool = True  # wait for the slot's arrival before forwarding it
    wait_slot: bool = True  # the matmul waits for a gathered slot before reading it

    def peer(self, axis: str, p: int) -> dict[str, Any]:
        return {axis: lax.rem(lax.axis_index(axis) + self.step + p, p)}

    def recv_slot(self, s: Any) -> Any:
        return s if self.recv_slots == 0 else lax.rem(s, self.recv_slots)


RING = Ring()


def ring_gather(
    x_ref: Any,
    out_ref: Any,
    arrived: Any,
    boxes: Boxes,
    cta: Any,
    smem: Any,
    loaded: Any,
    *,
    axis: str,
    p: int,
    ring: Ring = RING,
    slot_arrived: Any = None,
) -> None:
    """CTA ``cta``'s part of the ring all-gather of ``x_ref`` (one slot, rows x cols)
    into ``out_ref`` (p slots stacked on rows). ``arrived[cta]`` counts the steps
    whose boxes the left neighbour's CTA ``cta`` has stored here. With
    ``slot_arrived``, each completed step also signals the receiving device's
    ``slot_arrived[slot]`` (for the CTAs that consume the gathered slots)."""
    rows, right = boxes.rows, ring.peer(axis, p)
    remote_out = plgpu.remote_ref(out_ref, right)

    def finish_step(slot: Any) -> None:
        plgpu.wait_smem_to_gmem(0)  # this step's stores are complete (here and on the peer)
        for _ in range(ring.signals):
            pl.semaphore_signal(arrived.at[cta], 1, device_id=right)
            if slot_arrived is not None:
                pl.semaphore_signal(slot_arrived.at[slot], 1, device_id=right)

    own = _slot(axis, p, 0)
    move_boxes(
        boxes,
        cta,
        lambda b: boxes.at(x_ref, 0, cta, b),
        lambda b: [boxes.at(out_ref, own * rows, cta, b), boxes.at(remote_out, own * rows, cta, b)],
        smem,
        loaded,
    )
    finish_step(own)

    @pl.loop(1, p - 1)
    def _step(s):
        slot = _slot(axis, p, -s + ring.forward_lag)
        if ring.wait_forward:
            pl.semaphore_wait(arrived.at[cta], 1)  # slot (i - s) has come from the left
        move_boxes(
            boxes,
            cta,
            lambda b: boxes.at(out_ref, slot * rows, cta, b),
            lambda b: [boxes.at(remote_out, slot * rows, cta, b)],
            smem,
            loaded,
        )
        finish_step(slot)

    pl.semaphore_wait(arrived.at[cta], 1)  # the last slot, (i + 1), has come in


def _gather_scratch(boxes: Boxes, dtype: Any) -> tuple[Any, ...]:
    return (
        plgpu.SMEM((min(BOX_STAGES, boxes.per_cta), boxes.box_rows, boxes.box_cols), dtype),
        plgpu.Barrier(num_arrivals=1, num_barriers=min(BOX_STAGES, boxes.per_cta)),
    )


# --- all_gather -----------------------------------------------------------------------
def all_gather_local(x: jax.Array, *, axis: str, p: int, config: Config, ring: Ring = RING) -> jax.Array:
    """The per-device kernel (inside ``shard_map``): x's block -> the p blocks stacked
    on dimension 0."""
    size = math.prod(x.shape)
    if size % LANE:
        raise ValueError(
            f"x's block on each device must hold a multiple of {LANE} elements for the Mosaic GPU "
            f"all_gather (it moves rows of {LANE}), got block shape {tuple(x.shape)}"
        )
    flat = x.reshape(size // LANE, LANE)
    boxes = plan_boxes(flat.shape[0], LANE, x.dtype.itemsize, config.ctas or sm_count())

    def kernel(x_ref, out_ref, arrived, smem, loaded):
        ring_gather(x_ref, out_ref, arrived, boxes, lax.axis_index("cta"), smem, loaded, axis=axis, p=p, ring=ring)

    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((p * flat.shape[0], LANE), x.dtype),
        scratch_types=(plgpu.SemaphoreType.REGULAR((boxes.ctas,)), *_gather_scratch(boxes, x.dtype)),
        grid=(boxes.ctas,),
        grid_names=("cta",),
    )(flat)
    return out.reshape((p * x.shape[0],) + tuple(x.shape[1:]))


# --- all_gather_matmul -------------------------------------------------------------------
def _tile(x_src: Any, w_ref: Any, out_ref: Any, x_smem: Any, w_smem: Any, loaded: Any, out_smem: Any, m0, n0) -> None:
    """One output tile out[m0:, n0:] = x_src[m0:, :] @ w_ref[:, n0:], rounded once."""
    acc = _partial(x_src, w_ref, x_smem, w_smem, loaded, m0, n0)
    mm.store_tiles([out_ref], [out_smem], [acc], pl.ds(m0, x_smem.shape[1]), pl.ds(n0, w_smem.shape[2]))


def _matmul_scratch(tm: mm.Config, dtype: Any, out_dtype: Any) -> tuple[Any, ...]:
    s, m, n, k = tm.max_concurrent_steps, tm.tile_m, tm.tile_n, tm.tile_k
    return (
        plgpu.SMEM((s, m, k), dtype, transforms=mm.operand_transforms(k, dtype)),
        plgpu.SMEM((s, k, n), dtype, transforms=mm.operand_transforms(k, dtype)),
        plgpu.Barrier(num_arrivals=2, num_barriers=s),
        plgpu.SMEM((m, n), out_dtype, transforms=mm.operand_transforms(n, out_dtype)),
    )


def all_gather_matmul_local(
    x: jax.Array, w: jax.Array, *, axis: str, p: int, out_dtype: Any, config: Config, ring: Ring = RING
) -> jax.Array:
    """Per device: x's row block (m, k) and w's column block (k, n) -> (p m, n)."""
    (m, k), n = x.shape, w.shape[1]
    tm = config.matmul()
    cta_n = tm.consumers * tm.tile_n
    mm.check_input_dtype(x.dtype)
    for name, size, tile in (
        ("x rows per device", m, tm.tile_m),
        ("K", k, tm.tile_k),
        ("w columns per device", n, cta_n),
    ):
        if size % tile:
            raise ValueError(
                f"{name} ({size}) must be a multiple of the tile ({tile}) for the Mosaic GPU all_gather_matmul"
            )
    total = config.ctas or sm_count()
    if not 1 <= config.copy_ctas < total:
        raise ValueError(f"config.copy_ctas ({config.copy_ctas}) must be in [1, ctas) with ctas={total}")
    boxes = plan_boxes(m, k, x.dtype.itemsize, config.copy_ctas)
    shape = _Tiles(p, m, n, tm.tile_m, cta_n, boxes.ctas, total - boxes.ctas)
    tiling.require_shared_memory(
        config,
        max(
            mm.smem_bytes(tm, x.dtype.itemsize, jnp.dtype(out_dtype).itemsize, False),
            min(BOX_STAGES, boxes.per_cta) * boxes.box_rows * boxes.box_cols * x.dtype.itemsize,
        ),
    )
    specialised = tm.consumers == 2

    def kernel(x_ref, w_ref, out_ref, gathered_ref, arrived):
        cta = lax.axis_index("cta")
        # Counted by the copy CTAs, waited on by the compute CTAs: one semaphore array
        # for the whole grid (pl.get_global; kernel scratch semaphores are per CTA),
        # zero-filled with the rest of the kernel's GMEM scratch at every call.
        slot_arrived = pl.get_global(plgpu.SemaphoreType.REGULAR((p,)))

        def gather(smem, loaded):
            def run():
                ring_gather(
                    x_ref,
                    gathered_ref,
                    arrived,
                    boxes,
                    cta,
                    smem,
                    loaded,
                    axis=axis,
                    p=p,
                    ring=ring,
                    slot_arrived=slot_arrived,
                )

            if specialised:  # one warpgroup of a copy CTA moves the boxes
                pl.when(lax.axis_index("wg") == 0)(run)
            else:
                run()

        @pl.when(cta < shape.copiers)
        def _copy():
            # in the warp-specialised kernel SMEM belongs to all three warpgroups
            pl.run_scoped(
                gather, *_gather_scratch(boxes, x.dtype), **({"collective_axes": "wg"} if specialised else {})
            )

        @pl.when(cta >= shape.copiers)
        def _compute():
            def wait(slot: Any) -> None:  # every copy CTA's boxes of this slot have landed
                if ring.wait_slot:
                    pl.semaphore_wait(slot_arrived.at[slot], shape.copiers, decrement=False)

            if specialised:
                _specialised_tiles(
                    x_ref, w_ref, out_ref, gathered_ref, wait, shape, tm, cta - shape.copiers, out_dtype, axis
                )
                return

            def tiles(*scratch):
                @pl.loop(cta - shape.copiers, shape.count, step=shape.computers)
                def _t(t):
                    s, slot, m0, n0 = shape.of(t, axis)
                    out_block = out_ref.at[pl.ds(slot * m, m)]

                    @pl.when(s == 0)
                    def _local():  # this device's own block, from its input
                        _tile(x_ref, w_ref, out_block, *scratch, m0, n0)

                    @pl.when(s > 0)
                    def _gathered():
                        wait(slot)
                        _tile(gathered_ref.at[pl.ds(slot * m, m)], w_ref, out_block, *scratch, m0, n0)

            pl.run_scoped(tiles, *_matmul_scratch(tm, x.dtype, out_dtype))

    out, _ = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((p * m, n), out_dtype),
            jax.ShapeDtypeStruct((p * m, k), x.dtype),  # the gathered x, written by the ring
        ),
        scratch_types=(plgpu.SemaphoreType.REGULAR((shape.copiers,)),),
        grid=(total,),
        grid_names=("cta",),
        num_threads=3 if specialised else None,
        thread_name="wg" if specialised else None,
    )(x, w)
    return out


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """The compute CTAs' work: ``p`` slots of (m, n) output, in CTA tiles of
    tile_m x cta_n, walked slot by slot (the local slot first), tile t going to
    compute CTA t mod computers."""

    p: int
    m: int
    n: int
    tile_m: int
    cta_n: int
    copiers: int
    computers: int

    @property
    def per_step(self) -> int:
        return (self.m // self.tile_m) * (self.n // self.cta_n)

    @property
    def count(self) -> int:
        return self.p * self.per_step

    def of(self, t: Any, axis: str) -> tuple[Any, Any, Any, Any]:
        """Tile t's step, ring slot and first output row and column within the slot."""
        s, within = t // self.per_step, t % self.per_step
        n_tiles = self.n // self.cta_n
        return s, _slot(axis, self.p, -s), (within // n_tiles) * self.tile_m, (within % n_tiles) * self.cta_n


def _specialised_tiles(
    x_ref, w_ref, out_ref, gathered_ref, wait, shape: _Tiles, tm: mm.Config, worker, out_dtype, axis: str
) -> None:
    """The compute CTAs' tiles in kernels/mosaic_gpu_matmul.py's warp-specialised form:
    a memory warpgroup issues the TMA copies of the K tiles, two consumer warpgroups
    each own a tile_m x tile_n f32 accumulator; every slot but the first is read from
    the gathered buffer once it has landed (the first, the local block, from x)."""
    tn, tk, stages = tm.tile_n, tm.tile_k, tm.max_concurrent_steps
    epi = mm.epilogue_n(False)
    wg = lax.axis_index("wg")
    my_cols = pl.ds(wg * tn, tn)
    dtype = x_ref.dtype

    def step(_, x_smem, y_smem, acc_ref):
        plgpu.wgmma(acc_ref, x_smem, y_smem.at[:, my_cols])
        plgpu.wgmma_wait(0)  # the slot is released on return
        return acc_ref

    def pipeline(consume: Callable[..., None]) -> Any:
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(x_ref.shape[1] // tk,),
            memory_registers=tiling.MEMORY_WARPGROUP_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((tm.tile_m, tk), lambda kk: (0, kk), transforms=mm.operand_transforms(tk, dtype)),
                plgpu.BlockSpec((tk, 2 * tn), lambda kk: (kk, 0), transforms=mm.operand_transforms(tk, dtype)),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=consume,
        )

    def scope(allocations, out_smem):
        @pl.loop(worker, shape.count, step=shape.computers)
        def _t(t):
            s, slot, m0, n0 = shape.of(t, axis)
            m_slice, cta_cols = pl.ds(m0, tm.tile_m), pl.ds(n0, 2 * tn)
            out_tile = out_ref.at[pl.ds(slot * shape.m, shape.m)].at[m_slice, cta_cols].at[:, my_cols]

            def consume(run_pipeline):
                def with_accumulator(acc_ref):  # allocated as exact zeros
                    run_pipeline(acc_ref)
                    plgpu.wgmma_wait(0)
                    acc = acc_ref[...]
                    for c in range(tn // epi):
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last slice is read out
                        out_smem[wg] = acc[:, c * epi : (c + 1) * epi].astype(out_smem.dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(out_smem.at[wg], out_tile.at[:, pl.ds(c * epi, epi)])

                pl.run_scoped(with_accumulator, plgpu.ACC((tm.tile_m, tn), jnp.float32))

            @pl.when(s == 0)
            def _local():  # this device's own block, from its input
                pipeline(consume)(x_ref.at[m_slice, :], w_ref.at[:, cta_cols], allocations=allocations)

            @pl.when(s > 0)
            def _gathered():
                wait(slot)
                rows = gathered_ref.at[pl.ds(slot * shape.m, shape.m)]
                pipeline(consume)(rows.at[m_slice, :], w_ref.at[:, cta_cols], allocations=allocations)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's slices are read out

    pl.run_scoped(
        scope,
        pipeline(lambda _: None).get_allocations(x_ref.at[pl.ds(0, tm.tile_m), :], w_ref.at[:, pl.ds(0, 2 * tn)]),
        plgpu.SMEM((2, tm.tile_m, epi), out_dtype, transforms=mm.operand_transforms(epi, out_dtype)),
        collective_axes="wg",
    )


# --- matmul_reduce_scatter -------------------------------------------------------------
def matmul_reduce_scatter_local(
    x: jax.Array, w: jax.Array, *, axis: str, p: int, out_dtype: Any, config: Config, ring: Ring = RING
) -> jax.Array:
    """Per device: x (p rows, k_local) and w (k_local, n) -> the summed row block (rows, n)."""
    (mp, k), n = x.shape, w.shape[1]
    rows = mp // p
    tm = config.matmul(consumers=1)  # the one-warpgroup tile: its epilogue adds the running sum
    mm.check_input_dtype(x.dtype)
    for name, size, tile in (
        ("output rows per device", rows, tm.tile_m),
        ("K per device", k, tm.tile_k),
        ("N", n, tm.tile_n),
    ):
        if size % tile:
            raise ValueError(
                f"{name} ({size}) must be a multiple of the tile ({tile}) for the Mosaic GPU matmul_reduce_scatter"
            )
    tiles = (rows // tm.tile_m) * (n // tm.tile_n)
    ctas = _largest_divisor(tiles, config.ctas or sm_count())
    n_tiles = n // tm.tile_n
    f32_tile = tm.tile_m * tm.tile_n * 4
    tiling.require_shared_memory(
        config, mm.smem_bytes(tm, x.dtype.itemsize, jnp.dtype(out_dtype).itemsize, False) + f32_tile
    )

    def kernel(x_ref, w_ref, out_ref, recv_ref, arrived, x_smem, w_smem, loaded, out_smem, sum_smem, sum_loaded):
        cta = lax.axis_index("cta")
        to_right = ring.peer(axis, p)
        remote_recv = plgpu.remote_ref(recv_ref, to_right)

        @pl.loop(0, p)
        def _step(s):
            block = _slot(axis, p, -s - 1)

            @pl.loop(cta, tiles, step=ctas)
            def _t(t):
                m0, n0 = (t // n_tiles) * tm.tile_m, (t % n_tiles) * tm.tile_n
                m_slice, n_slice = pl.ds(m0, tm.tile_m), pl.ds(n0, tm.tile_n)
                partial = _partial(x_ref.at[pl.ds(block * rows, rows)], w_ref, x_smem, w_smem, loaded, m0, n0)

                def running(acc):
                    @pl.when(s > 0)
                    def _add():
                        if ring.wait_forward:
                            pl.semaphore_wait(arrived.at[cta], 1)  # the left's sum of this tile is in recv[s - 1]
                        plgpu.copy_gmem_to_smem(
                            recv_ref.at[ring.recv_slot(s - 1), m_slice, n_slice], sum_smem, sum_loaded
                        )
                        plgpu.barrier_wait(sum_loaded)

                    @pl.when(s == 0)
                    def _first():
                        sum_smem[...] = jnp.zeros_like(acc)

                    return acc + plgpu.load(sum_smem, layout=plgpu.Layout.WGMMA)

                total = running(partial)

                @pl.when(s < p - 1)
                def _send():
                    sum_smem[...] = total
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(sum_smem, remote_recv.at[ring.recv_slot(s), m_slice, n_slice])
                    plgpu.wait_smem_to_gmem(0)  # complete on the peer before it is told
                    for _ in range(ring.signals):
                        pl.semaphore_signal(arrived.at[cta], 1, device_id=to_right)

                @pl.when(s == p - 1)
                def _finish():
                    mm.store_tiles([out_ref], [out_smem], [total], m_slice, n_slice)

    out, _ = plgpu.kernel(
        kernel,
        out_type=(
            jax.ShapeDtypeStruct((rows, n), out_dtype),
            jax.ShapeDtypeStruct((max(p - 1, 1), rows, n), jnp.float32),  # receive slot of each step
        ),
        scratch_types=(
            plgpu.SemaphoreType.REGULAR((ctas,)),
            *_matmul_scratch(tm, x.dtype, out_dtype),
            plgpu.SMEM((tm.tile_m, tm.tile_n), jnp.float32),
            plgpu.Barrier(num_arrivals=1),
        ),
        grid=(ctas,),
        grid_names=("cta",),
    )(x, w)
    return out


def _partial(x_src, w_ref, x_smem, w_smem, loaded, m0, n0) -> Any:
    """The f32 product tile x_src[m0:, :] @ w_ref[:, n0:] (not rounded)."""
    m_slice, n_slice = pl.ds(m0, x_smem.shape[1]), pl.ds(n0, w_smem.shape[2])
    return mm.tile_product(x_src, w_ref, x_smem, w_smem, loaded, m_slice, n_slice, x_src.shape[1] // x_smem.shape[2])
