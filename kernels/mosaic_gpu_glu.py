"""Hopper (Mosaic GPU) gated linear unit forward ``act(x @ W[:, 0]) * (x @ W[:, 1])``.

The same pipeline as kernels/mosaic_gpu_matmul.py with a third operand: each of the
``max_concurrent_steps`` SMEM slots holds one x tile and the matching gate and up
tiles of the weights, all three TMA copies arriving on the slot's barrier, and each
K step issues two wgmmas (gate, up) into two f32 accumulators, so x is read once
for both products. The epilogue evaluates ``act(gate) * up`` in f32, rounds once to
x's dtype into SMEM and TMA-stores it (and, for the backward pass, both f32
accumulators).

Arithmetic (bf16/f16 inputs): gate and up are each what kernels/mosaic_gpu_matmul.py
computes for x @ W[:, 0] and x @ W[:, 1] (exact products, wgmma sums per K tile of
``tile_k``, tiles added sequentially into an f32 accumulator starting at zeros);
then ``act(gate)`` in f32, one f32 multiply by ``up``, one rounding to x's dtype.
f32 inputs are refused with a TypeError, as in kernels/mosaic_gpu_matmul.py.

Unaligned shapes: x is zero-padded to (tile_m, tile_k) multiples and the weights to
(tile_k, -, tile_n) multiples, then viewed as [d, 2 f] (gate columns first, a free
reshape), so the gate tile of feature block j is column block j and the up tile is
column block ``f_padded / tile_n + j``. Padding along d is exact zeros.

Backward: kernels/gated_linear_unit.py's custom_vjp, whose two products
(dz @ W^T and x^T @ dz) run kernels/mosaic_gpu_matmul.py on this backend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallascheck.kernels import mosaic_gpu_matmul, tiling
from pallascheck.kernels.activations import get_activation
from pallascheck.kernels.backends import Backend


@dataclasses.dataclass(frozen=True)
class Config(mosaic_gpu_matmul.Config):
    """mosaic_gpu_matmul's tiles; the two accumulators share one warpgroup's registers.
    The backward matmuls use the same tiles."""

    tile_m: int = 128
    tile_n: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.consumers != 1:
            raise ValueError(
                f"config.consumers must be 1 (the GLU kernel runs one consumer warpgroup), got {self.consumers!r}"
            )
        if 2 * self.tile_m * self.tile_n > mosaic_gpu_matmul.MAX_ACCUMULATOR_ELEMENTS:
            raise ValueError(
                f"2 * config.tile_m * config.tile_n must be <= {mosaic_gpu_matmul.MAX_ACCUMULATOR_ELEMENTS} "
                f"(two f32 accumulators in one warpgroup's registers), got 2 * {self.tile_m} * {self.tile_n}"
            )


def smem_bytes(config: Config, itemsize: int, save_residuals: bool) -> int:
    """The pipeline's x, gate and up slots plus the output tile and the f32 residual tiles."""
    pipeline = config.max_concurrent_steps * (config.tile_m + 2 * config.tile_n) * config.tile_k * itemsize
    out = config.tile_m * config.tile_n * (itemsize + (8 if save_residuals else 0))
    return pipeline + out


def configs(tokens: int, f: int, d: int, itemsize: int = 2, backend: str | Backend | None = None) -> list[Config]:
    """mosaic_gpu_matmul's space for [tokens, d] @ [d, f], keeping tiles whose two
    accumulators fit the registers and whose slots and residual tiles fit in SMEM."""
    space = []
    for c in mosaic_gpu_matmul.configs(tokens, f, d, itemsize, backend):
        if c.consumers != 1 or 2 * c.tile_m * c.tile_n > mosaic_gpu_matmul.MAX_ACCUMULATOR_ELEMENTS:
            continue
        config = Config(**dataclasses.asdict(c))
        if smem_bytes(config, itemsize, True) <= tiling.GPU_SHARED_MEMORY_BYTES:
            space.append(config)
    return space


