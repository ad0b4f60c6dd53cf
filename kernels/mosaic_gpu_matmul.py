"""Hopper (Mosaic GPU) tiled matmul ``act(x @ y)``: TMA loads, wgmma, TMA store.

Two forms, chosen by ``Config.consumers``:

- ``consumers=2`` (warp-specialised and persistent, the fast one): one CTA per SM,
  each walking output tiles of tile_m x (2 tile_n) (``plgpu.nd_loop``) with three
  warpgroups. A memory warpgroup (40 registers) only issues the TMA copies of the K
  tiles into a ring of ``max_concurrent_steps`` SMEM slots
  (``plgpu.emit_pipeline_warp_specialized``), and starts the next tile's copies
  while the consumers finish this one; two consumer warpgroups each own a tile_m x
  tile_n f32 accumulator and issue one wgmma per K tile on their half of y's slot,
  releasing the slot when it retires (the other consumer's wgmma keeps the tensor
  core busy meanwhile; releasing one step late, as the one-consumer form does,
  races across tiles: the pipeline's next run refills a slot whose release it never
  waited for, which the Mosaic GPU interpreter's race detector reports). Tiles are
  visited in bands of ``BAND_M`` row tiles, column by column, so that CTAs running
  together share x and y tiles in L2. The epilogue stores each accumulator in
  ``epilogue_n``-column slices through a small SMEM buffer.
- ``consumers=1``: one CTA (one warpgroup) per (tile_m, tile_n) output tile, on a
  (M/tile_m, N/tile_n) grid. The K range is walked in steps of ``tile_k`` through a
  ring of ``max_concurrent_steps`` SMEM slots: TMA copies GMEM -> SMEM fill a slot
  and arrive on its barrier; the warpgroup waits on that barrier, issues an
  asynchronous wgmma into the f32 accumulator and, once the previous step's wgmma
  has retired (``wgmma_wait(1)``), refills that step's slot with the tile
  ``max_concurrent_steps`` ahead.

In both, the epilogue applies the activation in f32 to the accumulator, rounds once
to ``out_dtype`` into SMEM and TMA-stores the tile (and, for the backward pass, the
f32 pre-activation).

Arithmetic, for bf16/f16 inputs (the tolerance model's inputs), the same in both forms
(each output element is one consumer's accumulator):
- every product ``x[i, k] * y[k, j]`` is exact in f32 (8/11-bit significands);
- per K tile, the wgmma sums its ``tile_k`` products into the f32 accumulator; the
  order inside one wgmma is the tensor core's (not IEEE sequential; on the
  interpreter it is numpy's f32 matmul of the tile);
- the ``ceil(K / tile_k)`` tiles are added sequentially, tile 0 first, into that
  one f32 accumulator (it starts at exact zeros): a blocked sum with block
  ``tile_k``;
- the activation is evaluated in f32 on the accumulator and the result is rounded
  once to ``out_dtype``; the pre-activation residual is the f32 accumulator itself.
  On the GPU ``sigmoid``/``silu`` are lowered as ``1 / (1 + exp(-z))`` and ``tanh``
  is the math library's f32 one (no approximate math). Exact ``gelu`` is not
  offered (see :func:`supported_activations`); use ``gelu_tanh``.

f32 inputs are refused with a TypeError: wgmma's tf32 mode needs both operands
K-major in SMEM, y [K, N] is N-major, and tf32 would change the arithmetic above;
run f32 on the ``interpret`` or ``triton`` backends.

Unaligned shapes: the wrapper pads x and y with zeros to multiples of the tiles
(only when needed) and slices the result. Padding along K is exact zeros, so it adds
exact zeros to every sum; padded rows and columns are dropped. (TMA's own
out-of-bounds zero fill is not relied on.)

Gradients: :func:`pallascheck.kernels.matmul.matmul` wraps this kernel in its
``custom_vjp`` (the backward runs this kernel on ``dz @ y.T`` and ``x.T @ dz``);
the functions here are forward only. Batched products: ``jax.vmap`` works, as for
every ``plgpu.kernel``.
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

from pallascheck.kernels import tiling, validation
from pallascheck.kernels.activations import ACTIVATIONS, get_activation
from pallascheck.kernels.backends import Backend, get_backend

# wgmma's M is 64 per instruction and one warpgroup holds the accumulator in
# registers: 128 x 128 f32 is 128 registers per thread, the most we allow.
MAX_ACCUMULATOR_ELEMENTS = 128 * 128
# Warp-specialised form: output columns per epilogue store (a 128-byte swizzled bf16
# row; half as many when the f32 pre-activation is stored too, so that both slices
# and a 3-stage 128 x 256 ring fit in SMEM), and row tiles per band of the CTA order
# (CTAs of one band share y tiles in L2).
EPILOGUE_N = 64
BAND_M = 8
INPUT_DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class Config:
    """tile_m x tile_n output tile per consumer warpgroup, tile_k the K step (one
    wgmma), max_concurrent_steps SMEM slots in the TMA pipeline, and ``consumers``
    warpgroups per CTA (2: warp-specialised, a CTA tile of tile_m x 2 tile_n)."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 3
    consumers: int = 1

    def __post_init__(self) -> None:
        if self.tile_m not in (64, 128):
            raise ValueError(f"config.tile_m must be 64 or 128 (wgmma M is 64 per instruction), got {self.tile_m!r}")
        validation.require_positive_power_of_two("config.tile_n", self.tile_n, 32)
        if self.tile_n > 256:
            raise ValueError(f"config.tile_n must be <= 256 (wgmma N), got {self.tile_n}")
        # tile_k * 2 bytes is the SMEM swizzle (32, 64 or 128 bytes).
        validation.require_positive_power_of_two("config.tile_k", self.tile_k, 16)
        if self.tile_k > 64:
            raise ValueError(f"config.tile_k must be <= 64 (a 128-byte swizzle of 2-byte inputs), got {self.tile_k}")
        if self.tile_n < self.tile_k:
            raise ValueError(
                f"config.tile_n must be >= config.tile_k (y's SMEM tile is swizzled in rows of tile_k), "
                f"got tile_n={self.tile_n}, tile_k={self.tile_k}"
            )
        if self.tile_m * self.tile_n > MAX_ACCUMULATOR_ELEMENTS:
            raise ValueError(
                f"config.tile_m * config.tile_n must be <= {MAX_ACCUMULATOR_ELEMENTS} (the f32 accumulator "
                f"lives in one warpgroup's registers), got {self.tile_m} * {self.tile_n}"
            )
        if not isinstance(self.max_concurrent_steps, int) or not 2 <= self.max_concurrent_steps <= 8:
            raise ValueError(
                f"config.max_concurrent_steps must be an int in [2, 8] (pipeline stages), "
                f"got {self.max_concurrent_steps!r}"
            )
        if self.consumers not in (1, 2):
            raise ValueError(f"config.consumers must be 1 or 2 (consumer warpgroups per CTA), got {self.consumers!r}")
        if self.consumers == 2 and self.tile_n % EPILOGUE_N:
            raise ValueError(
                f"config.tile_n must be a multiple of {EPILOGUE_N} with consumers=2 (the epilogue "
                f"stores {EPILOGUE_N}-column slices), got {self.tile_n}"
            )

    @property
    def block_k(self) -> int:
        """The K block of the accumulation order (what the tolerance model calls it)."""
        return self.tile_k


