"""Hopper (Mosaic GPU) block-scaled FP8 matmul (kernels/fp8_matmul.py states the op,
its layouts and its arithmetic).

One warpgroup per (tile_m, tile_n) output tile on a (M/tile_m, N/tile_n) grid. K is
walked in steps of ``promote_every`` elements through a ring of
``max_concurrent_steps`` SMEM slots; each slot holds the x tile [tile_m, step], the w
tile [tile_n, step] (K-major: FP8 wgmma takes no transposed operand, so w's SMEM tile
is read through a transposed view) and the step's scales: x_scale's column for these
rows and w_scale's value for these columns (the wrapper lays w_scale out per column,
[ceil(K/128), N], so that both are contiguous TMA copies). Per step:

- one wgmma of the slot's FP8 tiles into a fresh f32 accumulator, read back into
  registers (this waits for it: the tensor core's truncating sum spans this step
  only; that is the promotion);
- the slot is refilled with the step ``max_concurrent_steps`` ahead;
- ``acc += part * (x_scale_col * w_scale_row)`` in f32 registers.

The epilogue rounds ``acc`` once to ``out_dtype`` into SMEM and TMA-stores it.

Tiles: tile_m 64 or 128 (wgmma M), tile_n 64 or 128 (one w_scale block per tile),
promote_every 32, 64 or 128 (wgmma's FP8 K is 32; a step never straddles a scale
block; the byte width of a K-major FP8 row is the SMEM swizzle).
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
from pallascheck.kernels.mosaic_gpu_matmul import operand_transforms, store_tiles

SCALE_BLOCK = fp8.SCALE_BLOCK
WGMMA_FP8_K = 32  # K of one FP8 wgmma instruction


@dataclasses.dataclass(frozen=True)
class Config:
    tile_m: int = 128
    tile_n: int = 128
    promote_every: int = 128
    max_concurrent_steps: int = 4

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

    @property
    def block_k(self) -> int:
        """The K span of one wgmma accumulation (what the tolerance model calls it)."""
        return self.promote_every


def smem_bytes(config: Config, out_itemsize: int) -> int:
    """The ring's FP8 tiles and f32 scale vectors, and the output tile."""
    tm, tn = config.tile_m, config.tile_n
    ring = config.max_concurrent_steps * ((tm + tn) * config.promote_every + 4 * (tm + tn))
    return ring + tm * tn * out_itemsize


def configs(m: int, n: int, k: int, backend: str | Backend | None = None) -> list[Config]:
    be = get_backend(backend)
    if be.is_interpreted:  # every config costs a compile and an interpreted run
        return [Config(64, 64, 128, 2), Config(64, 128, 32, 2)]
    space = [Config(tm, tn, pe, s) for tm in (64, 128) for tn in (64, 128) for pe in (64, 128) for s in (3, 4, 5)]
    return [c for c in space if smem_bytes(c, 2) <= tiling.GPU_SHARED_MEMORY_BYTES]


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
    """The kernel on operands zero-padded to whole tiles; ``body`` is swappable so that
    test variants reuse the tiling and the wrapper."""
    backend.require_available()
    (m, _), n = x.shape, w.shape[0]
    tm, tn, pe, stages = config.tile_m, config.tile_n, config.promote_every, config.max_concurrent_steps
    tiling.require_shared_memory(config, smem_bytes(config, jnp.dtype(out_dtype).itemsize))
    x_p, xs_p, w_p, ws_p = fp8.pad_operands(x, x_scale, w, w_scale, tm, tn, pe)
    (mp, kp), np_ = x_p.shape, w_p.shape[0]
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
    return call(x_p, w_p, xs_p.T, scales_per_column(ws_p, np_))[:m, :n]