def _forward_body(x_gmem, w_gmem, *refs, num_k_tiles: int, up_offset: int, activation: str):
    """One output tile. ``refs`` = output GMEM refs, x/gate/up SMEM rings, their
    barriers, output SMEM tiles (one per output)."""
    n_out = (len(refs) - 4) // 2
    out_gmems, (x_smem, gate_smem, up_smem, loaded), out_smems = (
        refs[:n_out],
        refs[n_out : n_out + 4],
        refs[n_out + 4 :],
    )
    stages, tile_m, tile_k = x_smem.shape
    tile_n = gate_smem.shape[2]
    m_slice = pl.ds(lax.axis_index("m") * tile_m, tile_m)
    gate_col = lax.axis_index("n") * tile_n

    def load(step, slot):  # TMA copies of K tile `step` into ring slot `slot`
        k_slice = pl.ds(step * tile_k, tile_k)
        plgpu.copy_gmem_to_smem(x_gmem.at[m_slice, k_slice], x_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(w_gmem.at[k_slice, pl.ds(gate_col, tile_n)], gate_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(
            w_gmem.at[k_slice, pl.ds(up_offset + gate_col, tile_n)], up_smem.at[slot], loaded.at[slot]
        )

    def k_loop(gate_ref, up_ref):
        def issue(slot):  # gate and up: two wgmmas per step
            plgpu.wgmma(gate_ref, x_smem.at[slot], gate_smem.at[slot])
            plgpu.wgmma(up_ref, x_smem.at[slot], up_smem.at[slot])
            return 2

        mosaic_gpu_matmul.k_ring(num_k_tiles, stages, loaded, load, issue)
        return gate_ref[...], up_ref[...]

    acc = plgpu.ACC((tile_m, tile_n), jnp.float32)  # allocated as exact zeros
    gate, up = pl.run_scoped(k_loop, acc, acc)
    mosaic_gpu_matmul.store_tiles(
        out_gmems,
        out_smems,
        (get_activation(activation)(gate) * up, gate, up),
        m_slice,
        pl.ds(gate_col, tile_n),
    )


KernelBody = Callable[..., None]


def fused_call(
    x: jax.Array,
    weights: jax.Array,
    *,
    activation: str,
    save_residuals: bool,
    config: Config,
    backend: Backend,
    body: KernelBody = _forward_body,
) -> Any:
    """The forward kernel on x [T, d] and weights [d, 2, f]: the output [T, f] in x's
    dtype, and with ``save_residuals`` also the f32 gate and up accumulators."""
    backend.require_available()
    mosaic_gpu_matmul.check_input_dtype(x.dtype)
    t, f = x.shape[0], weights.shape[2]
    tm, tn, tk = config.tile_m, config.tile_n, config.tile_k
    tiling.require_shared_memory(config, smem_bytes(config, x.dtype.itemsize, save_residuals))
    x_p = mosaic_gpu_matmul.pad_to(x, (tm, tk))
    w_p = mosaic_gpu_matmul.pad_to(weights, (tk, 1, tn))
    (tp, dp), fp = x_p.shape, w_p.shape[2]
    out_dtypes = [x.dtype] + [jnp.dtype(jnp.float32)] * (2 if save_residuals else 0)
    stages = config.max_concurrent_steps
    w_transforms = mosaic_gpu_matmul.operand_transforms(tk, x.dtype)
    scratch: tuple[Any, ...] = (
        plgpu.SMEM((stages, tm, tk), x.dtype, transforms=mosaic_gpu_matmul.operand_transforms(tk, x.dtype)),
        plgpu.SMEM((stages, tk, tn), x.dtype, transforms=w_transforms),
        plgpu.SMEM((stages, tk, tn), x.dtype, transforms=w_transforms),
        plgpu.Barrier(num_arrivals=3, num_barriers=stages),  # the x, gate and up copy of a slot
        *(plgpu.SMEM((tm, tn), dt, transforms=mosaic_gpu_matmul.operand_transforms(tn, dt)) for dt in out_dtypes),
    )
    call = plgpu.kernel(
        functools.partial(body, num_k_tiles=dp // tk, up_offset=fp, activation=activation),
        out_type=tuple(jax.ShapeDtypeStruct((tp, fp), dt) for dt in out_dtypes),
        scratch_types=scratch,
        grid=(tp // tm, fp // tn),
        grid_names=("m", "n"),
        interpret=backend.interpret_arg(),
    )
    outs = tuple(o[:t, :f] for o in call(x_p, w_p.reshape(dp, 2 * fp)))
    return outs if save_residuals else outs[0]
