"""Float64 oracles and error bounds for the block-scaled FP8 matmul and the FP8
quantiser (kernels/fp8_matmul.py, kernels/fp8.py).

The oracle of the matmul is the float64 product of the *dequantised* operands,
``xd = x * x_scale`` and ``wd = w * w_scale`` (exact in float64: a 4-bit significand
times a 24-bit one), with the magnitude ``M = |xd| @ |wd|^T`` that every rounding
error of the sum scales with.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pallascheck.kernels.fp8 import SCALE_BLOCK
from pallascheck.oracles import algebra, numeric
from pallascheck.oracles.numeric import f64, xp
from pallascheck.oracles.tolerance import (
    HOPPER_FP8_MMA,
    SEQUENTIAL,
    Arithmetic,
    blocked,
    smallest_subnormal,
    unit_roundoff,
)

F32 = np.float32


def dequantized(q: Any, scale: Any, block: tuple[int, int]) -> Any:
    """q times its block's scale, in float64 (exact)."""
    rows, cols = q.shape
    full = xp.repeat(xp.repeat(f64(scale), block[0], axis=0), block[1], axis=1)
    return f64(q) * full[:rows, :cols]


@numeric.pytree("k")
@dataclasses.dataclass(frozen=True)
class Fp8MatmulOracle:
    out: np.ndarray  # xd @ wd^T, float64
    magnitude: np.ndarray  # |xd| @ |wd|^T
    k: int


def oracle(x: Any, x_scale: Any, w: Any, w_scale: Any) -> Fp8MatmulOracle:
    xd = dequantized(x, x_scale, (1, SCALE_BLOCK))
    wd = dequantized(w, w_scale, (SCALE_BLOCK, SCALE_BLOCK))
    return Fp8MatmulOracle(out=xd @ wd.T, magnitude=xp.abs(xd) @ xp.abs(wd).T, k=int(xd.shape[1]))


def span_coefficient(n: int, arith: Arithmetic, block_k: int | None) -> Any:
    """Error of the matrix unit's sum of ``n`` exact FP8 products over their magnitude:
    the backend's fused FP8 MMA where it has one (``FusedMma.span_coefficient``), else
    f32 round-to-nearest additions in ``block_k`` tiles added in order (any order for
    None): gamma of that chain's length."""
    if arith.fp8_mma is not None:
        return arith.fp8_mma.span_coefficient(n)
    order = blocked(block_k) if block_k else SEQUENTIAL
    return arith.gamma(order.depth(n), unit_roundoff(F32))


