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

On the oracle device (oracles/numeric.py) a streamed case's results stay there,
unless the process's share of the device would not hold them (the runner says so:
``numeric.on_device(hold_results=True)``): then they are held on the host. Each
span's results are copied there while the next span computes, and joined there
(``over``, ``stacked``), so that the device holds the inputs and one or two spans'
results, never a result of the case's size; the checks compare held results on the
device a block at a time (properties/checks.py). A span of held results is copied
back to the device when a later function reads it (``part``). Holding costs time:
on one H200 a GLU check of 8192 tokens, d 4096, f 14336 took 19.8 s a case held and
peaked at 7.0 GiB, where with its results on the device it took 4.1 s and 20.0 GiB
(docs/results.md). A single span, or a span inside a compiled program (its arrays
traced), stays on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax

from pallascheck.oracles import numeric

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
    """Every array of ``tree`` (an oracle, a mapping of gradients, an array) sliced to
    [start, stop) along ``axis``; on the oracle device, a slice of a result held on the
    host is copied there (and waited for: ``numeric.placed``)."""

    def cut(a: Any) -> Any:
        where = [slice(None)] * a.ndim
        where[axis] = slice(start, stop)
        return a[tuple(where)]

    sliced = jax.tree_util.tree_map(cut, tree)
    return sliced if numeric.active_device() is None else numeric.placed(sliced)


def joined(parts: list[Any], axis: int) -> Any:
    """The spans' results (arrays, oracles, mappings) concatenated along ``axis``,
    where they are (on the host if they were held there)."""
    if len(parts) == 1:
        return parts[0]
    return jax.tree_util.tree_map(lambda *xs: numeric.namespace(*xs).concatenate(xs, axis=axis), *parts)


def _held(results: Iterator[Any]) -> list[Any]:
    """Each result (a span's: arrays, oracles, mappings) copied to the host while the
    next one computes: at most two spans' results are on the device at once. Results
    traced inside a compiled program stay as they are (the program joins them)."""
    held: list[Any] = []
    pending = None
    for result in results:
        leaves = jax.tree_util.tree_leaves(result)
        if any(isinstance(a, jax.core.Tracer) for a in leaves):
            return [*held, *([] if pending is None else [pending]), result, *results]
        for a in leaves:
            if isinstance(a, jax.Array):
                a.copy_to_host_async()
        if pending is not None:
            held.append(jax.device_get(pending))
        pending = result
    return held if pending is None else [*held, jax.device_get(pending)]


def over(fn: Callable[[int, int], Any], total: int, width: int, axis: int) -> Any:
    """``fn(start, stop)`` over the ``spans`` of ``total`` items of ``width``
    elements, joined along ``axis`` (held on the host, where the oracles hold results,
    when they are more than one span)."""
    results = (fn(s, e) for s, e in spans(total, width))
    if not numeric.holds_results() or not streams(total, width):
        return joined(list(results), axis)
    return joined(_held(results), axis)


def stacked(fn: Callable[[int], Any], count: int, width: int) -> Any:
    """``fn(i)`` for i in range(count), each an array of ``width`` elements, stacked
    along a new first axis (held on the host, where the oracles hold results, when
    the stack takes more than ``CHUNK_ELEMENTS``)."""
    results = (fn(i) for i in range(count))
    if numeric.holds_results() and count * width > CHUNK_ELEMENTS:
        parts = _held(results)
    else:
        parts = list(results)
    return numeric.namespace(*parts).stack(parts)


def streams(total: int, width: int) -> bool:
    """Whether ``total`` items of ``width`` elements take more than one span."""
    return len(spans(total, width)) > 1


# Device bytes of one span's temporaries, for the production tier's memory rule: at
# most 16 float64 arrays of CHUNK_ELEMENTS at once (a gradient bound's span holds dz's
# value, error, magnitude and subnormal part, three products of them and the dot's
# error terms; attention_slices.py charges its chunks the same 16)
SPAN_BYTES = 16 * 8 * CHUNK_ELEMENTS
# and, where results are held on the host, two spans' results on their way there
# (``_held``), at most 4 arrays of CHUNK_ELEMENTS a span (the matmul oracle's)
HELD_SPANS_BYTES = 2 * 4 * 8 * CHUNK_ELEMENTS
