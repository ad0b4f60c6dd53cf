"""Hopper (Mosaic GPU) grouped matmul for mixture-of-experts: TMA loads, wgmma, TMA store.

Semantics are kernels/ragged_dot.py's (those of ``jax.lax.ragged_dot``): lhs [m, k],
rhs [g, k, n], group i owns rows ``[offset_i, offset_i + group_sizes[i])``; rows past
``sum(group_sizes)`` are 0 (and get gradient 0). Negative sizes count as 0 and groups
are cut at row m, as there.

Forward, ``out = ragged_dot(lhs, rhs, group_sizes)``: one CTA (one warpgroup) per
(tile_m row tile, tile_n column tile). Group sizes are traced, so the row tile -> group
schedule is computed at run time, in the wrapper, by a few XLA ops, and passed to the
kernel as two small int32 GMEM arrays:
- ``groups`` [g, 3]: (group id, first row, end row) of the non-empty groups in row
  order, then the empty ones (never visited);
- ``tile_ranges`` [row tiles, 2]: the range ``[lo, hi)`` of ``groups`` entries whose
  rows meet the row tile (none for a tile past ``sum(group_sizes)``).
The CTA loops over its range (a loop over groups inside the kernel). For each group it
allocates a fresh f32 wgmma accumulator (exact zeros) and runs a ``plgpu.emit_pipeline``
over the K tiles:
``max_concurrent_steps`` SMEM slots filled by TMA (lhs row tile and that group's rhs
tile), one asynchronous wgmma per step, the slot released one step late (after
``wgmma_wait(1)`` has retired the wgmma that read it). A tile that straddles a group
boundary is thus computed once per group it touches, on all its rows; the rows of the
tile that belong to the group are then *selected* (``jnp.where`` on the row index) into
an f32 result tile that starts at exact zeros, so a row takes exactly one group's
accumulator and rows in no group stay 0. The result is rounded once to the input dtype
into SMEM and TMA-stored: one store per output tile, no two CTAs write the same tile.

Backward (wired in kernels/ragged_dot.py's custom_vjp):
- dlhs = ragged_dot(dout, rhs^T): the forward kernel with ``transpose_rhs=True``: the
  rhs tiles are loaded as [tile_n, tile_k] blocks of rhs[group] ([k, n]) and handed to
  wgmma transposed (no copy of rhs). Its reduction runs over n in steps of tile_k.
- drhs[i] = lhs_i^T @ dout_i: one CTA per (group, tile_m tile of k, tile_n tile of n)
  pipelines the ``tile_rows``-row tiles (aligned to multiples of tile_rows) that meet the
  group; the lhs tile is wgmma's A operand transposed. In the group's first and last
  tile the rows outside the group are overwritten with exact zeros in SMEM, in both
  operands, before the wgmma reads them (so Inf/NaN in a neighbour's rows cannot leak).
  Empty groups run no tile: exact zeros.

Arithmetic, for bf16/f16 inputs (the tolerance model's inputs):
- every product is exact in f32 (8/11-bit significands);
- forward and dlhs: per K tile the wgmma sums its ``tile_k`` products into the f32
  accumulator (on the GPU in chunks of 16, the tensor core's order; on the interpreter
  numpy's f32 matmul of the tile); the ``ceil(K / tile_k)`` tiles are added
  sequentially, tile 0 first, into an accumulator that starts at exact zeros for every
  group: a blocked sum with block ``tile_k`` (K = k for the forward, n for dlhs). Rows
  of other groups are selected away, never added. One rounding to the output dtype;
- drhs: the same with the reduction over the group's rows, block ``tile_rows``, the
  blocks aligned to absolute row multiples of tile_rows (the first and last block of a
  group hold fewer than tile_rows nonzero terms: exact zeros fill them); one rounding
  to rhs's dtype.

f32 inputs are refused with a TypeError (as kernels/mosaic_gpu_matmul.py does: wgmma's
tf32 mode needs K-major operands in SMEM and would change the arithmetic above); run f32
on the ``interpret`` or ``triton`` backends.

Unaligned shapes: the wrapper zero-pads lhs, rhs and dout to multiples of the tiles (a
no-op when aligned) and slices the results. Padding along every reduction (k in the
forward, n in dlhs, rows in drhs) is exact zeros; padded rows are in no group. TMA's
out-of-bounds fill is not relied on.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallascheck.kernels import mosaic_gpu_matmul, tiling
from pallascheck.kernels.backends import Backend, get_backend
from pallascheck.kernels.mosaic_gpu_matmul import (
    MAX_ACCUMULATOR_ELEMENTS,
    check_input_dtype,
    operand_transforms,
    pad_to,
    store_tiles,
)


@dataclasses.dataclass(frozen=True)
class Config(mosaic_gpu_matmul.Config):
    """Forward and dlhs: mosaic_gpu_matmul's tiles (tile_m x tile_n output tiles,
    tile_k the reduction step, one wgmma; max_concurrent_steps SMEM slots in every TMA
    pipeline). drhs: tile_m x tile_n tiles of the [k, n] gradient, tile_rows the step
    over the group's rows."""

    tile_rows: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.consumers != 1:
            raise ValueError(
                f"config.consumers must be 1 (the ragged dot runs one consumer warpgroup), got {self.consumers!r}"
            )
        # drhs masks its boundary tiles in registers, in wgmma's layout: 64-row multiples.
        if self.tile_rows not in (64, 128):
            raise ValueError(
                f"config.tile_rows must be 64 or 128 (drhs row tiles are masked in wgmma's "
                f"64-row register layout), got {self.tile_rows!r}"
            )

    @property
    def block_rows(self) -> int:
        """drhs's reduction block over rows (what the tolerance model calls it)."""
        return self.tile_rows


