"""Exact numpy oracle for top-k (kernels/top_k.py), independent of the kernel's key trick.

The order is the IEEE-754 total order, written out by cases rather than by bit
tricks: +NaN above +inf (a larger payload higher), then the finite values and
infinities by value with +0.0 above -0.0, then -NaN (a larger payload lower). Ties
(equal bit patterns) go to the lower index. ``np.lexsort`` is a stable sort on the
keys (class, value, zero sign, NaN payload) with the index as the last tie-break.

Selection does no arithmetic, so the error bound is exactly zero: values must match
bit for bit and indices exactly. Outputs are compared as float64 arrays holding the
values' bit patterns (as unsigned integers, exact in float64) and the indices, so
that a NaN's sign and payload, and -0.0 vs +0.0, are checked too.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

_UINT = {2: np.uint16, 4: np.uint32}


@dataclasses.dataclass(frozen=True)
class TopKOracle:
    values: np.ndarray  # [tokens, k], the input dtype
    indices: np.ndarray  # [tokens, k], int64

    @property
    def out(self) -> np.ndarray:
        return encode(self.values, self.indices)


def bits(values: np.ndarray) -> np.ndarray:
    """The values' bit patterns as unsigned integers."""
    return np.ascontiguousarray(values).view(_UINT[values.dtype.itemsize])


def encode(values: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """[tokens, 2k] float64: bit patterns of the values, then the indices (both exact)."""
    value_bits = bits(np.asarray(values)).astype(np.float64)
    return np.concatenate([value_bits, np.asarray(indices).astype(np.float64)], axis=-1)


def descending_order(row: np.ndarray) -> np.ndarray:
    """The indices of ``row`` sorted by the total order, largest first, ties by index."""
    with np.errstate(invalid="ignore"):
        wide = row.astype(np.float64)  # exact for f32/bf16/f16; NaN keeps its sign
    nan = np.isnan(wide)
    negative = np.signbit(wide)
    category = np.where(nan, np.where(negative, 0, 2), 1)  # -NaN < numbers < +NaN
    value = np.where(nan, 0.0, wide)
    zero_sign = np.where(value == 0.0, np.where(negative, 0, 1), 0)  # -0.0 < +0.0
    mantissa = bits(row).astype(np.int64) & ((1 << (ml_dtypes.finfo(row.dtype).nmant)) - 1)
    payload = np.where(nan, np.where(negative, -mantissa, mantissa), 0)
    index = np.arange(row.shape[0])
    # lexsort: the last key is the primary one; negate the keys for "largest first".
    return np.lexsort((index, -payload, -zero_sign, -value, -category))


def oracle(logits: np.ndarray, k: int) -> TopKOracle:
    order = np.stack([descending_order(row)[:k] for row in logits])
    return TopKOracle(np.take_along_axis(logits, order, axis=1), order)


def bound(reference: TopKOracle) -> np.ndarray:
    """Zero everywhere: selection copies values, nothing rounds."""
    return np.zeros(reference.out.shape)
