"""Production-size attention oracles in slices, on the device.

The attention oracle and its bounds hold about a dozen [b, h, sq, skv] float64
intermediates: 4.3 GB each at b2 h16 s4096, more than a GPU holds together. Every
output and gradient element of attention depends on one batch row and one kv head
(with the q heads of its group) only, so a device oracle of a large case is computed
one (batch row, kv head) slice at a time and the slices' results are concatenated:
the same values and the same bounds, elementwise, with [1, group, sq, skv]
intermediates. The one exception is a bias that broadcasts over batch or heads: its
gradient sums across slices, so a case is never sliced along an axis its bias
broadcasts over.

``sliced(spec_functions)`` wraps the spec's oracle, expected, bound, contract and
gradient functions; on the host they run unchanged, on the device as compiled
programs (properties/device/programs.py): for cases below ``SLICE_ELEMENTS`` one per
function and layout, else one per function and slice layout (the oracle and one
bound, for one slice's shapes, config and arithmetic), which every slice and every
case of the layout reuses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from pallascheck.oracles import numeric
from pallascheck.oracles.numeric import xp
from pallascheck.properties.device import programs as device_programs
from pallascheck.properties.spec import Case

# [b, h, sq, skv] elements above which a device oracle slices (2^25: 268 MB per float64
# intermediate; under a dozen of them fit any GPU this runs on with room to spare)
SLICE_ELEMENTS = 2**25


@dataclasses.dataclass(frozen=True)
class Sliced:
    """A case whose oracle is computed slice by slice (``slices``: (batch, kv-head)
    index pairs, None for an axis not sliced)."""

    case: Case
    slices: tuple[tuple[int | None, int | None], ...]


def _plan(case: Case) -> tuple[tuple[int | None, int | None], ...] | None:
    q, k = case.arrays["q"], case.arrays["k"]
    b, sq, h, _ = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    if numeric.active_device() is None or b * h * sq * skv <= SLICE_ELEMENTS:
        return None
    bias = case.arrays.get("bias")
    by_batch = b > 1 and (bias is None or (bias.ndim == 4 and bias.shape[0] == b))
    by_head = hkv > 1 and (bias is None or (bias.ndim == 4 and bias.shape[1] == h))
    if not (by_batch or by_head):
        return None
    return tuple(
        (i if by_batch else None, j if by_head else None)
        for i in (range(b) if by_batch else [None])
        for j in (range(hkv) if by_head else [None])
    )


def _take(a: Any, axis: int, index: int | None, width: int = 1) -> Any:
    if index is None or a.shape[axis] == 1:  # not sliced, or broadcast along the axis
        return a
    where = [slice(None)] * a.ndim
    where[axis] = slice(index * width, (index + 1) * width)
    return a[tuple(where)]


def _sub_case(case: Case, batch: int | None, kv_head: int | None) -> Case:
    q, k = case.arrays["q"], case.arrays["k"]
    group = q.shape[2] // k.shape[2]
    out = {}
    for name, a in case.arrays.items():
        if name in ("q", "cotangent"):  # [b, sq, h, d]: the kv head's q heads
            out[name] = _take(_take(a, 0, batch), 2, kv_head, group)
        elif name in ("k", "v"):  # [b, skv, hkv, d]
            out[name] = _take(_take(a, 0, batch), 2, kv_head)
        elif a.ndim == 4:  # bias, mask: [b | 1, h | 1, sq | 1, skv]
            out[name] = _take(_take(a, 0, batch), 1, kv_head, group)
        else:  # 2-D bias or mask: shared by every slice
            out[name] = a
    return Case(out, case.params)


# where each result's batch and head axes are (q-like [b, sq, h, d], bias-like [b, h, sq, skv])
_AXES = {"out": (0, 2), "dq": (0, 2), "dk": (0, 2), "dv": (0, 2), "dbias": (0, 1)}


def _assemble(sliced: Sliced, parts: list[Any], key: str) -> Any:
    """Concatenate the slices' results (in ``sliced.slices`` order) along their axes."""
    batch_axis, head_axis = _AXES[key]
    heads = len({j for _, j in sliced.slices})
    rows = [
        xp.concatenate(parts[r : r + heads], axis=head_axis) if heads > 1 else parts[r]
        for r in range(0, len(parts), heads)
    ]
    return xp.concatenate(rows, axis=batch_axis) if len(rows) > 1 else rows[0]


def _slice_grads(grads: Mapping[str, Any], batch: int | None, kv_head: int | None, group: int) -> dict[str, Any]:
    widths = {"dq": group, "dk": 1, "dv": 1, "dbias": group}
    return {k: _take(_take(g, 0, batch), _AXES[k][1], kv_head, widths[k]) for k, g in grads.items()}


def sliced(oracle: Callable[[Case], Any], expected: Callable[[Any], Any]):
    """Wrappers of the spec functions that slice a large case on the device: returns
    (oracle, expected, per_slice) where ``per_slice(fn)`` wraps a bound function
    ``fn(case, ref, *rest)`` (a ``grads`` mapping in ``rest`` is sliced too)."""

    whole_oracle = device_programs.per_layout(oracle)

    def sliced_oracle(case: Case) -> Any:
        plan = _plan(case)
        return whole_oracle(case) if plan is None else Sliced(case, plan)

    def expected_of(case: Case, ref: Any) -> Any:
        return expected(ref)

    def per_slice(fn: Callable[..., Any]) -> Callable[..., Any]:
        whole = device_programs.per_layout(fn)
        # a slice's oracle is computed inside the slice's program
        of_slice = device_programs.per_layout(lambda case, *rest: fn(case, oracle(case), *rest))

        def run(case: Case, ref: Any, *rest: Any) -> Any:
            if not isinstance(ref, Sliced):
                return whole(case, ref, *rest)
            group = case.arrays["q"].shape[2] // case.arrays["k"].shape[2]
            parts = []
            for i, j in ref.slices:
                sub = _sub_case(case, i, j)
                parts.append(
                    of_slice(sub, *[_slice_grads(r, i, j, group) if isinstance(r, Mapping) else r for r in rest])
                )
            if isinstance(parts[0], Mapping):
                return {k: _assemble(ref, [p[k] for p in parts], k) for k in parts[0]}
            return _assemble(ref, parts, "out")

        return run

    expected_per_slice = per_slice(expected_of)

    def sliced_expected(ref: Any) -> Any:
        return expected_per_slice(ref.case, ref) if isinstance(ref, Sliced) else expected(ref)

    return sliced_oracle, sliced_expected, per_slice