def promoted_bound(
    ref: Fp8MatmulOracle, *, promote_every: int, block_k: int | None, arith: Arithmetic, out_dtype: Any
) -> np.ndarray:
    """|kernel - oracle| for spans of ``promote_every`` products summed in the matrix
    unit, each promoted as ``acc + part * fl(xs * ws)`` in f32.

    Span p's sum errs by c_span * M_p (``span_coefficient``; M_p its dequantised
    magnitude, sum_p M_p = M, the span's scale factored out exactly). Promotion rounds
    the scale product and the scaled partial (two f32 roundings: (1+u)^2 on
    |s_p part_p| <= (1 + c_span) M_p) and adds the P = ceil(K / promote_every) terms
    sequentially in f32 (gamma_{P-1}); each of those 3P operations may underflow.
    The result is rounded once to ``out_dtype``.
    """
    u = unit_roundoff(F32)
    n = min(promote_every, ref.k)
    spans = -(-ref.k // promote_every)
    c_span = span_coefficient(n, arith, block_k)
    promoted = (1.0 + u) ** 2 * (1.0 + arith.gamma(spans - 1, u)) - 1.0
    coefficient = c_span + promoted * (1.0 + c_span)
    z = algebra.Bounded(
        ref.out, algebra.times(coefficient, ref.magnitude) + 3 * spans * algebra.underflow_floor(F32, arith)
    )
    return algebra.round_to(z, out_dtype, arith).err


def bound(ref: Fp8MatmulOracle, *, config: Any, arith: Arithmetic, out_dtype: Any) -> np.ndarray:
    """The implementation bound of our kernels under ``config`` (its promotion interval
    and K tile; the Mosaic GPU kernel's K tile is one wgmma of ``promote_every``)."""
    return promoted_bound(
        ref, promote_every=config.promote_every, block_k=config.block_k, arith=arith, out_dtype=out_dtype
    )


def reference_bound(ref: Fp8MatmulOracle, *, arith: Arithmetic, out_dtype: Any) -> np.ndarray:
    """xla_reference: each operand dequantised in f32 (one rounding, u each), read by
    the dot as the backend reads f32 (tf32 on the GPU: ``arith.operand_unit``), one
    f32 dot of K terms in an unknown order, rounded to ``out_dtype``."""
    u = unit_roundoff(F32)
    dequantised = (1.0 + u) ** 2 - 1.0
    z = algebra.dot(
        ref.out, (1.0 + dequantised) * ref.magnitude, ref.k, arith=arith, operand_dtype=F32, order=SEQUENTIAL
    )
    z = algebra.Bounded(z.value, z.err + algebra.times(dequantised, ref.magnitude))
    return algebra.round_to(z, out_dtype, arith).err


def contract(ref: Fp8MatmulOracle, *, arith: Arithmetic, out_dtype: Any) -> np.ndarray:
    """The accuracy contract of a block-scaled FP8 matmul: DeepSeek-V3's recipe, what
    a kernel that keeps to it achieves whatever its tiling. Each scale block of K
    (SCALE_BLOCK = 128 products, one scale pair) is summed by an FP8 matrix unit no
    less precise than Hopper's wgmma (``HOPPER_FP8_MMA``: 13 fraction bits per fused
    group of 32, the probed and published arithmetic, whatever the backend's own),
    scaled and promoted into an f32 sum (``promoted_bound``), rounded once to
    ``out_dtype``. A kernel that promotes less often, the missing promotion, carries
    13-bit sums over more products than one block and is outside it at large K.

    Not the bound of an f32-accumulated product (``reference_bound`` with f32
    operands, this function until 2026-11-27): no kernel on Hopper's FP8 wgmma keeps
    it. On an H100 the shipped kernel, promoting every 128 or 64 products, used up to
    1.02 of it at K = 4096 on positive inputs (``python -m studies.fp8_promotion
    --backend mosaic_gpu``) and up to 27.8 of it in a 20,485-case soak (2,476 cases
    over), every case within its implementation bound (docs/fp8.md)."""
    recipe = dataclasses.replace(arith, fp8_mma=HOPPER_FP8_MMA)
    return promoted_bound(ref, promote_every=SCALE_BLOCK, block_k=None, arith=recipe, out_dtype=out_dtype)


# ---------------------------------------------------------------- the quantiser


@numeric.pytree()
@dataclasses.dataclass(frozen=True)
class QuantizeOracle:
    out: np.ndarray  # the input itself, float64: what q * scale should give back


def quantize_oracle(a: Any) -> QuantizeOracle:
    return QuantizeOracle(out=f64(a))


def quantize_bound(ref: QuantizeOracle, scale: Any, *, dtype: Any) -> np.ndarray:
    """|q * scale - a| per element, ``scale`` the element's block scale as stored.

    q = fp8(clip(fl32(a / s))): the division rounds once (u32; exact for a power-of-two
    s); the clip moves a value by at most the amount fl32(amax / max) rounded s below
    amax / max, two more u32 of |a / s|; the conversion rounds to nearest (u8
    relative, or half the subnormal spacing absolute below the smallest normal).
    Dequantising multiplies exactly in float64, so the relative part is
    (1 + u32)^3 (1 + u8) - 1 of |a| and the absolute part s * spacing / 2.
    """
    u32, u8 = unit_roundoff(F32), unit_roundoff(dtype)
    relative = (1.0 + u32) ** 3 * (1.0 + u8) - 1.0
    return relative * xp.abs(ref.out) + f64(scale) * (smallest_subnormal(dtype) / 2.0)


def emulate_fused_sum(products: Any, fraction_bits: int, group: int, initial: Any = None) -> np.ndarray:
    """The fused FP8 MMA of ``tolerance.FusedMma`` run on exact products [..., K]
    (float64, numpy): per group of ``group`` products along the last axis, the running
    sum and the products are cut toward zero to the grid ``2^(e - fraction_bits)`` of
    the largest exponent e among them, summed exactly, and the sum is cut toward zero
    to f32. The running sum starts at ``initial`` (an f32 accumulator the MMA reads;
    zeros by default). The bit-exact candidate the probe compares the hardware with."""
    products = np.asarray(products, np.float64)
    acc = np.zeros(products.shape[:-1]) if initial is None else np.asarray(initial, np.float64)
    for start in range(0, products.shape[-1], group):
        terms = np.concatenate([acc[..., None], products[..., start : start + group]], axis=-1)
        largest = np.abs(terms).max(axis=-1, keepdims=True)
        exponent = np.floor(np.log2(np.where(largest > 0, largest, 1.0)))
        grid = 2.0 ** (exponent - fraction_bits)
        total = np.sum(np.trunc(terms / grid) * grid, axis=-1)
        acc = _truncate_to_f32(total)
    return acc


def _truncate_to_f32(value: np.ndarray) -> np.ndarray:
    nearest = value.astype(np.float32)
    overshot = np.abs(nearest.astype(np.float64)) > np.abs(value)
    return np.where(overshot, np.nextafter(nearest, np.float32(0)), nearest).astype(np.float64)
