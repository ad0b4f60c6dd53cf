"""Grouped (ragged) matmul for mixture-of-experts: ``ragged_dot(lhs, rhs, group_sizes)``.

Semantics (those of ``jax.lax.ragged_dot``): lhs is [m, k], rhs is [g, k, n] and
group_sizes is [g] integers. Rows are assigned to groups in order: group i owns rows
``[offset_i, offset_i + group_sizes[i])`` with ``offset_i = sum(group_sizes[:i])``,
and ``out[r] = lhs[r] @ rhs[i]`` for its owner i. Groups may be empty. Rows past
``sum(group_sizes)`` belong to no group: they are 0 in the output and get gradient 0.
The output has the input dtype (as ``lax.ragged_dot``); products accumulate in f32
and are rounded once.

Design: one program per (block_m row tile, block_n column tile), as in a tiled
matmul. Group offsets live in two small int32 vectors (starts, ends), padded to a
power of two and loaded whole by every program. A program counts, with vector
reductions, the first and last group that intersects its row tile and loops over
them; for each it runs the K loop with ``lhs`` rows outside the group masked to
exact zeros, adding into one f32 accumulator. A row therefore receives one group's
products, blocked over K exactly as in kernels/matmul.py; the other groups add exact
zeros. Work is (row tiles + groups - 1) tile passes at most, as in megablox's
tile/group schedule, but without scalar prefetch or data-dependent index maps, so
the same kernel lowers on Triton (no scalar memory, no dynamic grids).

Boundaries need not align with the tile: masks are per row. Traced group_sizes
cannot be checked: negative sizes count as 0 and groups past row m are cut at m
(concrete group_sizes with a negative entry or ``sum > m`` raise ValueError).

Gradients (custom_vjp):
- dlhs = ragged_dot(dout, rhs^T): the same kernel, reading rhs as [g, n, k] through
  a transposed dot (no copy of rhs);
- drhs[i] = lhs_i^T @ dout_i: one program per (group, block_m tile of k, block_n
  tile of n) loops over the block_k-row tiles (aligned to multiples of block_k) that
  intersect the group, masking rows outside it. Empty groups get exact zeros.

On the ``mosaic_gpu`` and ``mosaic_gpu_interpret`` backends the forward and both
backward products run the Hopper kernels of kernels/mosaic_gpu_ragged_dot.py instead
(TMA pipelines, wgmma; bf16/f16 inputs only; its docstring states their schedule,
arithmetic and edge handling). Their tiles are a ``mosaic_gpu_ragged_dot.Config``,
passed as ``config=`` and listed by ``configs(..., backend=...)``; this module's
``Config`` stays the one of the Pallas-generic kernels above.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels import (
    block_io,
    compat,
    matmul,
    mosaic_gpu_matmul,
    mosaic_gpu_ragged_dot,
    validation,
)
from pallascheck.kernels.backends import Backend, get_backend, resolve_config


@dataclasses.dataclass(frozen=True)
class Config(matmul.Config):
    """Tiles of every product (forward, dlhs, drhs): block_m x block_n output tiles,
    block_k the reduction step (K in the forward, n in dlhs, rows in drhs)."""

    @property
    def block_rows(self) -> int:
        """drhs's reduction block over rows: block_k here."""
        return self.block_k


