"""Block-scaled FP8 matmul ``out = (x * x_scale) @ (w * w_scale)^T`` in bf16, the
DeepSeek-V3 / DeepGEMM recipe.

Operands (DeepGEMM's "NT" layout, both K-major as Hopper's FP8 wgmma requires):
- ``x`` [M, K] float8_e4m3fn with ``x_scale`` [M, ceil(K/128)] f32: one scale per row
  and 128 columns (1x128 blocks, what ``fp8.quantize(x, block=(1, 128))`` gives);
- ``w`` [N, K] float8_e4m3fn with ``w_scale`` [ceil(N/128), ceil(K/128)] f32: one
  scale per 128x128 block (``fp8.quantize(w, block=(128, 128))``).

Arithmetic (the tolerance model's inputs, oracles/fp8_matmul.py):
- the K range is cut into spans of ``promote_every`` elements (a divisor of 128, so a
  span never straddles a scale block); each span's FP8 products are summed in the
  matrix unit: exact products, summed as the backend sums them (on Hopper's wgmma a
  fused, truncating sum that keeps about 14 bits: ``tolerance.FusedMma``; in the
  interpreters f32 round-to-nearest, here in ``block_k`` tiles added in order);
- each span's partial sum is then *promoted*: multiplied by ``x_scale[i, kb] *
  w_scale[j // 128, kb]`` (f32) and added to an f32 accumulator, span after span;
- the accumulator is rounded once to ``out_dtype`` (bf16 by default).

Promoting at least once per scale block is what keeps the truncating accumulator's
error from growing with K (DeepSeek-V3, 3.3: about 2% at K = 4096 without it).

Any M, N, K: the wrapper pads x, w with zeros to whole tiles (zero products add exact
zeros), and the scales with zeros (they multiply those zeros only).

On ``mosaic_gpu`` / ``mosaic_gpu_interpret`` the Hopper kernel of
kernels/mosaic_gpu_fp8_matmul.py runs (its ``Config``); elsewhere the Pallas-generic
kernel below (tested in ``interpret``). Forward only: DeepSeek-V3's backward
requantises dy in other block layouts (1x128 and 128x1), which are kernels of their
own; the forward is where the promotion interval and the scale layout live.
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

from pallascheck.kernels import fp8, mosaic_gpu_fp8_matmul, validation
from pallascheck.kernels.backends import Backend, get_backend, resolve_config

SCALE_BLOCK = fp8.SCALE_BLOCK
OPERAND_DTYPES = (jnp.float8_e4m3fn,)
OUT_DTYPES = (jnp.bfloat16, jnp.float32)


def require_promotion(name: str, promote_every: Any, unit: int) -> None:
    """``promote_every`` must divide the 128-wide scale block and be a multiple of the
    kernel's K step ``unit`` (a span holds whole steps and never two scale blocks)."""
    if (
        not isinstance(promote_every, int)
        or promote_every < unit
        or SCALE_BLOCK % promote_every
        or promote_every % unit
    ):
        raise ValueError(
            f"{name} must divide {SCALE_BLOCK} (the scale block) and be a multiple of {unit}, got {promote_every!r}"
        )


@dataclasses.dataclass(frozen=True)
class Config:
    block_m: int = 32
    block_n: int = 64
    block_k: int = 32
    promote_every: int = 128

    def __post_init__(self) -> None:
        validation.require_positive_power_of_two("config.block_m", self.block_m, 16)
        validation.require_positive_power_of_two("config.block_k", self.block_k, 16)
        validation.require_positive_power_of_two("config.block_n", self.block_n, 16)
        if self.block_n > SCALE_BLOCK:  # one weight-scale row per output tile
            raise ValueError(f"config.block_n must be <= {SCALE_BLOCK} (one weight scale block), got {self.block_n}")
        require_promotion("config.promote_every", self.promote_every, self.block_k)


def configs(m: int, n: int, k: int, backend: str | Backend | None = None) -> list[Any]:
    """The config space (``mosaic_gpu_fp8_matmul.Config``s on the Mosaic GPU backends)."""
    be = get_backend(backend)
    if be.is_mosaic_gpu:
        return mosaic_gpu_fp8_matmul.configs(m, n, k, be)
    # interpreters: every config costs a compile; each promotion interval, K tile and
    # column tile once (promotion at every scale block, and at every 32-wide K tile)
    return [Config(32, 64, 32, 128), Config(32, 128, 16, 32), Config(16, 64, 16, 128)]