def smem_bytes(config: Config, itemsize: int, out_itemsize: int, save_preactivation: bool) -> int:
    """Shared memory one CTA holds: the pipeline's x and y slots plus the output tile(s)
    (with two consumers: each consumer's EPILOGUE_N-column output slice)."""
    c = config.consumers
    pipeline = config.max_concurrent_steps * (config.tile_m + c * config.tile_n) * config.tile_k * itemsize
    out_n = config.tile_n if c == 1 else c * epilogue_n(save_preactivation)
    out = config.tile_m * out_n * (out_itemsize + (4 if save_preactivation else 0))
    return pipeline + out


def epilogue_n(save_preactivation: bool) -> int:
    """Columns per epilogue slice of the warp-specialised form."""
    return EPILOGUE_N // 2 if save_preactivation else EPILOGUE_N


def configs(
    m: int,
    n: int,
    k: int,
    itemsize: int = 2,
    backend: str | Backend | None = None,
    out_itemsize: int | None = None,
) -> list[Config]:
    """The autotuning space for an (m, k) @ (k, n) product of ``itemsize``-byte inputs
    and ``out_itemsize``-byte outputs (default: the inputs'); configs whose SMEM (with
    an f32 pre-activation tile) does not fit are left out."""
    be = get_backend(backend)
    ms: tuple[int, ...]
    ns: tuple[int, ...]
    ks: tuple[int, ...]
    stages: tuple[int, ...]
    if be.is_interpreted:  # every config costs a compile and an interpreted run
        ms, ns, ks, stages = (64,), (64, 128), (32, 64), (2,)
        # the warp-specialised form once per K step, at its smallest tiles
        specialised = [(64, 64, tk, 2) for tk in tiling.blocks_for(k, ks)]
    else:
        ms, ns, ks, stages = (64, 128), (64, 128, 256), (64,), (3, 4)
        specialised = [(128, 128, 64, 3), (128, 64, 64, 4), (128, 64, 64, 5), (64, 128, 64, 4), (64, 128, 64, 5)]
    candidates = [
        Config(tm, tn, tk, s)
        for tm, tn, tk, s in itertools.product(
            tiling.blocks_for(m, ms), tiling.blocks_for(n, ns), tiling.blocks_for(k, ks), stages
        )
        if tm * tn <= MAX_ACCUMULATOR_ELEMENTS and tn >= tk
    ]
    candidates += [Config(tm, tn, tk, s, consumers=2) for tm, tn, tk, s in specialised if tn >= tk]
    out_itemsize = itemsize if out_itemsize is None else out_itemsize
    return [c for c in candidates if smem_bytes(c, itemsize, out_itemsize, True) <= tiling.GPU_SHARED_MEMORY_BYTES]


