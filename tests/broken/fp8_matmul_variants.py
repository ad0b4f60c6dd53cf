"""Deliberately broken FP8 kernels on the Pallas-generic path. Each reuses the real
tiling (``fp8_matmul.tiled_call``, ``fp8.quantize``) and changes one thing (marked
``BUG``); all three give wrong values in the interpreter:

- ``scale_of_next_block``: each span is promoted with the x scale of the *next* 128-wide
  K block (the last wraps to the first): off by one in the scale index;
- ``scaled_before_sum``: the scales are applied to the FP8 operands before the
  product, rounded back to FP8 for the matrix unit, instead of to the span's sum
  after it;
- ``scale_rounded_down``: the quantiser's power-of-two scale is the largest power of
  two <= amax / max instead of the smallest >=, so a block's largest values saturate.

The missing promotion needs the hardware's truncating accumulator: see
mosaic_gpu_fp8_matmul_variants.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels import fp8, fp8_matmul
from pallascheck.kernels.backends import get_backend
from pallascheck.properties.families.fp8_matmul import make_quantize_spec, make_spec

BACKENDS = ("interpret",)


def _body(x_ref, w_ref, xs_ref, ws_ref, o_ref, *, block_k, promote_every, bug):
    """kernels/fp8_matmul.py ``_kernel`` with the line of ``bug`` swapped in."""
    block_m, kp = x_ref.shape
    block_n = w_ref.shape[0]
    blocks = xs_ref.shape[1]

    def span(p, acc):
        kb = (p * promote_every) // fp8.SCALE_BLOCK
        xs, ws = xs_ref[:, pl.ds(kb, 1)], ws_ref[:, pl.ds(kb, 1)]

        def tile(t, part):
            k = pl.multiple_of(p * promote_every + t * block_k, block_k)
            x, w = x_ref[:, pl.ds(k, block_k)], w_ref[:, pl.ds(k, block_k)]
            if bug == "scaled_before_sum":  # BUG: dequantised into FP8 before the product
                x = (x.astype(jnp.float32) * xs).astype(x.dtype)
                w = (w.astype(jnp.float32) * ws).astype(w.dtype)
            return part + lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        part = lax.fori_loop(0, promote_every // block_k, tile, jnp.zeros((block_m, block_n), jnp.float32))
        if bug == "scaled_before_sum":
            return acc + part
        if bug == "scale_of_next_block":  # BUG: the next K block's x scale
            xs = xs_ref[:, pl.ds(lax.rem(kb + 1, blocks), 1)]
        return acc + part * (xs * ws)

    acc = lax.fori_loop(0, kp // promote_every, span, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _variant(bug: str) -> Callable[..., jax.Array]:
    def run(x, x_scale, w, w_scale, *, out_dtype=jnp.bfloat16, config=None, backend="interpret"):
        return fp8_matmul.tiled_call(
            x,
            x_scale,
            w,
            w_scale,
            out_dtype=jnp.dtype(out_dtype),
            config=config or fp8_matmul.Config(),
            backend=get_backend(backend),
            body=functools.partial(_body, bug=bug),
        )

    return run


def _scale_rounded_down(amax: jax.Array, dtype: Any, power_of_two_scales: bool) -> jax.Array:
    """``fp8.block_scale`` with the power of two rounded the wrong way."""
    ratio = amax / jnp.float32(fp8.fp8_max(dtype))
    if power_of_two_scales:  # BUG: the exponent of the ratio, without the round-up
        bits = lax.bitcast_convert_type(ratio, jnp.int32)
        ratio = lax.bitcast_convert_type(((bits >> 23) & 0xFF) << 23, jnp.float32)
    return jnp.where(amax > 0, ratio, jnp.float32(1.0))


# Three of the four quantiser layouts draw power-of-two scales within 4 examples (in turn).
EXAMPLES = 4
VARIANTS = {
    **{
        name: (make_spec(_variant(name), name=f"fp8_matmul[{name}]"), ("float8_e4m3fn",), EXAMPLES)
        for name in ("scale_of_next_block", "scaled_before_sum")
    },
    "scale_rounded_down": (
        make_quantize_spec(
            functools.partial(fp8.quantize, scale_fn=_scale_rounded_down), name="fp8_quantize[scale_rounded_down]"
        ),
        ("float8_e4m3fn", "float8_e5m2"),
        EXAMPLES,
    ),
}
