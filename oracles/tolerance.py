"""Rounding-error model: the allowed error of a kernel, derived, not tuned.

Notation: ``u`` is the unit roundoff of a format (half the distance from 1 to the
next float), so a correctly rounded operation satisfies ``fl(a op b) = (a op b)(1+d)``
with ``|d| <= u``. Summing ``n`` terms in any order whose longest chain of dependent
additions has ``k`` steps gives ``|error| <= gamma_k * sum|terms|`` with
``gamma_k = k u / (1 - k u)`` (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., eq. 3.4 and 4.4). The chain length ``k`` is set by the
accumulation order:

- sequential: ``k = n - 1``; it also bounds *any* order, so it is the safe choice
  when the order is unknown (inside an XLA dot, inside a tensor-core MMA);
- pairwise (tree): ``k = ceil(log2 n)``;
- blocked with block ``b`` (sum each block, then add the partial sums in order; a
  tiled kernel's K loop): ``k = (b - 1) + (ceil(n / b) - 1)``.

The probabilistic variant ``lambda * sqrt(k) * u`` (Higham & Mary 2019, Thm 2.8)
holds with probability at least ``1 - 2k exp(-lambda^2 (1-u)^2 / 2)`` when rounding
errors are independent and mean-zero; it is used only to *report* how tight the
deterministic bound is, never to accept a kernel.

Everything is float64 numpy: bounds are computed elementwise from the magnitudes
an oracle returns.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import ml_dtypes
import numpy as np

from pallascheck.kernels.backends import Backend

TF32 = "tf32"  # not a numpy dtype: the 10-bit-mantissa format of NVIDIA tensor cores

_MANTISSA_BITS = {  # explicit fraction bits p-1; u = 2**-p
    "float64": 52,
    "float32": 23,
    TF32: 10,
    "float16": 10,
    "bfloat16": 7,
    "float8_e4m3fn": 3,
    "float8_e5m2": 2,
}


# The FP8 formats (OCP 8-bit floating point; ml_dtypes names). e4m3fn: 3 fraction
# bits, max 448, NaN but no infinities ("fn": finite); e5m2: 2 fraction bits, max 57344,
# IEEE-like infinities. JAX converts to both by round-to-nearest-even without
# saturation (measured on XLA:CPU with jax 0.12.0.1, numpy/ml_dtypes alike): a value
# that rounds past the max becomes NaN in e4m3fn (464 -> 448, the tie, but 480 -> NaN;
# inf -> NaN) and inf in e5m2 (61440 -> inf). Quantisers must clip before converting.
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
OVERFLOWS_TO = {"float8_e4m3fn": "nan", "float8_e5m2": "inf"}


def dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str) and dtype == TF32:
        return TF32
    return np.dtype(dtype).name


def unit_roundoff(dtype: Any) -> float:
    """u = 2**-p: f64 2^-53, f32 2^-24, tf32 and f16 2^-11, bf16 2^-8, e4m3 2^-4, e5m2 2^-3."""
    name = dtype_name(dtype)
    if name not in _MANTISSA_BITS:
        raise ValueError(f"dtype must be one of {sorted(_MANTISSA_BITS)}, got {name!r}")
    return 2.0 ** -(_MANTISSA_BITS[name] + 1)


def smallest_normal(dtype: Any) -> float:
    name = dtype_name(dtype)
    if name == TF32:  # tf32 keeps the f32 exponent range
        name = "float32"
    return float(ml_dtypes.finfo(np.dtype(name)).smallest_normal)


def largest_finite(dtype: Any) -> float:
    name = dtype_name(dtype)
    return float(ml_dtypes.finfo(np.dtype("float32" if name == TF32 else name)).max)


def smallest_subnormal(dtype: Any) -> float:
    """The spacing of the subnormals: a correctly rounded result below the smallest
    normal errs by at most half of it (e4m3fn 2^-9, e5m2 2^-16)."""
    return float(ml_dtypes.finfo(np.dtype(dtype_name(dtype))).smallest_subnormal)


def gamma(k: Any, u: float) -> Any:
    """gamma_k = k u / (1 - k u); infinite once k u >= 1 (no bound exists)."""
    k = np.asarray(k, dtype=np.float64)
    ku = k * u
    with np.errstate(divide="ignore"):
        return np.where(ku < 1.0, ku / (1.0 - ku), np.inf)


def probabilistic_gamma(k: Any, u: float, lam: float = 5.0) -> Any:
    """lambda sqrt(k) u (first-order Higham-Mary bound); lambda = 5 fails with
    probability below 2k e^-12.5 ~ 7e-6 k."""
    return lam * np.sqrt(np.asarray(k, dtype=np.float64)) * u


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """The order in which a reduction of n terms is summed."""

    order: Literal["sequential", "pairwise", "blocked"]
    block: int = 0

    def __post_init__(self) -> None:
        if self.order not in ("sequential", "pairwise", "blocked"):
            raise ValueError(f"order must be sequential, pairwise or blocked, got {self.order!r}")
        if self.order == "blocked" and self.block < 1:
            raise ValueError(f"blocked accumulation needs block >= 1, got {self.block}")

    def depth(self, n: Any) -> Any:
        """Longest chain of dependent additions when summing n >= 1 terms."""
        n = np.maximum(np.asarray(n, dtype=np.int64), 1)
        if self.order == "sequential":
            return n - 1
        if self.order == "pairwise":
            return np.ceil(np.log2(n)).astype(np.int64)
        b = np.minimum(self.block, n)
        return (b - 1) + (-(-n // b) - 1)


SEQUENTIAL = Accumulation("sequential")
PAIRWISE = Accumulation("pairwise")


def blocked(block: int) -> Accumulation:
    return Accumulation("blocked", block)


@dataclasses.dataclass(frozen=True)
class FusedMma:
    """A tensor core's sum of FP8 products (MMA-Sim, arXiv 2511.10909, for Hopper's
    FP8 wgmma with an f32 accumulator): the products of each ``group`` of K are exact;
    they and the accumulator are aligned to the largest exponent among them and cut to
    ``fraction_bits`` bits below it (``rounding``: "truncate", toward zero), summed
    exactly, and the sum is cut to f32 (truncated) before the next group. So each group
    loses less than one unit of that grid per term (``group`` products and the
    accumulator), i.e. ``(group + 1) * 2^-fraction_bits`` times its largest term, plus
    one f32 ulp (2^-23) of its result. ``pallascheck probe`` measures these on the
    hardware (bench/probe.py ``fp8``) and fails where they differ."""

    group: int = 32
    fraction_bits: int = 13
    rounding: str = "truncate"

    def span_coefficient(self, n: Any) -> Any:
        """Error of a sum of n products in this MMA over the sum of their magnitudes:
        ceil(n / group) groups, each losing at most ``(group + 1) 2^-f + 2^-23`` of the
        magnitude summed so far (the largest term and the group's result are both at
        most that)."""
        groups = -(-np.maximum(np.asarray(n, dtype=np.int64), 1) // self.group)
        return groups * ((self.group + 1) * 2.0**-self.fraction_bits + 2.0 * unit_roundoff(np.float32))


# Hopper's FP8 wgmma as MMA-Sim models it (our H100 probe of it: docs/fp8.md)
HOPPER_FP8_MMA = FusedMma()


@dataclasses.dataclass(frozen=True)
class Arithmetic:
    """How a backend rounds. One instance per backend; kernel bounds take it.

    - ``matmul_input_f32``: the format f32 dot operands are rounded to first
      (tf32 on NVIDIA tensor cores at default precision, f32 elsewhere).
    - ``mma_unit``: the per-addition error of accumulation inside a dot. Tensor
      cores align and *truncate* instead of rounding to nearest (Fasi, Higham,
      Mikaitis & Pranesh 2021), so each addition may lose up to one ulp = 2u.
    - ``mma_order_known``: whether the summation order of a tiled K loop is the
      blocked order of the source. On the GPU the accumulator is fed back into the
      MMA, so the chunks join one sequential chain; there the order is sequential.
    - ``transcendental_ulps``: accuracy of exp/log/erf/tanh/rsqrt in f32: 3 ulp = 6u.
      Measured on XLA:CPU (tests/test_activation_models.py): erf 5.3u, tanh 4.8u,
      rsqrt 2.7u, log 1.9u, exp 1.4u; PTX's approximate instructions are within 2 ulp
      (rsqrt.approx 2^-22.9 relative, ex2.approx 2 ulp).
    - ``flush_subnormals``: the hardware may flush subnormal results to zero, so
      every operation can lose up to the smallest normal in absolute terms.
    - ``probabilistic``: use lambda sqrt(k) u instead of gamma_k (reporting only).
    - ``fp8_mma``: how the matrix unit sums FP8 products (``FusedMma``); None where
      FP8 products are summed as f32 (exact products, IEEE additions: the CPU and the
      interpreters, whose wgmma is a numpy matmul of the upcast tiles).
    """

    name: str
    matmul_input_f32: str = "float32"
    mma_unit_factor: float = 1.0
    mma_order_known: bool = True
    transcendental_ulps: float = 3.0
    flush_subnormals: bool = True
    probabilistic: bool = False
    fp8_mma: FusedMma | None = None

    def gamma(self, k: Any, u: float) -> Any:
        return probabilistic_gamma(k, u) if self.probabilistic else gamma(k, u)

    def operand_unit(self, dtype: Any) -> float:
        """Unit roundoff of the format a dot operand of this dtype is multiplied in."""
        name = dtype_name(dtype)
        if name == "float32":
            return unit_roundoff(self.matmul_input_f32)
        return 0.0  # bf16/f16 operands: products exact in f32 (2p <= 24 bits)

    def mma_unit(self, acc_dtype: Any = np.float32) -> float:
        return self.mma_unit_factor * unit_roundoff(acc_dtype)

    def dot_order(self, block_k: int) -> Accumulation:
        return blocked(block_k) if self.mma_order_known else SEQUENTIAL

    def transcendental_rel(self, dtype: Any = np.float32) -> float:
        return self.transcendental_ulps * 2.0 * unit_roundoff(dtype)

    def with_probabilistic(self) -> Arithmetic:
        return dataclasses.replace(self, probabilistic=True)


CPU = Arithmetic("cpu")
GPU = Arithmetic("gpu", matmul_input_f32=TF32, mma_unit_factor=2.0, mma_order_known=False, fp8_mma=HOPPER_FP8_MMA)
# Mosaic TPU: the MXU multiplies f32 at default precision as bf16 passes (one pass
# at DEFAULT), rounding operands to bf16; accumulation order inside the MXU unknown.
TPU = Arithmetic("tpu", matmul_input_f32="bfloat16", mma_order_known=False)


def arithmetic_for(backend: Backend) -> Arithmetic:
    """The arithmetic of the platform the backend's kernels run on: the interpreters
    run XLA:CPU arithmetic (IEEE round to nearest)."""
    return {"gpu": GPU, "tpu": TPU}.get(backend.platform, CPU)
