"""FP8 formats and block quantisation: values -> (FP8 values, f32 scales) per block.

``quantize(a, block=(1, 128))`` is DeepSeek-V3's activation layout (one scale per row
and 128 columns), ``block=(128, 128)`` its weight layout. Per block, with ``amax`` the
largest |a| in it and ``max`` the format's largest finite value (e4m3fn 448, e5m2
57344):

- the scale is ``amax / max`` in f32, or with ``power_of_two_scales`` the smallest
  power of two >= it (exponent-only scales: dequantisation is then exact scaling);
  a block of zeros gets scale 1;
- each value is divided by the scale in f32, clipped to [-max, max] and converted to
  FP8 by round-to-nearest-even. The clip is needed: JAX's conversion does not
  saturate (e4m3fn turns anything that rounds past 448 into NaN, e5m2 into inf;
  oracles/tolerance.py), and a scale rounded down in f32 can put ``amax / scale`` a
  hair above ``max``.

Dequantised, ``q * scale`` differs from ``a`` by at most the format's relative
rounding plus half its subnormal spacing times the scale (oracles/fp8_matmul.py
``quantize_bound``). Inputs: f32, bf16 or f16, rank 2, any shape (edge blocks are
padded with zeros, which change no block's amax). Forward only: quantisation has no
useful gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels import validation
from pallascheck.kernels.backends import Backend, get_backend

FORMATS = (jnp.float8_e4m3fn, jnp.float8_e5m2)
FORMAT_NAMES = tuple(jnp.dtype(d).name for d in FORMATS)
SCALE_BLOCK = 128  # DeepSeek-V3 / DeepGEMM: 1x128 activation, 128x128 weight blocks
BLOCKS = ((1, SCALE_BLOCK), (SCALE_BLOCK, SCALE_BLOCK))


def fp8_max(dtype: Any) -> float:
    return float(ml_dtypes.finfo(jnp.dtype(dtype)).max)


def require_format(name: str, dtype: Any) -> None:
    validation.require_float_dtype(name, dtype, FORMATS)


@dataclasses.dataclass(frozen=True)
class Config:
    """Rows of the input one program quantises (a multiple of the block's rows)."""

    tile_rows: int = 128

    def __post_init__(self) -> None:
        validation.require_positive_power_of_two("config.tile_rows", self.tile_rows, 8)


def configs(block: tuple[int, int]) -> list[Config]:
    return [Config(r) for r in (32, 64, 128) if r % block[0] == 0]


def power_of_two_at_least(ratio: jax.Array) -> jax.Array:
    """The smallest power of two >= ``ratio`` (positive f32), read off its bits: the
    exponent, plus one where any fraction bit is set (a subnormal ratio gives 2^-126)."""
    bits = lax.bitcast_convert_type(ratio, jnp.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + jnp.where((bits & 0x7FFFFF) != 0, 1, 0)
    return lax.bitcast_convert_type(exponent << 23, jnp.float32)


def block_scale(amax: jax.Array, dtype: Any, power_of_two_scales: bool) -> jax.Array:
    ratio = amax / jnp.float32(fp8_max(dtype))
    scale = power_of_two_at_least(ratio) if power_of_two_scales else ratio
    return jnp.where(amax > 0, scale, jnp.float32(1.0))


def to_fp8(values: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """values / scale in f32, clipped to the format's range, rounded to nearest even."""
    top = jnp.float32(fp8_max(dtype))
    return jnp.clip(values / scale, -top, top).astype(dtype)


ScaleFn = Any  # (amax, dtype, power_of_two_scales) -> scale; swappable for test variants


def _quantize_kernel(a_ref, q_ref, s_ref, *, block_rows: int, power_of_two_scales: bool, scale_fn: ScaleFn):
    a = a_ref[...].astype(jnp.float32)
    rows = a.shape[0]
    if block_rows == 1:  # one scale per row of the 128 columns
        amax = jnp.max(jnp.abs(a), axis=1, keepdims=True)
        scale = scale_fn(amax, q_ref.dtype, power_of_two_scales)
        s_ref[...] = scale
    else:  # one scale per 128 x 128 block
        blocks = a.reshape(rows // block_rows, block_rows, SCALE_BLOCK)
        amax = jnp.max(jnp.abs(blocks), axis=(1, 2))[:, None]
        s_ref[...] = scale_fn(amax, q_ref.dtype, power_of_two_scales)
        scale = jnp.repeat(s_ref[...], block_rows, axis=0)
    q_ref[...] = to_fp8(a, scale, q_ref.dtype)


def _pad(a: jax.Array, rows: int, cols: int) -> jax.Array:
    return jnp.pad(a, ((0, -a.shape[0] % rows), (0, -a.shape[1] % cols)))


@functools.partial(jax.jit, static_argnames=("block", "dtype", "power_of_two_scales", "config", "backend", "scale_fn"))
def _quantize(a, *, block, dtype, power_of_two_scales, config, backend, scale_fn):
    m, k = a.shape
    tr = config.tile_rows
    padded = _pad(a, tr, SCALE_BLOCK)
    mp, kp = padded.shape
    scale_rows = tr // block[0]
    q, s = backend.pallas_call(
        functools.partial(
            _quantize_kernel, block_rows=block[0], power_of_two_scales=power_of_two_scales, scale_fn=scale_fn
        ),
        grid=(mp // tr, kp // SCALE_BLOCK),
        in_specs=[pl.BlockSpec((tr, SCALE_BLOCK), lambda i, j: (i, j))],
        out_specs=[
            pl.BlockSpec((tr, SCALE_BLOCK), lambda i, j: (i, j)),
            pl.BlockSpec((scale_rows, 1), lambda i, j: (i, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((mp, kp), dtype),
            jax.ShapeDtypeStruct((mp // block[0], kp // SCALE_BLOCK), jnp.float32),
        ],
        dimension_semantics=("parallel", "parallel"),
        name="pallascheck_fp8_quantize",
    )(padded)
    return q[:m, :k], s[: -(-m // block[0]), : -(-k // SCALE_BLOCK)]


def _validate(a: Any, block: Any, dtype: Any) -> None:
    validation.require_array("a", a)
    validation.require_rank("a", a, 2)
    validation.require_float_dtype("a", a.dtype)
    validation.require_nonempty("a", tuple(a.shape))
    require_format("dtype", dtype)
    if tuple(block) not in BLOCKS:
        raise ValueError(f"block must be one of {BLOCKS} (DeepSeek-V3's activation and weight blocks), got {block!r}")


def quantize(
    a: jax.Array,
    *,
    block: tuple[int, int] = (1, SCALE_BLOCK),
    dtype: Any = jnp.float8_e4m3fn,
    power_of_two_scales: bool = False,
    config: Config | None = None,
    backend: str | Backend | None = None,
    scale_fn: ScaleFn = block_scale,
) -> tuple[jax.Array, jax.Array]:
    """``a`` [M, K] -> (q [M, K] in ``dtype``, scales [ceil(M / block[0]), ceil(K / 128)]
    f32) with ``a ~ q * scale`` of its block (module docstring)."""
    _validate(a, block, dtype)
    be = get_backend(backend)
    if be.is_mosaic_gpu:
        be.pallas_call(lambda: None, name="pallascheck_fp8_quantize")  # raises NotOnBackend, naming the others
    config = config or Config()
    if config.tile_rows % block[0]:
        raise ValueError(f"config.tile_rows must be a multiple of the block's {block[0]} rows, got {config.tile_rows}")
    return _quantize(
        a,
        block=tuple(block),
        dtype=jnp.dtype(dtype),
        power_of_two_scales=power_of_two_scales,
        config=config,
        backend=be,
        scale_fn=scale_fn,
    )


def pad_operands(
    x: jax.Array, x_scale: jax.Array, w: jax.Array, w_scale: jax.Array, tm: int, tn: int, tk: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """x, w zero-padded to whole (tm, tk) / (tn, tk) tiles; x_scale's rows and w_scale's
    128-blocks padded with zeros to match (they multiply zero products only)."""
    pad = lambda a, rows, cols: jnp.pad(a, ((0, -a.shape[0] % rows), (0, -a.shape[1] % cols)))  # noqa: E731
    x_p, w_p = pad(x, tm, tk), pad(w, tn, tk)
    kb = -(-x_p.shape[1] // SCALE_BLOCK)
    xs_p = jnp.pad(x_scale, ((0, x_p.shape[0] - x.shape[0]), (0, kb - x_scale.shape[1])))
    nb = -(-w_p.shape[0] // SCALE_BLOCK)
    ws_p = jnp.pad(w_scale, ((0, nb - w_scale.shape[0]), (0, kb - w_scale.shape[1])))
    return x_p, xs_p, w_p, ws_p


@functools.partial(jax.jit, static_argnames=("block", "dtype", "power_of_two_scales"))
def xla_reference(
    a: jax.Array,
    *,
    block: tuple[int, int] = (1, SCALE_BLOCK),
    dtype: Any = jnp.float8_e4m3fn,
    power_of_two_scales=False,
) -> tuple[jax.Array, jax.Array]:
    """The same quantisation in plain jax.numpy (what a user writes instead)."""
    m, k = a.shape
    padded = _pad(a.astype(jnp.float32), block[0], SCALE_BLOCK)
    mb, kb = padded.shape[0] // block[0], padded.shape[1] // SCALE_BLOCK
    blocks = padded.reshape(mb, block[0], kb, SCALE_BLOCK)
    scale = block_scale(jnp.max(jnp.abs(blocks), axis=(1, 3)), dtype, power_of_two_scales)
    full = jnp.repeat(jnp.repeat(scale, block[0], axis=0), SCALE_BLOCK, axis=1)
    return to_fp8(padded, full, dtype)[:m, :k], scale
