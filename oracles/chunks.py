"""Float64 oracles and bounds in chunks of independent outputs (the dot-like families).

A dot-like oracle's whole float64 problem holds copies of its inputs (|x|, their
subnormal parts) and a dozen output-sized intermediates per bound; at production
sizes (an 8192 x 14336 output is 0.94 GB per float64 array) they outgrow a device.
Every output row of ``x @ y`` depends on its own row of x and all of y, every column
on all of x and its own column of y; so an oracle or bound is computed over spans of
rows (or columns, or groups), each span with the same operations on its slice, and
the spans' results are concatenated. The float64 sums over K are never split, but
BLAS and XLA choose how to order a dot's sums by its operands' shapes, so a span's
values can differ from the whole computation's in their last float64 bits (within
the float64 oracle's own error, far below any bound: tests/test_dot_chunks.py). A
span's temporaries are at most ``CHUNK_ELEMENTS`` float64 elements each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from pallascheck.oracles.numeric import xp

# float64 elements of one chunk's largest temporary: 2^24, 128 MiB (an 8192-row
# output of 14336 columns spans 1024 rows at a time)
CHUNK_ELEMENTS = 2**24


def spans(total: int, width: int) -> list[tuple[int, int]]:
    """[start, stop) spans over ``total`` items of ``width`` elements each: the largest
    power of two of items per span whose elements stay within ``CHUNK_ELEMENTS`` (at
    least one item, at most all of them)."""
    if total < 0 or width < 0:
        raise ValueError(f"total and width must be >= 0, got total={total}, width={width}")
    fit = CHUNK_ELEMENTS // max(width, 1)
    step = total if fit >= total else 1 << (max(fit, 1).bit_length() - 1)
    return [(s, min(s + step, total)) for s in range(0, total, max(step, 1))] or [(0, 0)]


def part(tree: Any, start: int, stop: int, axis: int) -> Any:
    """Every array of ``tree`` (an oracle, a mapping of gradients) sliced to
    [start, stop) along ``axis``."""

    def cut(a: Any) -> Any:
        where = [slice(None)] * a.ndim
        where[axis] = slice(start, stop)
        return a[tuple(where)]

    return jax.tree_util.tree_map(cut, tree)


def joined(parts: list[Any], axis: int) -> Any:
    """The spans' results (arrays, oracles, mappings) concatenated along ``axis``."""
    if len(parts) == 1:
        return parts[0]
    return jax.tree_util.tree_map(lambda *xs: xp.concatenate(xs, axis=axis), *parts)


def over(fn: Callable[[int, int], Any], total: int, width: int, axis: int) -> Any:
    """``fn(start, stop)`` over the ``spans`` of ``total`` items of ``width``
    elements, joined along ``axis``."""
    return joined([fn(s, e) for s, e in spans(total, width)], axis)


def streams(total: int, width: int) -> bool:
    """Whether ``total`` items of ``width`` elements take more than one span."""
    return len(spans(total, width)) > 1


# Device bytes of one span's temporaries, for the production tier's memory rule: at
# most 16 float64 arrays of CHUNK_ELEMENTS at once (a gradient bound's span holds dz's
# value, error, magnitude and subnormal part, three products of them and the dot's
# error terms; attention_slices.py charges its chunks the same 16)
SPAN_BYTES = 16 * 8 * CHUNK_ELEMENTS