def smem_bytes(config: Config, itemsize: int) -> int:
    """Shared memory one CTA holds: the larger of the forward's and drhs's pipeline
    slots, plus the output tile (outputs have the input dtype)."""
    forward = config.tile_k * (config.tile_m + config.tile_n)
    drhs = config.tile_rows * (config.tile_m + config.tile_n)
    return (config.max_concurrent_steps * max(forward, drhs) + config.tile_m * config.tile_n) * itemsize


def configs(m: int, k: int, n: int, g: int, itemsize: int = 2, backend: str | Backend | None = None) -> list[Config]:
    """The autotuning space for lhs [m, k], rhs [g, k, n] of ``itemsize``-byte inputs.

    On the GPU, tile_m = 128 is offered only when the average group has >= 128 rows:
    every group boundary inside a row tile costs that tile one more K pass."""
    be = get_backend(backend)
    ms: tuple[int, ...]
    ns: tuple[int, ...]
    ks: tuple[int, ...]
    stages: tuple[int, ...]
    if be.is_interpreted:  # every config costs a compile and an interpreted run
        ms, ns, ks, rows, stages = (64,), (64, 128), (32, 64), (64,), (2,)
    else:
        ms = (64, 128) if m >= 128 * max(g, 1) else (64,)
        ns, ks, rows, stages = (64, 128, 256), (64,), (64,), (3, 4)
    space = []
    for tm, tn, tk, tr, s in itertools.product(
        tiling.blocks_for(m, ms), tiling.blocks_for(n, ns), tiling.blocks_for(k, ks), rows, stages
    ):
        if tm * tn > MAX_ACCUMULATOR_ELEMENTS or tn < tk:
            continue
        config = Config(tm, tn, tk, s, tile_rows=tr)
        if smem_bytes(config, itemsize) <= tiling.GPU_SHARED_MEMORY_BYTES:
            space.append(config)
    return space


def _wgmma_zeros(shape: tuple[int, int]) -> jax.Array:
    return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def _row_index(first_row: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """The absolute row of every element of a register tile whose row 0 is ``first_row``."""
    return first_row + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)


def _rows_in_group(rows: jax.Array, start: jax.Array, end: jax.Array) -> jax.Array:
    """Which rows the group [start, end) owns."""
    return (rows >= start) & (rows < end)


def _group_product(
    acc_ref,
    lhs_gmem,
    rhs_gmem,
    m_index,
    n_index,
    *,
    num_k_tiles: int,
    transpose_rhs: bool,
    stages: int,
    transforms: tuple[Any, ...],
) -> jax.Array:
    """lhs row tile ``m_index`` @ rhs (one group's [k, n], or [n, k] if ``transpose_rhs``)
    column tile ``n_index``, summed over all K tiles in the f32 accumulator."""
    tile_m, tile_n = acc_ref.shape
    tile_k = lhs_gmem.shape[1] // num_k_tiles

    def step(_, x_smem, w_smem):
        plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)) if transpose_rhs else w_smem)
        # The previous step's wgmma has retired: its slot (released one step late) may be refilled.
        plgpu.wgmma_wait(1)

    w_spec = (
        plgpu.BlockSpec((tile_n, tile_k), lambda kt: (n_index, kt), transforms=transforms, delay_release=1)
        if transpose_rhs
        else plgpu.BlockSpec((tile_k, tile_n), lambda kt: (kt, n_index), transforms=transforms, delay_release=1)
    )
    plgpu.emit_pipeline(
        step,
        grid=(num_k_tiles,),
        in_specs=[
            plgpu.BlockSpec((tile_m, tile_k), lambda kt: (m_index, kt), transforms=transforms, delay_release=1),
            w_spec,
        ],
        max_concurrent_steps=stages,
    )(lhs_gmem, rhs_gmem)
    return acc_ref[...]