def configs(
    m: int, n: int, k: int, backend: str | Backend | None = None, itemsize: int = 4, groups: int = 1
) -> list[Config] | list[mosaic_gpu_ragged_dot.Config]:
    """The autotuning space: kernels/matmul.py's, for the [m, k] @ [k, n] shape
    (``mosaic_gpu_ragged_dot.Config``s for ``groups`` groups on the Mosaic GPU backends)."""
    be = get_backend(backend)
    if be.is_mosaic_gpu:
        return mosaic_gpu_ragged_dot.configs(m, k, n, groups, itemsize, be)
    return [Config(**dataclasses.asdict(c)) for c in matmul.configs(m, n, k, backend, itemsize)]


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def group_offsets(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """starts, ends of each group (int32, cut to [0, m]), padded to a power of two
    with empty groups at m (the kernels ignore entries past the group count)."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    pad = _power_of_two_at_least(sizes.shape[0]) - sizes.shape[0]
    return (jnp.pad(starts, (0, pad), constant_values=m), jnp.pad(ends, (0, pad), constant_values=m))


def _scalar_at(vector: jax.Array, index: jax.Array) -> jax.Array:
    """vector[index] as a masked reduction (lowers everywhere, no scalar memory)."""
    positions = lax.broadcasted_iota(jnp.int32, vector.shape, 0)
    return jnp.sum(jnp.where(positions == index, vector, 0))


def _forward_kernel(
    starts_ref,
    ends_ref,
    lhs_ref,
    rhs_ref,
    out_ref,
    *,
    m_size: int,
    n_size: int,
    k_size: int,
    block_k: int,
    num_groups: int,
    transpose_rhs: bool,
    masked_io: bool,
):
    block_m, block_n = out_ref.shape
    num_k_tiles = lhs_ref.shape[1] // block_k
    first_row = pl.program_id(0) * block_m
    rows = first_row + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    cols = pl.program_id(1) * block_n + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    row_ok, col_ok = rows < m_size, cols < n_size
    starts, ends = starts_ref[...], ends_ref[...]
    real = lax.broadcasted_iota(jnp.int32, starts.shape, 0) < num_groups
    # Offsets are sorted, so the groups meeting [first_row, first_row + block_m) are
    # those after every group that ends by first_row and before any starting past it.
    first_group = jnp.sum(jnp.where(real & (ends <= first_row), 1, 0))
    last_group = jnp.sum(jnp.where(real & (starts < first_row + block_m), 1, 0))

    def group_step(group, acc):
        in_group = row_ok & (rows >= _scalar_at(starts, group)) & (rows < _scalar_at(ends, group))

        def k_step(i, acc):
            start = pl.multiple_of(i * block_k, block_k)
            kx = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
            x = block_io.load(lhs_ref.at[:, pl.ds(start, block_k)], in_group & (kx < k_size), masked_io=masked_io)
            # One indexer per access: Triton's lowering rejects chained .at[...].at[...].
            if transpose_rhs:  # rhs[group] is [n, k]: out[:, j] = x @ rhs[group, j, :]
                kw = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
                w = block_io.load(
                    rhs_ref.at[group, :, pl.ds(start, block_k)], col_ok.T & (kw < k_size), masked_io=masked_io
                )
                part = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            else:
                kw = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
                w = block_io.load(
                    rhs_ref.at[group, pl.ds(start, block_k), :], (kw < k_size) & col_ok, masked_io=masked_io
                )
                part = jnp.dot(x, w, preferred_element_type=jnp.float32)
            return acc + part

        return lax.fori_loop(0, num_k_tiles, k_step, acc)

    acc = lax.fori_loop(first_group, last_group, group_step, jnp.zeros((block_m, block_n), jnp.float32))
    block_io.store(out_ref, acc, row_ok & col_ok, masked_io=masked_io)


def _drhs_kernel(
    starts_ref,
    ends_ref,
    lhs_ref,
    dout_ref,
    out_ref,
    *,
    k_size: int,
    n_size: int,
    block_k: int,
    masked_io: bool,
):
    block_m, block_n = out_ref.shape
    group = pl.program_id(0)
    ks = pl.program_id(1) * block_m + lax.broadcasted_iota(jnp.int32, (1, block_m), 1)
    ns = pl.program_id(2) * block_n + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    start, end = _scalar_at(starts_ref[...], group), _scalar_at(ends_ref[...], group)

    def row_step(t, acc):
        first = pl.multiple_of(t * block_k, block_k)
        rows = first + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        in_group = (rows >= start) & (rows < end)  # end <= m: never past the array
        x = block_io.load(lhs_ref.at[pl.ds(first, block_k), :], in_group & (ks < k_size), masked_io=masked_io)
        dy = block_io.load(dout_ref.at[pl.ds(first, block_k), :], in_group & (ns < n_size), masked_io=masked_io)
        return acc + lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    # Row tiles aligned to block_k that meet [start, end); none for an empty group at
    # a tile boundary, one fully masked tile for an empty group inside a tile.
    acc = lax.fori_loop(
        start // block_k, (end + block_k - 1) // block_k, row_step, jnp.zeros((block_m, block_n), jnp.float32)
    )
    block_io.store(out_ref, acc, (ks.T < k_size) & (ns < n_size), masked_io=masked_io)


def grouped_call(
    lhs: jax.Array,
    rhs: jax.Array,
    starts: jax.Array,
    ends: jax.Array,
    *,
    transpose_rhs: bool,
    config: Config,
    backend: Backend,
    body: Any = _forward_kernel,
) -> jax.Array:
    """out[r] = lhs[r] @ rhs[group(r)] (rhs[g] transposed if ``transpose_rhs``), in
    lhs's dtype; ``body`` is swappable so test variants reuse the tiling."""
    (m, k), num_groups = lhs.shape, rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    k_padded = pl.cdiv(k, bk) * bk
    rhs_block = (num_groups, bn, k_padded) if transpose_rhs else (num_groups, k_padded, bn)
    rhs_index = (lambda i, j: (0, j, 0)) if transpose_rhs else (lambda i, j: (0, 0, j))
    call = backend.pallas_call(
        functools.partial(
            body,
            m_size=m,
            n_size=n,
            k_size=k,
            block_k=bk,
            num_groups=num_groups,
            transpose_rhs=transpose_rhs,
            masked_io=backend.is_triton,
        ),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
        in_specs=[
            pl.BlockSpec(starts.shape, lambda i, j: (0,)),
            pl.BlockSpec(ends.shape, lambda i, j: (0,)),
            pl.BlockSpec((bm, k_padded), lambda i, j: (i, 0)),
            pl.BlockSpec(rhs_block, rhs_index),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        dimension_semantics=("parallel", "parallel"),
        name="pallascheck_ragged_dot",
    )
    return call(starts, ends, lhs, rhs)


def drhs_call(
    lhs: jax.Array,
    dout: jax.Array,
    starts: jax.Array,
    ends: jax.Array,
    num_groups: int,
    *,
    out_dtype: Any,
    config: Config,
    backend: Backend,
    body: Any = _drhs_kernel,
) -> jax.Array:
    """drhs[i] = lhs_i^T @ dout_i for each group i: [num_groups, k, n]."""
    (m, k), n = lhs.shape, dout.shape[1]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    m_padded = pl.cdiv(m, bk) * bk
    call = backend.pallas_call(
        functools.partial(body, k_size=k, n_size=n, block_k=bk, masked_io=backend.is_triton),
        grid=(num_groups, pl.cdiv(k, bm), pl.cdiv(n, bn)),
        in_specs=[
            pl.BlockSpec(starts.shape, lambda g, i, j: (0,)),
            pl.BlockSpec(ends.shape, lambda g, i, j: (0,)),
            pl.BlockSpec((m_padded, bm), lambda g, i, j: (0, i)),
            pl.BlockSpec((m_padded, bn), lambda g, i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((compat.SQUEEZED, bm, bn), lambda g, i, j: (g, i, j)),
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        dimension_semantics=("parallel", "parallel", "parallel"),
        name="pallascheck_ragged_dot_drhs",
    )
    return call(starts, ends, lhs, dout)


def _grouped(lhs, rhs, group_sizes, *, transpose_rhs, config, backend):
    """The backend's grouped product: Mosaic GPU's kernel on its backends, the Pallas-generic one otherwise."""
    if backend.is_mosaic_gpu:
        return mosaic_gpu_ragged_dot.grouped_call(
            lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, config=config, backend=backend
        )
    starts, ends = group_offsets(group_sizes, lhs.shape[0])
    return grouped_call(lhs, rhs, starts, ends, transpose_rhs=transpose_rhs, config=config, backend=backend)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _ragged_dot(lhs, rhs, group_sizes, config, backend):
    return _grouped(lhs, rhs, group_sizes, transpose_rhs=False, config=config, backend=backend)


def _ragged_dot_fwd(lhs, rhs, group_sizes, config, backend):
    return _ragged_dot(lhs, rhs, group_sizes, config, backend), (lhs, rhs, group_sizes)


def _ragged_dot_bwd(config, backend, residuals, g):
    lhs, rhs, group_sizes = residuals
    g = g.astype(lhs.dtype)  # the output's dtype: a no-op unless a caller upcast it
    dlhs = _grouped(g, rhs, group_sizes, transpose_rhs=True, config=config, backend=backend)
    if backend.is_mosaic_gpu:
        drhs = mosaic_gpu_ragged_dot.drhs_call(lhs, g, group_sizes, out_dtype=rhs.dtype, config=config, backend=backend)
    else:
        starts, ends = group_offsets(group_sizes, lhs.shape[0])
        drhs = drhs_call(lhs, g, starts, ends, rhs.shape[0], out_dtype=rhs.dtype, config=config, backend=backend)
    return dlhs, drhs, None  # group_sizes is integer: no cotangent


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)
_ragged_dot_jit = jax.jit(_ragged_dot, static_argnums=(3, 4))


def _validate(lhs: Any, rhs: Any, group_sizes: Any) -> None:
    for name, value in (("lhs", lhs), ("rhs", rhs), ("group_sizes", group_sizes)):
        validation.require_array(name, value)
    validation.require_rank("lhs", lhs, 2)
    validation.require_rank("rhs", rhs, 3, " ([groups, k, n])")
    validation.require_rank("group_sizes", group_sizes, 1)
    validation.require_float_dtype("lhs", lhs.dtype)
    validation.require_float_dtype("rhs", rhs.dtype)
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"lhs and rhs must have the same dtype, got {lhs.dtype} and {rhs.dtype}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes must have an integer dtype, got {jnp.dtype(group_sizes.dtype).name}")
    if group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(
            f"group count must match: group_sizes.shape[0]={group_sizes.shape[0]} != rhs.shape[0]={rhs.shape[0]}"
        )
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"contracting dimensions must match: lhs.shape[1]={lhs.shape[1]} != rhs.shape[1]={rhs.shape[1]}"
        )
    validation.require_nonempty("lhs", tuple(lhs.shape))
    validation.require_nonempty("rhs", tuple(rhs.shape))
    try:
        sizes = np.asarray(group_sizes).astype(np.int64)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return  # traced: values unknown until run time (see the module docstring)
    if (sizes < 0).any():
        raise ValueError(f"group_sizes must be >= 0, got {sizes.tolist()}")
    if sizes.sum() > lhs.shape[0]:
        raise ValueError(f"sum(group_sizes)={int(sizes.sum())} must be <= lhs.shape[0]={lhs.shape[0]}")


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    config: Config | mosaic_gpu_ragged_dot.Config | None = None,
    backend: str | Backend | None = None,
) -> jax.Array:
    """``out[r] = lhs[r] @ rhs[group(r)]`` for lhs [m, k], rhs [g, k, n] (f32, bf16
    or f16; bf16 or f16 on the Mosaic GPU backends, which take a
    ``mosaic_gpu_ragged_dot.Config``), group_sizes [g] integers; rows past
    sum(group_sizes) are 0.

    Accumulates in f32, returns the input dtype. Differentiable in lhs and rhs.
    """
    _validate(lhs, rhs, group_sizes)
    backend = get_backend(backend)
    config = resolve_config(
        config,
        backend,
        Config,
        mosaic_gpu_ragged_dot.Config,
        kernel="ragged_dot",
        arrays={"lhs": lhs, "rhs": rhs, "group_sizes": group_sizes},
        options={},
    )
    if backend.is_mosaic_gpu:
        mosaic_gpu_matmul.check_input_dtype(lhs.dtype)
    return _ragged_dot_jit(lhs, rhs, jnp.asarray(group_sizes, jnp.int32), config, backend)


@jax.jit
def xla_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """What a user writes instead: ``lax.ragged_dot`` accumulating in f32, rounded
    once to the input dtype."""
    out = lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)
