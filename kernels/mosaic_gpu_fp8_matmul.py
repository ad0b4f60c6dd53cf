"""Hopper (Mosaic GPU) block-scaled FP8 matmul (kernels/fp8_matmul.py states the op,
its layouts and its arithmetic). Both forms walk K in steps of ``promote_every``
elements (a span); a span's SMEM slot holds the x tile [rows, span], the w tile
[tile_n, span] (K-major: FP8 wgmma takes no transposed operand, so w's SMEM tile is
read through a transposed view) and the span's scales: x_scale's column for these
rows and w_scale's value for these columns. Per span, per warpgroup: one wgmma of the
slot's FP8 tiles into a fresh f32 accumulator, waited for (the tensor core's
truncating sum covers this span only: that is the promotion), then ``acc += part *
(x_scale * w_scale)`` in f32 registers, span after span in K order. The epilogue
rounds ``acc`` once to ``out_dtype``. The arithmetic is the same in both forms.

Two forms, chosen by ``Config.consumers``:

- ``consumers=2`` (warp-specialised and persistent, the fast one, DeepGEMM's sm90
  design): one CTA per SM walks output tiles of (2 tile_m) x tile_n (in bands of
  ``mosaic_gpu_matmul.BAND_M`` row tiles, for L2 reuse) with three warpgroups. A
  memory warpgroup (40 registers) only issues the TMA copies of x, w and their scales
  into a ring of ``max_concurrent_steps`` slots of ``spans_per_step`` spans each
  (``plgpu.emit_pipeline_warp_specialized``) and starts the next tile's copies while
  the consumers finish this one. Two consumer warpgroups each own tile_m rows of the
  CTA tile (DeepGEMM splits M between its math warpgroups). Per step a consumer
  issues one wgmma per span, each into its own fresh f32 accumulator, loads the
  spans' scales while the tensor core runs them, then promotes span after span, each
  once only the later spans' wgmmas may still run (``wgmma_accumulator_load``'s
  ``wait_n``): with two spans a step the first is promoted while the tensor core sums
  the second. The slot is released when the step returns, every wgmma retired. While
  one consumer promotes, the other's wgmmas keep the tensor core busy too
  (DeepSeek-V3, 3.3.2: "while one warpgroup performs the promotion operation, the
  other is able to execute the MMA operation"). A tile lies in one w_scale block
  (tile_n divides 128), so the promotion's scale is one value per row, x_scale *
  w_scale, and the promotion one FMA per element. A consumer holds its f32 sum and
  one partial per span in registers: at 64 x 128 and two spans, 3 x 64 registers a
  thread, under the 232 a consumer gets. The epilogue stores each sum in
  ``EPILOGUE_N``-column slices through a small SMEM buffer
  (``mosaic_gpu_matmul.store_slices``).
- ``consumers=1``: one warpgroup per (tile_m, tile_n) output tile on a
  (M/tile_m, N/tile_n) grid, its own TMA ring; the slot is refilled with the step
  ``max_concurrent_steps`` ahead once the step's wgmma is read back. The tensor core
  idles while the warpgroup promotes.

Tiles: tile_m 64 or 128 (wgmma M), tile_n 64 or 128 (at most one w_scale block per
tile), promote_every 32, 64 or 128 (wgmma's FP8 K is 32; a step never straddles a
scale block; the byte width of a K-major FP8 row is the SMEM swizzle).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallascheck.kernels import compat, fp8, tiling
from pallascheck.kernels.backends import Backend, get_backend
from pallascheck.kernels.mosaic_gpu_matmul import (
    EPILOGUE_N,
    band_order,
    operand_transforms,
    persistent_ctas,
    store_slices,
    store_tiles,
)

SCALE_BLOCK = fp8.SCALE_BLOCK
WGMMA_FP8_K = 32  # K of one FP8 wgmma instruction
# A consumer of the warp-specialised form holds its f32 sum and the span's partial in
# registers: 2 x 64 x 128 f32 over a warpgroup's 128 threads is 128 registers each,
# leaving room under the 232 a consumer gets (the memory warpgroup keeps 40).
MAX_CONSUMER_TILE_ELEMENTS = 64 * 128


@dataclasses.dataclass(frozen=True)
class Config:
    """tile_m x tile_n output tile per warpgroup, ``promote_every`` the K step (one
    promotion), max_concurrent_steps SMEM slots in the TMA ring, and ``consumers``
    warpgroups per CTA (2: warp-specialised, a CTA tile of 2 tile_m x tile_n)."""

    tile_m: int = 64
    tile_n: int = 128
    promote_every: int = 128
    max_concurrent_steps: int = 3
    consumers: int = 2
    spans_per_step: int | None = None  # None: 2 with two consumers, else 1

    def __post_init__(self) -> None:
        if self.tile_m not in (64, 128):
            raise ValueError(f"config.tile_m must be 64 or 128 (wgmma M is 64 per instruction), got {self.tile_m!r}")
        if self.tile_n not in (64, 128):
            raise ValueError(f"config.tile_n must be 64 or 128 (one w_scale block per tile), got {self.tile_n!r}")
        if self.promote_every not in (32, 64, 128):
            raise ValueError(
                f"config.promote_every must be 32, 64 or 128 (a multiple of the FP8 wgmma's K {WGMMA_FP8_K} "
                f"that divides the scale block {SCALE_BLOCK}), got {self.promote_every!r}"
            )
        if not isinstance(self.max_concurrent_steps, int) or not 2 <= self.max_concurrent_steps <= 8:
            raise ValueError(
                f"config.max_concurrent_steps must be an int in [2, 8] (pipeline stages), "
                f"got {self.max_concurrent_steps!r}"
            )
        if self.consumers not in (1, 2):
            raise ValueError(f"config.consumers must be 1 or 2 (consumer warpgroups per CTA), got {self.consumers!r}")
        if self.consumers == 2 and self.tile_m * self.tile_n > MAX_CONSUMER_TILE_ELEMENTS:
            raise ValueError(
                f"config.tile_m * config.tile_n must be <= {MAX_CONSUMER_TILE_ELEMENTS} with consumers=2 (a "
                f"consumer holds its f32 sum and the span's partial in registers), got {self.tile_m} * {self.tile_n}"
            )
        if self.spans_per_step is None:
            object.__setattr__(self, "spans_per_step", 2 if self.consumers == 2 else 1)
        if self.spans_per_step not in (1, 2) or (self.spans_per_step == 2 and self.consumers != 2):
            raise ValueError(
                f"config.spans_per_step must be 1, or 2 with consumers=2 (a second accumulator per consumer), "
                f"got {self.spans_per_step!r} with consumers={self.consumers!r}"
            )

    @property
    def block_k(self) -> int:
        """The K span of one wgmma accumulation (what the tolerance model calls it)."""
        return self.promote_every

    @property
    def spans(self) -> int:
        """``spans_per_step`` as resolved in ``__post_init__`` (never None)."""
        return self.spans_per_step or 1

    @property
    def cta_m(self) -> int:
        """Rows of the output tile one CTA computes (its consumers' tiles stacked)."""
        return self.consumers * self.tile_m


# The one-consumer form at the tiles it ran by default before the warp-specialised one
# (benchmarked beside it; the no-promotion variant's body is this form's).
ONE_CONSUMER = Config(tile_m=128, tile_n=128, promote_every=128, max_concurrent_steps=4, consumers=1)


def smem_bytes(config: Config, out_itemsize: int) -> int:
    """The ring's FP8 tiles and f32 scale vectors, and the output tile (with two
    consumers: each consumer's EPILOGUE_N-column output slice)."""
    rows, tn = config.cta_m, config.tile_n
    span = (rows + tn) * config.promote_every + 4 * (rows + tn)
    ring = config.max_concurrent_steps * config.spans * span
    out_n = tn if config.consumers == 1 else EPILOGUE_N
    return ring + rows * out_n * out_itemsize


def configs(m: int, n: int, k: int, backend: str | Backend | None = None) -> list[Config]:
    be = get_backend(backend)
    if be.is_interpreted:  # every config costs a compile and an interpreted run
        return [
            Config(64, 64, 128, 2, consumers=1),
            Config(64, 128, 32, 2, consumers=1),
            Config(64, 64, 64, 2, spans_per_step=1),
            Config(64, 64, 64, 2, spans_per_step=2),
        ]
    one = [
        Config(tm, tn, pe, s, consumers=1)
        for tm in (64, 128)
        for tn in (64, 128)
        for pe in (64, 128)
        for s in (3, 4, 5)
    ]
    two = [
        Config(tm, tn, pe, s, spans_per_step=spans)
        for tm, tn in ((64, 128), (64, 64), (128, 64))
        for pe in (64, 128)
        for spans, stages in ((1, (4, 5, 6)), (2, (2, 3, 4)))
        for s in stages
    ]
    return [c for c in one + two if smem_bytes(c, 2) <= tiling.GPU_SHARED_MEMORY_BYTES]


def _body(x_gmem, w_gmem, xs_gmem, ws_gmem, out_gmem, x_smem, w_smem, xs_smem, ws_smem, loaded, out_smem, *, steps):
    stages, tile_m, step_k = x_smem.shape
    tile_n = w_smem.shape[1]
    m_slice = pl.ds(lax.axis_index("m") * tile_m, tile_m)
    n_slice = pl.ds(lax.axis_index("n") * tile_n, tile_n)
    shape = (tile_m, tile_n)

    def load(step, slot):  # TMA copies of K step `step` and its scales into ring slot `slot`
        k_slice = pl.ds(step * step_k, step_k)
        kb = (step * step_k) // SCALE_BLOCK
        plgpu.copy_gmem_to_smem(x_gmem.at[m_slice, k_slice], x_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(w_gmem.at[n_slice, k_slice], w_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(xs_gmem.at[kb, m_slice], xs_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(ws_gmem.at[kb, n_slice], ws_smem.at[slot], loaded.at[slot])

    for step in range(min(stages, steps)):
        load(step, step)

    def step_fn(step, acc):
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(loaded.at[slot])
        part = mma(x_smem.at[slot], compat.transposed_smem(w_smem.at[slot]), shape)
        row = plgpu.load(xs_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))
        col = plgpu.load(ws_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        refill = step + stages
        # order the scale reads above before the TMA that refills their slot
        plgpu.commit_smem()

        @pl.when(refill < steps)
        def _refill():  # the wgmma reading `slot` has retired (mma read its result back)
            load(refill, lax.rem(refill, stages))

        return acc + part * (lax.broadcast_in_dim(row, shape, [0]) * lax.broadcast_in_dim(col, shape, [1]))

    zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
    acc = lax.fori_loop(0, steps, step_fn, zeros)
    store_tiles((out_gmem,), (out_smem,), (acc,), m_slice, n_slice)


def _warp_specialized_call(
    x: jax.Array, w: jax.Array, xs: jax.Array, ws: jax.Array, *, out_dtype: Any, config: Config, backend: Backend
) -> jax.Array:
    """``consumers=2`` (module docstring) on operands padded to the CTA tiles; ``xs``
    [Kb, M] and ``ws`` [Kb, N/128 * tile_m] (each block's value repeated tile_m times)
    the scales laid out for TMA."""
    tm, tn, pe, stages = config.tile_m, config.tile_n, config.promote_every, config.max_concurrent_steps
    rows = config.cta_m
    (mp, kp), np_ = x.shape, w.shape[0]
    m_tiles, n_tiles = mp // rows, np_ // tn
    shape = (tm, tn)

    def body(x_gmem, w_gmem, xs_gmem, ws_gmem, out_gmem):
        wg = lax.axis_index("wg")
        my_rows = pl.ds(wg * tm, tm)  # this consumer's rows of a CTA tile

        def step(_, *refs):
            # refs: (x, w, x_scale, w_scale) slots of each span of the step, then the sum
            *slots, acc = refs
            spans = [slots[i : i + 4] for i in range(0, len(slots), 4)]

            def promote(*part_refs):
                scales = []
                for part_ref, (x_smem, w_smem, xs_smem, ws_smem) in zip(part_refs, spans):
                    plgpu.wgmma(part_ref, x_smem.at[my_rows], compat.transposed_smem(w_smem))
                for _x, _w, xs_smem, ws_smem in spans:  # loaded while the tensor core sums the spans
                    row = plgpu.load(xs_smem.at[0].at[my_rows], layout=plgpu.Layout.WGMMA.reduce(1))
                    tile = plgpu.load(ws_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))  # one value, per row
                    scales.append(lax.broadcast_in_dim(row * tile, shape, [0]))
                plgpu.commit_smem()  # order the scale reads before the TMA that refills their slots
                total = acc
                for i, (part_ref, scale) in enumerate(zip(part_refs, scales)):
                    # span i's wgmma has retired once only the later spans' may run: it is
                    # promoted while they do (the slot is released on return, all retired)
                    total = total + plgpu.wgmma_accumulator_load(part_ref, wait_n=len(spans) - 1 - i) * scale
                return total

            return pl.run_scoped(promote, *(plgpu.ACC(shape, jnp.float32) for _ in spans))

        per_step = config.spans

        def span_specs(i: int) -> list[Any]:
            """Span ``i`` of each step: x, w and their scale rows (a span never straddles a block)."""

            def k_tile(kk):
                return 0, per_step * kk + i

            def scale_row(kk):
                return ((per_step * kk + i) * pe) // SCALE_BLOCK, 0

            return [
                plgpu.BlockSpec((rows, pe), k_tile, transforms=operand_transforms(pe, x.dtype)),
                plgpu.BlockSpec((tn, pe), k_tile, transforms=operand_transforms(pe, w.dtype)),
                plgpu.BlockSpec((1, rows), scale_row),
                plgpu.BlockSpec((1, tm), scale_row),
            ]

        def pipeline(consume: Any) -> Any:
            return plgpu.emit_pipeline_warp_specialized(
                step,
                grid=(kp // (per_step * pe),),
                memory_registers=tiling.MEMORY_WARPGROUP_REGISTERS,
                in_specs=[spec for i in range(per_step) for spec in span_specs(i)],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=stages,
                compute_context=consume,
            )

        def scope(allocations, out_smem):
            # Persistent: each CTA walks output tiles ctas apart. The memory warpgroup
            # starts the next tile's loads while the consumers run this one's epilogue.
            @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="tile")
            def _tile(info):
                m_idx, n_idx = band_order(info.index[0], m_tiles, n_tiles)
                cta_rows, n_slice = pl.ds(m_idx * rows, rows), pl.ds(n_idx * tn, tn)
                w_block = pl.ds(((n_idx * tn) // SCALE_BLOCK) * tm, tm)  # the tile's w_scale block

                def consume(run_pipeline):
                    acc = run_pipeline(plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA))
                    store_slices((out_gmem.at[cta_rows, n_slice].at[my_rows],), (out_smem,), (acc,), wg)

                operands = (
                    x_gmem.at[cta_rows, :],
                    w_gmem.at[n_slice, :],
                    xs_gmem.at[:, cta_rows],
                    ws_gmem.at[:, w_block],
                )
                pipeline(consume)(*(operands * per_step), allocations=allocations)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's slices are read out

        first = (
            x_gmem.at[pl.ds(0, rows), :],
            w_gmem.at[pl.ds(0, tn), :],
            xs_gmem.at[:, pl.ds(0, rows)],
            ws_gmem.at[:, pl.ds(0, tm)],
        )
        # the ring and the output slices are shared by the CTA's warpgroups
        pl.run_scoped(
            scope,
            pipeline(lambda _: None).get_allocations(*(first * per_step)),
            plgpu.SMEM((2, tm, EPILOGUE_N), out_dtype, transforms=operand_transforms(EPILOGUE_N, out_dtype)),
            collective_axes="wg",
        )

    call = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(persistent_ctas(m_tiles * n_tiles, backend),),
        grid_names=("tile",),
        num_threads=3,
        thread_name="wg",
        interpret=backend.interpret_arg(),
    )
    return call(x, w, xs, ws)


def mma(a: Any, b: Any, shape: tuple[int, int]) -> jax.Array:
    """wgmma(a, b) into a fresh f32 accumulator, read back into registers (waits for it)."""

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def scales_per_column(w_scale: jax.Array, n: int) -> jax.Array:
    """w_scale [ceil(N/128), Kb] -> [Kb, n]: each 128x128 block's scale repeated over its
    columns, so that a tile's scales are one contiguous TMA copy."""
    return jnp.repeat(w_scale.T, SCALE_BLOCK, axis=1)[:, :n]


def tiled_call(
    x: jax.Array,
    x_scale: jax.Array,
    w: jax.Array,
    w_scale: jax.Array,
    *,
    out_dtype: Any,
    config: Config,
    backend: Backend,
    body: Any = _body,
) -> jax.Array:
    """The kernel on operands zero-padded to whole tiles, in the form ``config.consumers``
    names; ``body`` (the one-consumer form's) is swappable so that test variants reuse
    the tiling and the wrapper."""
    backend.require_available()
    if body is not _body and config.consumers != 1:
        raise ValueError(
            f"config.consumers must be 1 when a kernel body is passed (it replaces the one-consumer "
            f"form's), got {config.consumers!r}"
        )
    (m, _), n = x.shape, w.shape[0]
    tm, tn, pe, stages = config.tile_m, config.tile_n, config.promote_every, config.max_concurrent_steps
    tiling.require_shared_memory(config, smem_bytes(config, jnp.dtype(out_dtype).itemsize))
    x_p, xs_p, w_p, ws_p = fp8.pad_operands(x, x_scale, w, w_scale, config.cta_m, tn, config.spans * pe)
    (mp, kp), np_ = x_p.shape, w_p.shape[0]
    xs_t = xs_p.T
    if config.consumers == 2:
        # a tile lies in one w_scale block (tile_n divides 128): its value repeated
        # over a consumer's rows, so that the promotion's scale is one per row
        ws_rows = jnp.repeat(ws_p.T, tm, axis=1)
        return _warp_specialized_call(x_p, w_p, xs_t, ws_rows, out_dtype=out_dtype, config=config, backend=backend)[
            :m, :n
        ]
    ws_cols = scales_per_column(ws_p, np_)
    scratch = (
        plgpu.SMEM((stages, tm, pe), x.dtype, transforms=operand_transforms(pe, x.dtype)),
        plgpu.SMEM((stages, tn, pe), w.dtype, transforms=operand_transforms(pe, w.dtype)),
        plgpu.SMEM((stages, tm), jnp.float32),
        plgpu.SMEM((stages, tn), jnp.float32),
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),  # x, w and the two scale copies of a slot
        plgpu.SMEM((tm, tn), out_dtype, transforms=operand_transforms(tn, out_dtype)),
    )
    call = plgpu.kernel(
        functools.partial(body, steps=kp // pe),
        out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        scratch_types=scratch,
        grid=(mp // tm, np_ // tn),
        grid_names=("m", "n"),
        interpret=backend.interpret_arg(),
    )
    return call(x_p, w_p, xs_t, ws_cols)[:m, :n]