def _for_each_group(
    lo: jax.Array, hi: jax.Array, group_step: Callable[..., jax.Array], shape: tuple[int, int]
) -> jax.Array:
    """``out = group_step(j, acc_ref, out)`` for j in [lo, hi), out starting at exact
    zeros; every group gets a fresh accumulator (allocated as exact zeros), so no
    group's sums reach the next one's. (A fresh allocation, not a store of zeros into
    one accumulator: the Mosaic GPU interpreter has no rule for accumulator stores.)"""

    def step(j, out):
        return pl.run_scoped(lambda acc_ref: group_step(j, acc_ref, out), plgpu.ACC(shape, jnp.float32))

    return lax.fori_loop(lo, hi, step, _wgmma_zeros(shape))


def _forward_kernel(
    tile_ranges_gmem,
    groups_gmem,
    lhs_gmem,
    rhs_gmem,
    out_gmem,
    out_smem,
    *,
    num_k_tiles: int,
    transpose_rhs: bool,
    stages: int,
    transforms: tuple[Any, ...],
    rows_in_group: Callable[..., jax.Array] = _rows_in_group,
    group_product: Callable[..., jax.Array] = _group_product,
    for_each_group: Callable[..., jax.Array] = _for_each_group,
) -> None:
    """One output tile: every group meeting the row tile, its rows selected.
    ``rows_in_group``, ``group_product`` and ``for_each_group`` are swappable (test variants)."""
    tile_m, tile_n = out_smem.shape
    m_index, n_index = lax.axis_index("m"), lax.axis_index("n")
    rows = _row_index(m_index * tile_m, (tile_m, tile_n))

    def group_step(j, acc_ref, out):
        group, start, end = groups_gmem[j, 0], groups_gmem[j, 1], groups_gmem[j, 2]
        acc = group_product(
            acc_ref,
            lhs_gmem,
            rhs_gmem.at[group],
            m_index,
            n_index,
            num_k_tiles=num_k_tiles,
            transpose_rhs=transpose_rhs,
            stages=stages,
            transforms=transforms,
        )
        return jnp.where(rows_in_group(rows, start, end), acc, out)

    out = for_each_group(tile_ranges_gmem[m_index, 0], tile_ranges_gmem[m_index, 1], group_step, (tile_m, tile_n))
    store_tiles((out_gmem,), (out_smem,), (out,), pl.ds(m_index * tile_m, tile_m), pl.ds(n_index * tile_n, tile_n))


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """starts, ends of each group (int32), negative sizes counted as 0, cut to [0, m]."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends


def forward_schedule(group_sizes: jax.Array, m: int, tile_m: int, num_row_tiles: int) -> tuple[jax.Array, jax.Array]:
    """(tile_ranges [num_row_tiles, 2], groups [g, 3]): see the module docstring."""
    starts, ends = group_bounds(group_sizes, m)
    nonempty = ends > starts
    # Non-empty groups first, each part in group order (a stable sort on a 0/1 key).
    order = jnp.argsort(jnp.where(nonempty, 0, 1), stable=True).astype(jnp.int32)
    groups = jnp.stack([order, starts[order], ends[order]], axis=1)
    # Non-empty groups are disjoint and sorted: those ending by the tile's first row
    # precede those meeting the tile, which precede those starting past its last row.
    tile_start = (jnp.arange(num_row_tiles, dtype=jnp.int32) * tile_m)[:, None]
    lo = jnp.sum(nonempty & (ends <= tile_start), axis=1, dtype=jnp.int32)
    hi = jnp.sum(nonempty & (starts < tile_start + tile_m), axis=1, dtype=jnp.int32)
    return jnp.stack([lo, hi], axis=1), groups


KernelBody = Callable[..., None]


def grouped_call(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_rhs: bool,
    config: Config,
    backend: Backend,
    body: KernelBody = _forward_kernel,
) -> jax.Array:
    """out[r] = lhs[r] @ rhs[group(r)] (rhs[g] is [n, k] and used transposed if
    ``transpose_rhs``), in lhs's dtype; rows in no group are 0. ``body`` is swappable
    so that test variants reuse the schedule, the padding and the launch."""
    backend.require_available()
    check_input_dtype(lhs.dtype)
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tn, tk = config.tile_m, config.tile_n, config.tile_k
    lhs_p = pad_to(lhs, (tm, tk))
    rhs_p = pad_to(rhs, (1, tn, tk) if transpose_rhs else (1, tk, tn))
    (mp, kp), np_ = lhs_p.shape, rhs_p.shape[1] if transpose_rhs else rhs_p.shape[2]
    tile_ranges, groups = forward_schedule(group_sizes, m, tm, mp // tm)
    call = plgpu.kernel(
        functools.partial(
            body,
            num_k_tiles=kp // tk,
            transpose_rhs=transpose_rhs,
            stages=config.max_concurrent_steps,
            transforms=operand_transforms(tk, lhs.dtype),
        ),
        out_type=jax.ShapeDtypeStruct((mp, np_), lhs.dtype),
        scratch_types=(plgpu.SMEM((tm, tn), lhs.dtype, transforms=operand_transforms(tn, lhs.dtype)),),
        grid=(mp // tm, np_ // tn),
        grid_names=("m", "n"),
        interpret=backend.interpret_arg(),
    )
    return call(tile_ranges, groups, lhs_p, rhs_p)[:m, :n]


def _zero_rows_outside(smem, first_row: jax.Array, start: jax.Array, end: jax.Array) -> None:
    """Overwrite the rows of an SMEM tile outside [start, end) with exact zeros."""
    value = smem[...]
    keep = _rows_in_group(_row_index(first_row, value.shape), start, end)
    smem[...] = jnp.where(keep, value, jnp.zeros_like(value))


def _drhs_kernel(
    bounds_gmem, lhs_gmem, dout_gmem, out_gmem, out_smem, *, tile_rows: int, stages: int, transforms: tuple[Any, ...]
) -> None:
    """One [tile_m, tile_n] tile of drhs[group] = sum over the group's rows of lhs^T dout."""
    tile_m, tile_n = out_smem.shape
    group, k_index, n_index = lax.axis_index("g"), lax.axis_index("k"), lax.axis_index("n")
    start, end = bounds_gmem[group, 0], bounds_gmem[group, 1]
    first_tile = start // tile_rows

    def accumulate(acc_ref):
        def step(indices, x_smem, dy_smem):
            first_row = (first_tile + indices[0]) * tile_rows

            @pl.when((first_row < start) | (first_row + tile_rows > end))
            def _mask():  # the group's first or last tile: other rows to exact zeros
                _zero_rows_outside(x_smem, first_row, start, end)
                _zero_rows_outside(dy_smem, first_row, start, end)
                plgpu.commit_smem()  # the wgmma (async proxy) must see the zeros

            plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), dy_smem)
            plgpu.wgmma_wait(1)  # as in the forward: releases the previous step's slot

        @pl.when(end > start)  # an empty group runs no tile: exact zeros
        def _run():
            plgpu.emit_pipeline(
                step,
                grid=(pl.cdiv(end, tile_rows) - first_tile,),
                in_specs=[
                    plgpu.BlockSpec(
                        (tile_rows, tile_m), lambda r: (first_tile + r, k_index), transforms=transforms, delay_release=1
                    ),
                    plgpu.BlockSpec(
                        (tile_rows, tile_n), lambda r: (first_tile + r, n_index), transforms=transforms, delay_release=1
                    ),
                ],
                max_concurrent_steps=stages,
            )(lhs_gmem, dout_gmem)

        return acc_ref[...]

    acc = pl.run_scoped(accumulate, plgpu.ACC((tile_m, tile_n), jnp.float32))
    store_tiles(
        (out_gmem.at[group],), (out_smem,), (acc,), pl.ds(k_index * tile_m, tile_m), pl.ds(n_index * tile_n, tile_n)
    )


