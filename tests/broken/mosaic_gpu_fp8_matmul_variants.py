"""A deliberately broken Mosaic GPU FP8 matmul: ``no_promotion``, a copy of
kernels/mosaic_gpu_fp8_matmul.py ``_body`` whose running sum stays in the tensor
core's accumulator across K steps instead of being promoted to f32 registers at every
step. To apply each block's scales it carries the sum in the units of the current
step's scales, ``acc = (acc / s + x_k @ w_k^T) * s``: exact in real arithmetic, and
it was one wgmma chain over all of K on the hardware, where each 32-product group
is added to the whole running sum with about 14 bits (tolerance.FusedMma). Its error
grows with K: DeepSeek-V3 (3.3) measured about 2% at K = 4096.

The interpreter adds the wgmma's result to the accumulator in f32 registers (it
cannot run an initialised accumulator, ``ACC.init``), and its wgmma is an f32 numpy
matmul anyway: there the variant is the correct kernel up to f32 rounding, which no
check can tell from it. It is caught on the GPU only, at the production tier's
K >= 4096 (GPU_COMMANDS: ``verify --shapes production`` on this variant).

It is the one-consumer form's body (``Config.consumers=1``); its spec draws only those
configs. The warp-specialised form (the default) has no such variant yet.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallascheck.kernels import compat, fp8, mosaic_gpu_fp8_matmul
from pallascheck.kernels.backends import MOSAIC_GPU, get_backend
from pallascheck.kernels.mosaic_gpu_matmul import store_tiles
from pallascheck.properties.families.fp8_matmul import make_spec

BACKENDS = MOSAIC_GPU
ONE_CONSUMER = mosaic_gpu_fp8_matmul.ONE_CONSUMER


def _body(
    x_gmem,
    w_gmem,
    xs_gmem,
    ws_gmem,
    out_gmem,
    x_smem,
    w_smem,
    xs_smem,
    ws_smem,
    loaded,
    out_smem,
    *,
    steps,
    interpreted,
):
    stages, tile_m, step_k = x_smem.shape
    tile_n = w_smem.shape[1]
    m_slice = pl.ds(lax.axis_index("m") * tile_m, tile_m)
    n_slice = pl.ds(lax.axis_index("n") * tile_n, tile_n)
    shape = (tile_m, tile_n)

    def load(step, slot):
        k_slice = pl.ds(step * step_k, step_k)
        kb = (step * step_k) // fp8.SCALE_BLOCK
        plgpu.copy_gmem_to_smem(x_gmem.at[m_slice, k_slice], x_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(w_gmem.at[n_slice, k_slice], w_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(xs_gmem.at[kb, m_slice], xs_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(ws_gmem.at[kb, n_slice], ws_smem.at[slot], loaded.at[slot])

    for step in range(min(stages, steps)):
        load(step, step)

    def step_fn(step, acc):
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(loaded.at[slot])
        row = plgpu.load(xs_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(1))
        col = plgpu.load(ws_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
        scale = lax.broadcast_in_dim(row, shape, [0]) * lax.broadcast_in_dim(col, shape, [1])
        x, w = x_smem.at[slot], compat.transposed_smem(w_smem.at[slot])
        # BUG: the running sum goes back into the tensor core (no promotion)
        if interpreted:
            summed = acc / scale + mosaic_gpu_fp8_matmul.mma(x, w, shape)
        else:
            summed = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, x, w))(plgpu.ACC.init(acc / scale))
        refill = step + stages
        plgpu.commit_smem()

        @pl.when(refill < steps)
        def _refill():
            load(refill, lax.rem(refill, stages))

        return summed * scale

    zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
    acc = lax.fori_loop(0, steps, step_fn, zeros)
    store_tiles((out_gmem,), (out_smem,), (acc,), m_slice, n_slice)


def no_promotion(x, x_scale, w, w_scale, *, out_dtype=jnp.bfloat16, config=None, backend="mosaic_gpu") -> jax.Array:
    be = get_backend(backend)
    return mosaic_gpu_fp8_matmul.tiled_call(
        x,
        x_scale,
        w,
        w_scale,
        out_dtype=jnp.dtype(out_dtype),
        config=config or ONE_CONSUMER,
        backend=be,
        body=functools.partial(_body, interpreted=be.is_interpreted),
    )


def _one_consumer_spec():
    spec = make_spec(no_promotion, name="mosaic_gpu_fp8_matmul[no_promotion]")
    space = spec.configs
    return dataclasses.replace(
        spec,
        configs=lambda case, backend: [c for c in space(case, backend) if c.consumers == 1],
        default_config_on={name: ONE_CONSUMER for name in MOSAIC_GPU},
    )


VARIANTS: dict[str, tuple[object, tuple[str, ...], int]] = {
    "no_promotion": (_one_consumer_spec(), ("float8_e4m3fn",), 4),
}
NOT_ON = {
    "no_promotion": {
        "mosaic_gpu_interpret": "the interpreter sums FP8 products in f32 (exact products, IEEE additions), so "
        "carrying the sum in the accumulator loses nothing there; the bug needs the GPU's truncating "
        "accumulator at K >= 4096 (the production tier)",
    }
}
