"""Deliberately broken Mosaic GPU ragged_dot forwards. Each copies one small function
of kernels/mosaic_gpu_ragged_dot.py's forward kernel with one line changed (marked
``BUG``) and swaps it into the real kernel (``_forward_kernel``'s keyword parts), run
through the real wrapper (``mosaic_gpu_ragged_dot.grouped_call``), so that only the bug
differs from the kernel under test. Forward only but the last, which breaks drhs;
bf16/f16 inputs. All give wrong values on the Mosaic GPU interpreter and the GPU alike,
when their trigger is present:

- ``group_boundary_off_by_one``: a group also claims the row before its first one, so
  the last row of the previous group takes this group's product. Needs a boundary
  between two non-empty groups inside a row tile (not at a tile_m multiple).
- ``last_k_tile_dropped``: the K pipeline stops one tile early. Needs K > tile_k
  (with one K tile the pipeline keeps it: an empty pipeline does not lower).
- ``accumulator_not_rezeroed``: one accumulator serves every group of a row tile, so a
  group's rows get the previous groups' products added. Needs two non-empty groups in
  one row tile.
- ``drhs_first_tile_unmasked``: drhs zeroes the rows of other groups in a group's last
  row tile only, so the previous group's rows in the first tile of a group that
  straddles a row tile boundary join its sum. Needs a group whose rows start inside
  one row tile and end in a later one (not reachable at fewer than 65 rows).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallascheck.kernels import mosaic_gpu_ragged_dot as mrd
from pallascheck.kernels.backends import MOSAIC_GPU, get_backend
from pallascheck.properties.families.ragged_dot import make_spec
from pallascheck.properties.spec import Case, KernelSpec


def _rows_in_group_off_by_one(rows, start, end):
    """``_rows_in_group`` with the group's first row one too early."""
    return (rows >= start - 1) & (rows < end)  # BUG: start - 1


def _group_product_short_k(
    acc_ref, lhs_gmem, rhs_gmem, m_index, n_index, *, num_k_tiles, transpose_rhs, stages, transforms
):
    """``_group_product`` whose pipeline stops before the last K tile."""
    tile_m, tile_n = acc_ref.shape
    tile_k = lhs_gmem.shape[1] // num_k_tiles

    def step(_, x_smem, w_smem):
        plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)) if transpose_rhs else w_smem)
        plgpu.wgmma_wait(1)

    w_spec = (
        plgpu.BlockSpec((tile_n, tile_k), lambda kt: (n_index, kt), transforms=transforms, delay_release=1)
        if transpose_rhs
        else plgpu.BlockSpec((tile_k, tile_n), lambda kt: (kt, n_index), transforms=transforms, delay_release=1)
    )
    plgpu.emit_pipeline(
        step,
        grid=(max(num_k_tiles - 1, 1),),  # BUG: the last K tile is never loaded
        in_specs=[
            plgpu.BlockSpec((tile_m, tile_k), lambda kt: (m_index, kt), transforms=transforms, delay_release=1),
            w_spec,
        ],
        max_concurrent_steps=stages,
    )(lhs_gmem, rhs_gmem)
    return acc_ref[...]


def _for_each_group_shared_accumulator(lo, hi, group_step, shape):
    """``_for_each_group`` with one accumulator for all the row tile's groups."""
    # BUG: allocated once outside the group loop, so it is never re-zeroed between groups.
    return pl.run_scoped(
        lambda acc_ref: lax.fori_loop(lo, hi, lambda j, out: group_step(j, acc_ref, out), mrd._wgmma_zeros(shape)),
        plgpu.ACC(shape, jnp.float32),
    )


def _drhs_kernel_first_tile_unmasked(
    bounds_gmem, lhs_gmem, dout_gmem, out_gmem, out_smem, *, tile_rows: int, stages: int, transforms: tuple[Any, ...]
) -> None:
    """``_drhs_kernel`` that masks the group's last row tile only."""
    tile_m, tile_n = out_smem.shape
    group, k_index, n_index = lax.axis_index("g"), lax.axis_index("k"), lax.axis_index("n")
    start, end = bounds_gmem[group, 0], bounds_gmem[group, 1]
    first_tile = start // tile_rows

    def accumulate(acc_ref):
        def step(indices, x_smem, dy_smem):
            first_row = (first_tile + indices[0]) * tile_rows

            @pl.when(first_row + tile_rows > end)  # BUG: (first_row < start) | dropped
            def _mask():
                mrd._zero_rows_outside(x_smem, first_row, start, end)
                mrd._zero_rows_outside(dy_smem, first_row, start, end)
                plgpu.commit_smem()

            plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), dy_smem)
            plgpu.wgmma_wait(1)

        @pl.when(end > start)
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
    mrd.store_tiles(
        (out_gmem.at[group],), (out_smem,), (acc,), pl.ds(k_index * tile_m, tile_m), pl.ds(n_index * tile_n, tile_n)
    )