def drhs_call(
    lhs: jax.Array,
    dout: jax.Array,
    group_sizes: jax.Array,
    *,
    out_dtype: Any,
    config: Config,
    backend: Backend,
    body: KernelBody = _drhs_kernel,
) -> jax.Array:
    """drhs[i] = lhs_i^T @ dout_i for each group i: [g, k, n] in ``out_dtype``."""
    backend.require_available()
    check_input_dtype(lhs.dtype)
    (m, k), n, num_groups = lhs.shape, dout.shape[1], group_sizes.shape[0]
    tm, tn, tr = config.tile_m, config.tile_n, config.tile_rows
    lhs_p, dout_p = pad_to(lhs, (tr, tm)), pad_to(dout, (tr, tn))
    kp, np_ = lhs_p.shape[1], dout_p.shape[1]
    starts, ends = group_bounds(group_sizes, m)
    call = plgpu.kernel(
        # wgmma needs one swizzle for both operands: the one of the narrower minor dimension.
        functools.partial(
            body,
            tile_rows=tr,
            stages=config.max_concurrent_steps,
            transforms=operand_transforms(min(tm, tn), lhs.dtype),
        ),
        out_type=jax.ShapeDtypeStruct((num_groups, kp, np_), out_dtype),
        scratch_types=(plgpu.SMEM((tm, tn), out_dtype, transforms=operand_transforms(tn, out_dtype)),),
        grid=(num_groups, kp // tm, np_ // tn),
        grid_names=("g", "k", "n"),
        interpret=backend.interpret_arg(),
    )
    return call(jnp.stack([starts, ends], axis=1), lhs_p, dout_p)[:, :k, :n]