def _kernel(x_ref, w_ref, xs_ref, ws_ref, o_ref, *, block_k: int, promote_every: int):
    block_m, kp = x_ref.shape
    block_n = w_ref.shape[0]

    def span(p, acc):
        def tile(t, part):
            k = pl.multiple_of(p * promote_every + t * block_k, block_k)
            x = x_ref[:, pl.ds(k, block_k)]
            w = w_ref[:, pl.ds(k, block_k)]
            # the matrix unit's sum of exact FP8 products (K-major w: contract dim 1 of both)
            return part + lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        part = lax.fori_loop(0, promote_every // block_k, tile, jnp.zeros((block_m, block_n), jnp.float32))
        kb = (p * promote_every) // SCALE_BLOCK
        scale = xs_ref[:, pl.ds(kb, 1)] * ws_ref[:, pl.ds(kb, 1)]  # [bm, 1] * [1, 1]
        return acc + part * scale  # promotion: scale the span's sum, add in f32

    acc = lax.fori_loop(0, kp // promote_every, span, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


KernelBody = Callable[..., None]


def tiled_call(
    x: jax.Array,
    x_scale: jax.Array,
    w: jax.Array,
    w_scale: jax.Array,
    *,
    out_dtype: Any,
    config: Config,
    backend: Backend,
    body: KernelBody = _kernel,
) -> jax.Array:
    """``body`` over the (M/bm, N/bn) grid on padded operands; ``body`` is swappable so
    that test variants reuse the tiling and change only the arithmetic."""
    (m, _), n = x.shape, w.shape[0]
    bm, bn, bk, pe = config.block_m, config.block_n, config.block_k, config.promote_every
    x_p, xs_p, w_p, ws_p = fp8.pad_operands(x, x_scale, w, w_scale, bm, bn, pe)
    (mp, kp), np_ = x_p.shape, w_p.shape[0]
    kb = xs_p.shape[1]
    out = backend.pallas_call(
        functools.partial(body, block_k=bk, promote_every=pe),
        grid=(mp // bm, np_ // bn),
        in_specs=[
            pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((bn, kp), lambda i, j: (j, 0)),
            pl.BlockSpec((bm, kb), lambda i, j: (i, 0)),
            pl.BlockSpec((1, kb), lambda i, j: ((j * bn) // SCALE_BLOCK, 0)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        dimension_semantics=("parallel", "parallel"),
        name="pallascheck_fp8_matmul",
    )(x_p, w_p, xs_p, ws_p)
    return out[:m, :n]


def kernel_call(x, x_scale, w, w_scale, **kwargs: Any) -> jax.Array:
    call = mosaic_gpu_fp8_matmul.tiled_call if kwargs["backend"].is_mosaic_gpu else tiled_call
    return call(x, x_scale, w, w_scale, **kwargs)


_fp8_matmul_jit = jax.jit(kernel_call, static_argnames=("out_dtype", "config", "backend"))


def _validate(x: Any, x_scale: Any, w: Any, w_scale: Any, out_dtype: Any) -> None:
    for name, a in (("x", x), ("x_scale", x_scale), ("w", w), ("w_scale", w_scale)):
        validation.require_array(name, a)
        validation.require_rank(name, a, 2)
    validation.require_float_dtype("x", x.dtype, OPERAND_DTYPES)
    validation.require_float_dtype("w", w.dtype, OPERAND_DTYPES)
    validation.require_float_dtype("x_scale", x_scale.dtype, (jnp.float32,))
    validation.require_float_dtype("w_scale", w_scale.dtype, (jnp.float32,))
    validation.require_float_dtype("out_dtype", out_dtype, OUT_DTYPES)
    validation.require_nonempty("x", tuple(x.shape))
    validation.require_nonempty("w", tuple(w.shape))
    (m, k), n = x.shape, w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"contracting dimensions must match: x.shape[1]={k} != w.shape[1]={w.shape[1]} (w is [N, K])")
    kb, nb = -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK)
    if tuple(x_scale.shape) != (m, kb):
        raise ValueError(f"x_scale must have shape (M, ceil(K/128)) = {(m, kb)} (1x128 blocks), got {x_scale.shape}")
    if tuple(w_scale.shape) != (nb, kb):
        raise ValueError(
            f"w_scale must have shape (ceil(N/128), ceil(K/128)) = {(nb, kb)} (128x128 blocks), got {w_scale.shape}"
        )


def fp8_matmul(
    x: jax.Array,
    x_scale: jax.Array,
    w: jax.Array,
    w_scale: jax.Array,
    *,
    out_dtype: Any = jnp.bfloat16,
    config: Config | mosaic_gpu_fp8_matmul.Config | None = None,
    backend: str | Backend | None = None,
) -> jax.Array:
    """``(x * x_scale) @ (w * w_scale)^T`` rounded to ``out_dtype`` (module docstring)."""
    out_dtype = jnp.dtype(out_dtype)
    _validate(x, x_scale, w, w_scale, out_dtype)
    be = get_backend(backend)
    config = resolve_config(
        config,
        be,
        Config,
        mosaic_gpu_fp8_matmul.Config,
        kernel="fp8_matmul",
        arrays={"x": x, "w": w},
        options={"out_dtype": out_dtype.name},
    )
    return _fp8_matmul_jit(x, x_scale, w, w_scale, out_dtype=out_dtype, config=config, backend=be)


def dequantize(q: jax.Array, scale: jax.Array, block: tuple[int, int]) -> jax.Array:
    """q * its block's scale, in f32 (one rounding of the exact product)."""
    full = jnp.repeat(jnp.repeat(scale, block[0], axis=0), block[1], axis=1)
    return q.astype(jnp.float32) * full[: q.shape[0], : q.shape[1]]


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def xla_reference(
    x: jax.Array, x_scale: jax.Array, w: jax.Array, w_scale: jax.Array, *, out_dtype: Any = jnp.bfloat16
) -> jax.Array:
    """What a user writes instead: dequantise both operands to f32, one f32 XLA dot."""
    xd = dequantize(x, x_scale, (1, SCALE_BLOCK))
    wd = dequantize(w, w_scale, (SCALE_BLOCK, SCALE_BLOCK))
    return jnp.dot(xd, wd.T, preferred_element_type=jnp.float32).astype(out_dtype)