def _with_drhs(drhs_body: Callable[..., None]) -> Callable[..., jax.Array]:
    """ragged_dot on the Mosaic GPU backends (kernels/ragged_dot.py's custom_vjp: the real
    forward and dlhs) with drhs computed by ``drhs_body``."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def core(lhs, rhs, group_sizes, config, backend):
        return mrd.grouped_call(lhs, rhs, group_sizes, transpose_rhs=False, config=config, backend=backend)

    def core_fwd(lhs, rhs, group_sizes, config, backend):
        return core(lhs, rhs, group_sizes, config, backend), (lhs, rhs, group_sizes)

    def core_bwd(config, backend, residuals, g):
        lhs, rhs, group_sizes = residuals
        g = g.astype(lhs.dtype)
        dlhs = mrd.grouped_call(g, rhs, group_sizes, transpose_rhs=True, config=config, backend=backend)
        drhs = mrd.drhs_call(lhs, g, group_sizes, out_dtype=rhs.dtype, config=config, backend=backend, body=drhs_body)
        return dlhs, drhs, None

    core.defvjp(core_fwd, core_bwd)

    def run(lhs, rhs, group_sizes, *, config=None, backend="mosaic_gpu_interpret"):
        return core(lhs, rhs, jnp.asarray(group_sizes, jnp.int32), config or mrd.Config(), get_backend(backend))

    return run


def _variant(**part: Any) -> Callable[..., jax.Array]:
    """A forward-only ragged_dot with ragged_dot.ragged_dot's signature and one part swapped."""

    def run(lhs, rhs, group_sizes, *, config=None, backend="mosaic_gpu_interpret"):
        return mrd.grouped_call(
            lhs,
            rhs,
            jnp.asarray(group_sizes, jnp.int32),
            transpose_rhs=False,
            config=config or mrd.Config(),
            backend=get_backend(backend),
            body=functools.partial(mrd._forward_kernel, **part),
        )

    return run


BACKENDS = MOSAIC_GPU
EXAMPLES = 12


def _row_owners(case: Case) -> np.ndarray:
    """The group of each row (-1: in no group)."""
    sizes = np.maximum(case.arrays["group_sizes"], 0)
    m = case.arrays["lhs"].shape[0]
    owners = np.repeat(np.arange(len(sizes)), sizes)[:m]
    return np.concatenate([owners, np.full(m - len(owners), -1)])


def _two_groups_share_a_tile(case: Case) -> bool:
    """Two non-empty groups own rows of one 64-row tile."""
    owners = _row_owners(case)
    return any(len(set(owners[i : i + 64]) - {-1}) >= 2 for i in range(0, len(owners), 64))


def _group_straddles_a_tile(case: Case) -> bool:
    """A group starts inside one 64-row tile (not at its first row) and ends in a later one."""
    sizes = np.maximum(case.arrays["group_sizes"], 0)
    ends = np.minimum(np.cumsum(sizes), case.arrays["lhs"].shape[0])
    starts = np.concatenate([[0], ends[:-1]])
    return bool(np.any((ends > starts) & (starts % 64 != 0) & (starts // 64 < (ends - 1) // 64)))


# A K loop of two tiles: K 64 with 32-wide K tiles (the GPU's own space has tile_k 64 only).
_TWO_K_TILES = mrd.Config(tile_m=64, tile_n=64, tile_k=32, max_concurrent_steps=2)


def _two_k_tiles(case: Case) -> bool:
    return case.arrays["lhs"].shape[1] > _TWO_K_TILES.tile_k


# name -> (kernel, the cases that carry its trigger, the configs that do; see the module docstring)
_BROKEN = {
    "group_boundary_off_by_one": (_variant(rows_in_group=_rows_in_group_off_by_one), _two_groups_share_a_tile, None),
    "last_k_tile_dropped": (_variant(group_product=_group_product_short_k), _two_k_tiles, [_TWO_K_TILES]),
    "accumulator_not_rezeroed": (
        _variant(for_each_group=_for_each_group_shared_accumulator),
        _two_groups_share_a_tile,
        None,
    ),
    "drhs_first_tile_unmasked": (_with_drhs(_drhs_kernel_first_tile_unmasked), _group_straddles_a_tile, None),
}


def _spec(name: str, fn: Callable[..., jax.Array], trigger: Callable[[Case], bool], configs: list | None) -> KernelSpec:
    base = make_spec(fn, name=f"mosaic_gpu_ragged_dot[{name}]", differentiable=name in _DIFFERENTIABLE)
    spec = dataclasses.replace(base, cases=lambda dtype, backend: base.cases(dtype, backend).filter(trigger))
    return spec if configs is None else dataclasses.replace(spec, configs=lambda case, backend: configs)


_DIFFERENTIABLE = {"drhs_first_tile_unmasked"}
VARIANTS = {name: (_spec(name, *parts), ("bfloat16",), EXAMPLES) for name, parts in _BROKEN.items()}
