"""Deliberately broken Mosaic GPU matmuls. Each is a copy of the real kernel body
(kernels/mosaic_gpu_matmul.py ``_matmul_body``) with one line changed (marked
``BUG``; ``accumulator_rounded_to_bf16`` carries the sum in registers across K tiles
so that it can round it, as a kernel that keeps its accumulator in the input
precision would), run through the real wrapper (``mosaic_gpu_matmul.tiled_call``), so that
only the bug differs from the kernel under test. Forward only; bf16/f16 inputs.

``stale_accumulator``, ``y_tile_off_by_one`` and ``accumulator_rounded_to_bf16``
give wrong values on the interpreter and the GPU alike (the last two once K spans
more than one ``tile_k``).

Not a variant, and why: refilling a pipeline slot before the wgmma reading it has
retired (``wgmma_wait(2)`` instead of 1). The interpreter runs each wgmma
synchronously and its race detector keeps no clock for wgmma's SMEM reads, and on an
H200 the result was bit-identical to the real kernel's up to 4096x4096x8192 (the TMA
copy landed after the wgmma had read the slot): no check can see it from the values.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallascheck.kernels import mosaic_gpu_attention, mosaic_gpu_matmul
from pallascheck.kernels.activations import get_activation
from pallascheck.kernels.backends import MOSAIC_GPU, get_backend
from pallascheck.properties.families.matmul import make_spec


def _body(x_gmem, y_gmem, *refs, num_k_tiles, activation, bug):
    """``_matmul_body`` with the line of ``bug`` swapped in."""
    n_out = (len(refs) - 3) // 2
    out_gmems, (x_smem, y_smem, loaded), out_smems = refs[:n_out], refs[n_out : n_out + 3], refs[n_out + 3 :]
    stages, tile_m, tile_k = x_smem.shape
    tile_n = y_smem.shape[2]
    m_slice = pl.ds(lax.axis_index("m") * tile_m, tile_m)
    n_slice = pl.ds(lax.axis_index("n") * tile_n, tile_n)

    def load(step, slot):
        k_slice = pl.ds(step * tile_k, tile_k)
        # BUG (y_tile_off_by_one): y's TMA slice is K tile step+1 (wrapping to tile 0
        # at the end), so every x tile meets the wrong y tile once K spans two tiles.
        y_k_slice = pl.ds(lax.rem(step + 1, num_k_tiles) * tile_k, tile_k) if bug == "y_tile_off_by_one" else k_slice
        plgpu.copy_gmem_to_smem(x_gmem.at[m_slice, k_slice], x_smem.at[slot], loaded.at[slot])
        plgpu.copy_gmem_to_smem(y_gmem.at[y_k_slice, n_slice], y_smem.at[slot], loaded.at[slot])

    def k_loop(acc_ref):
        def issue(slot):
            plgpu.wgmma(acc_ref, x_smem.at[slot], y_smem.at[slot])
            return 1

        mosaic_gpu_matmul.k_ring(num_k_tiles, stages, loaded, load, issue)
        if bug == "stale_accumulator":
            # BUG: the sum starts from whatever the output tile's SMEM holds (never
            # written by this CTA: NaN on the interpreter, an earlier CTA's tile on
            # the GPU) instead of exact zeros: `out += x @ y` without zeroing out.
            return acc_ref[...] + out_smems[0][...].astype(jnp.float32)
        return acc_ref[...]

    def rounding_k_loop():
        """The same ring; each K tile's wgmma goes to a fresh accumulator that is added
        to a running sum carried in registers."""
        for step in range(min(stages, num_k_tiles)):
            load(step, step)

        def step_fn(step, total):
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(loaded.at[slot])
            part = mosaic_gpu_attention.mma(x_smem.at[slot], y_smem.at[slot], (tile_m, tile_n))
            refill = step + stages

            @pl.when(refill < num_k_tiles)
            def _refill():  # the wgmma reading `slot` has retired (mma read its result)
                load(refill, lax.rem(refill, stages))

            # BUG: the running sum is rounded to bf16 after every K tile (an
            # accumulator kept in the input precision between pipeline stages).
            return (total + part).astype(jnp.bfloat16).astype(jnp.float32)

        return lax.fori_loop(0, num_k_tiles, step_fn, mosaic_gpu_attention.zeros((tile_m, tile_n), plgpu.Layout.WGMMA))

    if bug == "accumulator_rounded_to_bf16":
        acc = rounding_k_loop()
    else:
        acc = pl.run_scoped(k_loop, plgpu.ACC((tile_m, tile_n), jnp.float32))
    mosaic_gpu_matmul.store_tiles(out_gmems, out_smems, (get_activation(activation)(acc), acc), m_slice, n_slice)


def _variant(bug: str) -> Callable[..., jax.Array]:
    """A forward-only matmul with the public signature and the given bug."""

    def run(x, y, *, activation="none", out_dtype=None, config=None, backend="mosaic_gpu_interpret"):
        return mosaic_gpu_matmul.tiled_call(
            x,
            y,
            out_dtype=x.dtype if out_dtype is None else jnp.dtype(out_dtype),
            activation=activation,
            save_preactivation=False,
            config=config or mosaic_gpu_matmul.Config(),
            backend=get_backend(backend),
            body=functools.partial(_body, bug=bug),
        )

    return run


BACKENDS = MOSAIC_GPU
# K spans more than one tile_k (K_DIMS 64 and 100 with tile_k 32 or 64) in most
# draws; 12 examples reach it for every variant.
EXAMPLES = 12
VARIANTS = {
    name: (
        make_spec(_variant(name), name=f"mosaic_gpu_matmul[{name}]", differentiable=False),
        ("bfloat16", "float16"),
        EXAMPLES,
    )
    for name in ("stale_accumulator", "y_tile_off_by_one", "accumulator_rounded_to_bf16")
}