def supported_activations() -> tuple[str, ...]:
    """The activations that compile on Mosaic GPU: all but exact ``gelu``, whose
    ``erf`` has no layout-inference rule in jax 0.11.2's Mosaic GPU lowering
    ("No layout inference rule defined for math.erf", seen on an H200). The
    interpreter would run it, but it offers what the hardware compiles."""
    return tuple(sorted(a for a in ACTIVATIONS if a != "gelu"))


def check_input_dtype(dtype: Any) -> None:
    if jnp.dtype(dtype) not in tuple(jnp.dtype(d) for d in INPUT_DTYPES):
        raise TypeError(
            f"the Mosaic GPU kernels take bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}: "
            f"f32 would need wgmma's tf32 mode with K-major operands; use the interpret or triton backend for f32"
        )


def operand_transforms(minor: int, dtype: Any) -> tuple[Any, ...]:
    """The (8, swizzle) tiling and swizzle that wgmma and TMA need for an SMEM tile
    whose minor dimension holds ``minor`` elements of ``dtype``."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))  # type: ignore[abstract]  # concrete; jax's Transform Protocol stubs transform_array


def k_ring(
    num_k_tiles: int, stages: int, loaded: Any, load: Callable[[Any, Any], None], issue: Callable[[Any], int]
) -> None:
    """The K loop over a ring of ``stages`` SMEM slots: ``load(step, slot)`` starts the
    TMA copies of K tile ``step`` into ``slot`` (arriving on ``loaded.at[slot]``);
    ``issue(slot)`` starts this step's wgmmas and returns how many it started. Once
    only those may still run, step-1's have retired and its slot takes the tile
    ``stages`` ahead of it. Returns with every wgmma done."""
    for step in range(min(stages, num_k_tiles)):
        load(step, step)

    @pl.loop(0, num_k_tiles)
    def _step(step):
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(loaded.at[slot])
        plgpu.wgmma_wait(issue(slot))
        refill = step - 1 + stages

        @pl.when((step >= 1) & (refill < num_k_tiles))
        def _refill():
            load(refill, lax.rem(refill, stages))

    plgpu.wgmma_wait(0)


def _matmul_body(x_gmem, y_gmem, *refs, num_k_tiles: int, activation: str):
    """One output tile. ``refs`` = output GMEM refs, x/y SMEM rings, their
    barriers, output SMEM tiles (one per output)."""
    n_out = (len(refs) - 3) // 2
    out_gmems, (x_smem, y_smem, loaded), out_smems = refs[:n_out], refs[n_out : n_out + 3], refs[n_out + 3 :]
    _, tile_m, _ = x_smem.shape
    tile_n = y_smem.shape[2]
    m_slice = pl.ds(lax.axis_index("m") * tile_m, tile_m)
    n_slice = pl.ds(lax.axis_index("n") * tile_n, tile_n)
    acc = tile_product(x_gmem, y_gmem, x_smem, y_smem, loaded, m_slice, n_slice, num_k_tiles)
    store_tiles(out_gmems, out_smems, (get_activation(activation)(acc), acc), m_slice, n_slice)


def tile_product(x_gmem, y_gmem, x_smem, y_smem, loaded, m_slice, n_slice, num_k_tiles: int) -> Any:
    """The f32 tile ``x_gmem[m_slice, :] @ y_gmem[:, n_slice]`` over ``num_k_tiles`` K
    tiles through the SMEM rings ``x_smem``/``y_smem`` (one wgmma a K tile, into an
    accumulator allocated as exact zeros), not rounded."""
    stages, tile_m, tile_k = x_smem.shape
    tile_n = y_smem.shape[2]

    def load(step, slot):  # TMA copies of K tile `step` into ring slot `slot`
        k_slice = pl.ds(step * tile_k, tile_k)
        plgpu.copy_gmem_to_smem(x_gmem.at[m_slice, k_slice], x_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(y_gmem.at[k_slice, n_slice], y_smem.at[slot], loaded.at[slot])

    def k_loop(acc_ref):
        def issue(slot):
            plgpu.wgmma(acc_ref, x_smem.at[slot], y_smem.at[slot])
            return 1

        k_ring(num_k_tiles, stages, loaded, load, issue)
        return acc_ref[...]

    return pl.run_scoped(k_loop, plgpu.ACC((tile_m, tile_n), jnp.float32))


def store_tiles(out_gmems, out_smems, values, m_slice, n_slice) -> None:
    """Round each value once to its output dtype in SMEM, then TMA-store it."""
    for smem, value in zip(out_smems, values):
        smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    for gmem, smem in zip(out_gmems, out_smems):
        plgpu.copy_smem_to_gmem(smem, gmem.at[m_slice, n_slice])
    # The SMEM tiles must stay alive until the TMA engine has read them.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def store_slices(blocks: Any, out_smems: Any, values: Any, wg: Any) -> None:
    """One consumer's epilogue in the warp-specialised forms: each value rounded once
    to its output dtype into this consumer's slot ``smem[wg]`` of a small SMEM buffer,
    slice by slice of its columns, and TMA-stored into ``block`` (this consumer's
    output tile in GMEM). The buffer is reused as soon as TMA has read the last slice."""
    epi = out_smems[0].shape[-1]
    for c in range(values[0].shape[1] // epi):
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last slice is read out
        for smem, value in zip(out_smems, values):
            smem[wg] = value[:, c * epi : (c + 1) * epi].astype(smem.dtype)
        plgpu.commit_smem()
        for block, smem in zip(blocks, out_smems):
            plgpu.copy_smem_to_gmem(smem.at[wg], block.at[:, pl.ds(c * epi, epi)])


def band_order(pid: Any, m_tiles: int, n_tiles: int) -> tuple[Any, Any]:
    """CTA ``pid`` -> its (row tile, column tile): bands of BAND_M row tiles (the last
    band may be shorter), each walked column by column."""
    band_m = min(BAND_M, m_tiles)
    first = (pid // (band_m * n_tiles)) * band_m
    rows = jnp.minimum(m_tiles - first, band_m)
    within = pid % (band_m * n_tiles)
    return first + within % rows, within // rows


def persistent_ctas(num_tiles: int, backend: Backend) -> int:
    """CTAs of the warp-specialised form: one per SM on the GPU (each walks several
    output tiles); in the interpreter 2, so that each CTA's tile loop also runs more
    than once there."""
    if backend.is_interpreted:
        return min(num_tiles, 2)
    return min(num_tiles, jax.devices()[0].core_count)


def _warp_specialized_call(
    x: jax.Array, y: jax.Array, *, out_dtypes: list[Any], activation: str, config: Config, backend: Backend
) -> tuple[jax.Array, ...]:
    """``consumers=2`` (module docstring) on operands padded to the CTA tiles."""
    tm, tn, tk, stages = config.tile_m, config.tile_n, config.tile_k, config.max_concurrent_steps
    (m, k), n = x.shape, y.shape[1]
    m_tiles, n_tiles = m // tm, n // (2 * tn)
    epi = epilogue_n(len(out_dtypes) == 2)
    ctas = persistent_ctas(m_tiles * n_tiles, backend)

    def body(x_gmem, y_gmem, *out_gmems):
        wg = lax.axis_index("wg")
        my_cols = pl.ds(wg * tn, tn)  # this consumer's half of a CTA tile

        def step(_, x_smem, y_smem, acc_ref):
            plgpu.wgmma(acc_ref, x_smem, y_smem.at[:, my_cols])
            plgpu.wgmma_wait(0)  # the slot is released on return
            return acc_ref

        def pipeline(consume: Callable[..., None]) -> Any:
            return plgpu.emit_pipeline_warp_specialized(
                step,
                grid=(k // tk,),
                memory_registers=tiling.MEMORY_WARPGROUP_REGISTERS,
                in_specs=[
                    plgpu.BlockSpec((tm, tk), lambda kk: (0, kk), transforms=operand_transforms(tk, x.dtype)),
                    plgpu.BlockSpec((tk, 2 * tn), lambda kk: (kk, 0), transforms=operand_transforms(tk, y.dtype)),
                ],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=stages,
                compute_context=consume,
            )

        def scope(allocations, *out_smems):
            # Persistent: each CTA walks output tiles ctas apart. The memory warpgroup
            # starts the next tile's loads while the consumers run this one's epilogue.
            @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="tile")
            def _tile(info):
                m_idx, n_idx = band_order(info.index[0], m_tiles, n_tiles)
                m_slice, cta_cols = pl.ds(m_idx * tm, tm), pl.ds(n_idx * 2 * tn, 2 * tn)

                def consume(run_pipeline):
                    def with_accumulator(acc_ref):  # allocated as exact zeros
                        run_pipeline(acc_ref)
                        plgpu.wgmma_wait(0)
                        acc = acc_ref[...]
                        values = (get_activation(activation)(acc), acc)
                        blocks = tuple(gmem.at[m_slice, cta_cols].at[:, my_cols] for gmem in out_gmems)
                        store_slices(blocks, out_smems, values, wg)

                    pl.run_scoped(with_accumulator, plgpu.ACC((tm, tn), jnp.float32))

                pipeline(consume)(x_gmem.at[m_slice, :], y_gmem.at[:, cta_cols], allocations=allocations)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's slices are read out

        x_rows, y_cols = x_gmem.at[pl.ds(0, tm), :], y_gmem.at[:, pl.ds(0, 2 * tn)]
        # the ring and the output slices are shared by the CTA's warpgroups
        pl.run_scoped(
            scope,
            pipeline(lambda _: None).get_allocations(x_rows, y_cols),
            *(plgpu.SMEM((2, tm, epi), dt, transforms=operand_transforms(epi, dt)) for dt in out_dtypes),
            collective_axes="wg",
        )

    call = plgpu.kernel(
        body,
        out_type=tuple(jax.ShapeDtypeStruct((m, n), dt) for dt in out_dtypes),
        grid=(ctas,),
        grid_names=("tile",),
        num_threads=3,
        thread_name="wg",
        interpret=backend.interpret_arg(),
    )
    return call(x, y)


def pad_to(a: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
    """Zero-pad each dimension up to a multiple (a no-op when already aligned)."""
    pads = [(0, -size % mult) for size, mult in zip(a.shape, multiples)]
    return jnp.pad(a, pads) if any(p for _, p in pads) else a


KernelBody = Callable[..., None]


def tiled_call(
    x: jax.Array,
    y: jax.Array,
    *,
    out_dtype: Any,
    activation: str,
    save_preactivation: bool,
    config: Config,
    backend: Backend,
    body: KernelBody = _matmul_body,
) -> Any:
    """The matmul on operands zero-padded to whole tiles, in the form ``config.consumers``
    names; ``body`` (the one-consumer form's) is swappable so that test variants reuse
    the tiling and the wrapper."""
    backend.require_available()
    check_input_dtype(x.dtype)
    m, n = x.shape[0], y.shape[1]
    tm, tn, tk = config.tile_m, config.consumers * config.tile_n, config.tile_k
    x_p, y_p = pad_to(x, (tm, tk)), pad_to(y, (tk, tn))
    out_dtypes = [jnp.dtype(out_dtype)] + ([jnp.dtype(jnp.float32)] if save_preactivation else [])
    tiling.require_shared_memory(
        config, smem_bytes(config, x.dtype.itemsize, out_dtypes[0].itemsize, save_preactivation)
    )
    if config.consumers == 2:
        padded = _warp_specialized_call(
            x_p, y_p, out_dtypes=out_dtypes, activation=activation, config=config, backend=backend
        )
    else:
        padded = _one_consumer_call(
            x_p, y_p, out_dtypes=out_dtypes, activation=activation, config=config, backend=backend, body=body
        )
    outs = tuple(o[:m, :n] for o in padded)
    return outs if save_preactivation else outs[0]


def _one_consumer_call(
    x: jax.Array,
    y: jax.Array,
    *,
    out_dtypes: list[Any],
    activation: str,
    config: Config,
    backend: Backend,
    body: KernelBody,
) -> tuple[jax.Array, ...]:
    """``consumers=1`` (module docstring) on operands padded to the tiles: ``body``
    over the (M/tile_m, N/tile_n) grid."""
    tm, tn, tk, stages = config.tile_m, config.tile_n, config.tile_k, config.max_concurrent_steps
    (mp, kp), np_ = x.shape, y.shape[1]
    scratch: tuple[Any, ...] = (
        plgpu.SMEM((stages, tm, tk), x.dtype, transforms=operand_transforms(tk, x.dtype)),
        plgpu.SMEM((stages, tk, tn), y.dtype, transforms=operand_transforms(tk, y.dtype)),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # the x and the y copy of a slot
        *(plgpu.SMEM((tm, tn), dt, transforms=operand_transforms(tn, dt)) for dt in out_dtypes),
    )
    call = plgpu.kernel(
        functools.partial(body, num_k_tiles=kp // tk, activation=activation),
        out_type=tuple(jax.ShapeDtypeStruct((mp, np_), dt) for dt in out_dtypes),
        scratch_types=scratch,
        grid=(mp // tm, np_ // tn),
        grid_names=("m", "n"),
        interpret=backend.interpret_arg(),
    )
    return call(x, y)
