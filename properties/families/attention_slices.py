"""Production-size attention oracles in slices and chunks of query rows, on the device.

The attention oracle and its bounds hold about a dozen [b, h, sq, skv] float64
intermediates: 4.3 GB each at b2 h16 s4096, more than a GPU holds together. Every
output and gradient element of attention depends on one batch row and one kv head
(with the q heads of its group) only, so a device oracle of a large case is computed
one (batch row, kv head) slice at a time and the slices' results are concatenated:
the same values and the same bounds, elementwise, with [1, group, sq, skv]
intermediates. The one exception is a bias that broadcasts over batch or heads: its
gradient sums across slices, so a case is never sliced along an axis its bias
broadcasts over.

A slice of more than ``SLICE_ELEMENTS`` elements (one [1, group, 32768, 32768] slice
is 34 GB per float64 intermediate) is computed in chunks of query rows. A query row's
output, its implementation bound and its accuracy contract depend on its own q, bias
and mask rows, all keys and values, and which keys it sees: a chunk's program takes
the slice's case and the chunk's first row (a traced scalar: one program serves every
chunk of the slice layout, and one more the last, shorter chunk), and computes the
oracle of its rows with the causal mask of their absolute positions
(``oracles.attention.causal_visible``, bottom-right alignment as the whole case's).
The spec's functions still see the slice's case (its q length sets the backward's
default q block and the sums' depth) with the chunk's oracle (``attention.chunk``):
the rows' results (out, its bounds, dq and its bound, and dbias of a bias with query
rows) are put together in its whole-case array (``_Gathered``: on the device, or
held on the host where the process's share of the device would not hold them, the
checks then comparing them a block at a time, properties/checks.py); the results
that sum over query rows (dk, dv, a dbias that
broadcasts over rows, and their bounds) come back as ``attention.RowSums``: sums over
the chunk's rows of exact values and non-negative error magnitudes, which the chunks
add (float64 reassociation only, some 2^29 below any bound) before the factors of the
whole sum (gamma of its depth over all sq rows, its underflow floors, sm_scale, the
output rounding) are applied once (``RowSums.finish``). Nothing is left unchunked.

A causal chunk sees a prefix of the keys: its last row sees keys j <= i + skv - sq
only. Its oracle is computed over the keys its last row sees, rounded up to a multiple
of an eighth of skv (``_visible_keys``: at most eight programs per function serve
every chunk; a causal s32768 case does 56% of the work of every chunk over every key),
and one stand-in key for the rest (``oracles.attention.key_prefix``): the rest
contribute to the chunk's results only the terms a key no row sees gets (underflow
floors of roundings), which the stand-in gets as they do; the results with a key axis
(dk, dv, a dbias with keys, and their bounds) come back with every key, the stand-in's
entry for each of the rest, and the bounds count the whole case's keys.

Device memory of one chunk. With G the q heads of a slice (its kv head's group, or
all h where not sliced by head, times b where not sliced by batch), r its rows and d
the head_dim, its float64 arrays are [G, r, skv] ones (U = 8 G r skv bytes, at most 8
``SLICE_ELEMENTS`` = 268 MB; a causal chunk's prefix holds fewer) and [G, skv, d] ones
(V = 8 G skv d bytes: k and v repeated for the group's heads, their magnitudes; no
chunking shrinks them). A pass holds the chunk's oracle (its program's output) while
each function's program runs on it, one at a time. XLA:CPU's buffer assignment (G 4,
causal, no bias, every key; measured again 2026-11-28) put the oracle's output at 6.4 U
(d/r = 1/8), 7.1 U (d/r = 1/2) and 10.1 U (d/r = 2), its program's temp bytes at 4.1,
4.5 and 8.0 U, and the largest fed program, the gradient bound and its contract joined
(now ``oracles.attention.bounds``, each bound after the work they share, one at a
time), at 7.4, 8.1 and 11.5 U of temp bytes and 0.4, 1.5 and 6.0 U of outputs (with
the forward bound and contract joined in as well, measured beside them without the
causal mask: 9.6, 10.3 and 13.3 U of temp bytes where the two alone took 9.7, 10.6 and
14.9 U; outputs 0.1 U more) (one
of them alone: 7.3, 8.1, 11.5 U and 0.2, 0.75, 3.0 U; the forward bound 4.1, 4.5, 6.0 U;
the VJP 4.1, 5.0, 8.0 U): a chunk's peak, the oracle's output and the joined program's
temp bytes and outputs, is 14.2 U, 16.8 U and 27.6 U, within 16 U + 6 V (V = U / 8,
U / 2, 2 U there: 16.75, 19 and 28 U; a GPU's fusion differs: not measured). Add the slice's
inputs, placed on the device once for all its chunks, in their dtypes: q and the
cotangent (G sq d), k and v (skv d per kv head), and a bias or mask with query rows
(G sq skv elements: what keeps such inputs out of long-context layouts), the copies
of the chunk's results on their way to the host (``GATHER_ELEMENTS`` a result) and
the slice's row sums. At G 4, d 128: s 32768 (r 256) within 5.1 GB, s 131072 (r 64)
within 7.5 GB. A whole check on an H100 (the kernel's side and the comparison's blocks
with it), its results held on the host, peaked at 6.4 GiB at 32k and 9.3 GiB at 64k
(docs/results.md); with them on the device, add the results (the family's
``_check_bytes``).

``sliced(spec_functions)`` wraps the spec's oracle, expected, bound, contract and
gradient functions; on the host they run unchanged, on the device as compiled
programs (properties/device/programs.py): for cases below ``SLICE_ELEMENTS`` one per
function and layout, else one per function and slice (or chunk) layout, which every
slice, chunk and case of the layout reuses. The calls a check makes with a sliced
case are served in shared passes (``Sliced.passes``; the runner asks them in rounds,
properties/device/programs.py): each slice's or chunk's oracle is its own program,
run once per pass and fed to every function's program of the pass, instead of
recomputed inside each function's. Attention's gradient bounds read no exact
gradient, so the runner asks every call in the oracle's round
(``GradientSpec.bound_reads_gradients``): one pass a case. A function may join the
calls of a pass (``per_slice(fn, joins=i)``, its ``rest[i]`` a tuple of options): the
gradient bound and its contract are one program per chunk, which does the work that no
tiling changes once (``_joined``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from pallascheck.oracles import attention as attention_oracle
from pallascheck.oracles import numeric
from pallascheck.oracles.numeric import xp
from pallascheck.properties.device import layout_programs
from pallascheck.properties.device import programs as device_programs
from pallascheck.properties.spec import Case

# [b, h, sq, skv] elements above which a device oracle slices, and the most a chunk of
# query rows holds (2^25: 268 MB per float64 intermediate; 16 of them fit any GPU this
# runs on with room to spare)
SLICE_ELEMENTS = 2**25


@dataclasses.dataclass(frozen=True)
class Sliced:
    """A case whose oracle is computed slice by slice (``slices``: (batch, kv-head)
    index pairs, None for an axis not sliced), each in chunks of ``rows`` query rows
    (None: each slice whole)."""

    case: Case
    slices: tuple[tuple[int | None, int | None], ...]
    rows: int | None = None
    # serves the spec functions' calls with this case (``sliced``): one pass over the
    # slices and chunks for each round of calls the runner asks
    passes: device_programs.SharedPasses | None = dataclasses.field(default=None, compare=False, repr=False)


def _chunk_rows(seq_q: int, row_elements: int) -> int | None:
    """Query rows per chunk of a slice of ``row_elements`` = [b, h, skv] elements per
    row: the largest power of two whose chunk stays within ``SLICE_ELEMENTS`` (from 128
    rows up a multiple of 128, the kernels' q blocks; power-of-two sequence lengths
    then split into equal chunks, one program), at least one row; None when the whole
    slice fits."""
    fit = SLICE_ELEMENTS // row_elements
    if fit >= seq_q:
        return None
    return 1 << (max(fit, 1).bit_length() - 1)


def _plan(case: Case) -> Sliced | None:
    q, k = case.arrays["q"], case.arrays["k"]
    b, sq, h, _ = q.shape
    skv, hkv = k.shape[1], k.shape[2]
    if numeric.active_device() is None or b * h * sq * skv <= SLICE_ELEMENTS:
        return None
    bias = case.arrays.get("bias")
    by_batch = b > 1 and (bias is None or (bias.ndim == 4 and bias.shape[0] == b))
    by_head = hkv > 1 and (bias is None or (bias.ndim == 4 and bias.shape[1] == h))
    # a case sliced along neither axis is one slice (None, None), chunked by rows
    slices = tuple(
        (i if by_batch else None, j if by_head else None)
        for i in (range(b) if by_batch else [None])
        for j in (range(hkv) if by_head else [None])
    )
    rows = _chunk_rows(sq, (1 if by_batch else b) * (h // hkv if by_head else h) * skv)
    return Sliced(case, slices, rows)


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


def _visible_keys(seq_q: int, seq_kv: int, first_row: int, rows: int) -> int | None:
    """How many of the first keys a causal chunk of query rows ``first_row`` ..
    ``first_row + rows`` computes over: those its last row sees (bottom-right), rounded
    up to a multiple of an eighth of seq_kv (a power of two), so that at most eight
    lengths, each its own compiled program, serve every chunk; None: all of them."""
    step = 1 << max((seq_kv - 1) // 8, 1).bit_length()
    seen = first_row + rows + seq_kv - seq_q
    keys = max(-(-seen // step), 1) * step
    return None if keys >= seq_kv else keys


def _chunk_case(case: Case, first_row: Any, rows: int, keys: int | None) -> Case:
    """The case of query rows ``first_row`` .. ``first_row + rows`` of ``case``: their
    q, cotangent, bias and mask rows, every key (or the first ``keys`` and the stand-in
    for the rest, which no row of the chunk sees: ``oracles.attention.key_prefix``),
    and the causal mask as the mask of those rows' absolute positions in ``case``
    (never as if the first were row 0)."""
    sq, skv = case.arrays["q"].shape[1], case.arrays["k"].shape[1]
    out: dict[str, Any] = {}  # the case's arrays, sliced on the device (traced)
    for name, whole in case.arrays.items():
        x: Any = whole
        if name in ("q", "cotangent"):  # [b, sq, h, d]
            out[name] = jax.lax.dynamic_slice_in_dim(x, first_row, rows, 1)
            continue
        if name not in ("k", "v") and x.ndim >= 2 and x.shape[-2] > 1:  # bias, mask with rows
            x = jax.lax.dynamic_slice_in_dim(x, first_row, rows, x.ndim - 2)
        if keys is not None and name in ("k", "v"):  # [b, skv, hkv, d]
            x = attention_oracle.key_prefix(x, 1, keys, stand_in="magnitude" if name == "k" else "zero")
        elif keys is not None and x.shape[-1] > 1:  # a bias or mask with keys
            x = attention_oracle.key_prefix(x, x.ndim - 1, keys, stand_in="zero")
        out[name] = x
    params = dict(case.params)
    if params["causal"]:
        # the stand-in is key ``keys``: past the last row's last visible key
        visible = attention_oracle.causal_visible(
            sq, skv, first_row=first_row, rows=rows, keys=None if keys is None else keys + 1
        )
        out["mask"] = visible & out["mask"] if "mask" in out else visible
        params["causal"] = False
    return Case(out, params)


_Where = tuple[int, int, str]  # a result of a pass: its function, part (of a joined call) and key
# where each result's batch and head axes are (q-like [b, sq, h, d], bias-like [b, h, sq, skv])
_AXES = {"out": (0, 2), "dq": (0, 2), "dk": (0, 2), "dv": (0, 2), "dbias": (0, 1)}
# where a chunk's rows are in the results that have rows (a bias in its own shape)
_ROW_AXIS = {"out": 1, "dq": 1, "dbias": -2}


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


# float64 elements a copy of a chunked pass's results to the host carries at least
# (16 MiB): a chunk's rows of one result are 2^17 elements at 32k keys, and host
# buffers of that size, each allocated fresh and put in place, took 1.4 s a GiB on
# the 2-core CPU where 16 MiB ones took 0.3 s.
GATHER_ELEMENTS = 2**21


class _Gathered:
    """A pass's results over a chunked case, each put together in its whole-case array
    as its pieces come: a slice's chunks' rows, a slice's finished row sums.

    Held on the host (``held``: ``numeric.holds_results()``, where the process's share
    of the device would not hold them), the consecutive chunks of one result are joined
    on the device into copies of ``GATHER_ELEMENTS`` or more, which run while the next
    chunk computes, and each is put in place in a numpy array; the checks compare them
    on the device a block at a time (properties/checks.py). At 32k keys and 32 heads
    the float64 results of a pass (the oracle's output and gradients, their bounds and
    contracts) are some 8 GiB. Otherwise they stay on the device: a slice's chunks are
    joined once the slice ends and the slices once the pass ends, one result at a
    time (its parts and its whole at once, never every result twice), and the checks
    compare them where they are."""

    def __init__(self, plan: Sliced, held: bool) -> None:
        self.plan = plan
        self.held = held
        self.rows = plan.case.arrays["q"].shape[1]
        self.batches = len({i for i, _ in plan.slices})
        self.heads = len({j for _, j in plan.slices})
        self.arrays: dict[_Where, Any] = {}
        self._slice: tuple[int | None, int | None] = (None, None)
        self._groups: dict[_Where, list[tuple[int, Any]]] = {}  # per result: (first row, rows) to join
        self._copying: list[tuple[_Where, Any, tuple[int | None, int | None, int | None]]] = []
        self._slices: dict[_Where, list[Any]] = {}  # on the device: per result, its slices' in plan order

    def begin(self, batch: int | None, kv_head: int | None) -> None:
        """The pieces that follow are the slice (``batch``, ``kv_head``)'s."""
        self._slice = (batch, kv_head)

    def rows_of(self, where: _Where, first_row: int, piece: Any) -> None:
        """A chunk's rows (from ``first_row``) of result ``where`` (function, part, key)."""
        group = self._groups.setdefault(where, [])
        group.append((first_row, piece))
        if self.held and sum(p.size for _, p in group) >= GATHER_ELEMENTS:
            self._send(where)

    def whole_of(self, where: _Where, piece: Any) -> None:
        """The slice's whole result ``where`` (finished row sums)."""
        if self.held:
            self._copy(where, piece, None)
        else:
            self._slices.setdefault(where, []).append(piece)

    def settle(self) -> None:
        """Put every piece whose copy started in its place."""
        copying, self._copying = self._copying, []
        for where, piece, (batch, kv_head, first_row) in copying:
            piece = np.asarray(piece)
            batch_axis, head_axis = _AXES[where[2]]
            index, shape = [slice(None)] * piece.ndim, list(piece.shape)
            if batch is not None:
                index[batch_axis], shape[batch_axis] = slice(batch, batch + 1), self.batches
            if kv_head is not None:
                width = piece.shape[head_axis]
                index[head_axis], shape[head_axis] = slice(kv_head * width, (kv_head + 1) * width), width * self.heads
            if first_row is not None:
                axis = _ROW_AXIS[where[2]] % piece.ndim
                index[axis], shape[axis] = slice(first_row, first_row + piece.shape[axis]), self.rows
            whole = self.arrays.get(where)
            if whole is None:
                whole = self.arrays[where] = np.empty(shape, piece.dtype)
            whole[tuple(index)] = piece

    def end(self) -> None:
        """The slice's last pieces sent and put in place (held), or joined (on the device)."""
        for where in list(self._groups):
            if self.held:
                self._send(where)
            else:
                self._slices.setdefault(where, []).append(self._joined_rows(where))
        self.settle()

    def finish(self) -> None:
        """On the device: each result's slices joined into its whole-case array."""
        for where in list(self._slices):
            self.arrays[where] = _assemble(self.plan, self._slices.pop(where), where[2])

    def _joined_rows(self, where: _Where) -> Any:
        pieces = [p for _, p in self._groups.pop(where)]
        axis = _ROW_AXIS[where[2]] % pieces[0].ndim
        return pieces[0] if len(pieces) == 1 else xp.concatenate(pieces, axis=axis)

    def _send(self, where: _Where) -> None:
        first_row = self._groups[where][0][0]
        self._copy(where, self._joined_rows(where), first_row)

    def _copy(self, where: _Where, piece: Any, first_row: int | None) -> None:
        if isinstance(piece, jax.Array):
            piece.copy_to_host_async()
        self._copying.append((where, piece, (*self._slice, first_row)))


def _parts(result: Any) -> list[tuple[int, str, Any]]:
    """(part, key, array) of a function's result: a tuple of results (a function that
    joins calls), each a mapping of arrays or one array (key "out")."""
    parts = result if isinstance(result, tuple) else (result,)
    return [
        (j, key, x)
        for j, part in enumerate(parts)
        for key, x in (part.items() if isinstance(part, Mapping) else [("out", part)])
    ]


def _rebuilt(result: Any, n: int, arrays: Mapping[_Where, Any]) -> Any:
    """``result``'s structure (a chunk's) with the gathered whole-case arrays of function ``n``."""

    def one(j: int, part: Any) -> Any:
        if isinstance(part, Mapping):
            return {key: arrays[n, j, key] for key in part}
        return arrays[n, j, "out"]

    return tuple(one(j, p) for j, p in enumerate(result)) if isinstance(result, tuple) else one(0, result)


def _chunked(
    chunk_oracle: Callable[..., Any],
    functions: Sequence[Callable[..., Any]],
    case: Case,
    rows: int,
    rests: list[list[Any]],
    gathered: _Gathered,
    where: tuple[int | None, int | None],
) -> list[Any]:
    """Each of ``functions`` ``fn(case, chunk, *rest)`` over the query rows of the slice
    ``case`` (``where``: its batch row and kv head), ``rows`` at a time, with each
    chunk's oracle ``chunk_oracle(case, first_row, rows, keys)`` computed once for all
    of them: per function, the chunks' rows put in ``gathered``, their ``RowSums``
    added and, once finished, put there too. Returns each function's last result (its
    structure)."""
    # placed once: every chunk's program reads the same device copies
    case = Case(numeric.placed(dict(case.arrays)), case.params)
    seq_q, seq_kv = case.arrays["q"].shape[1], case.arrays["k"].shape[1]
    sums: dict[_Where, attention_oracle.RowSums] = {}
    last: list[Any] = [None for _ in functions]
    gathered.begin(*where)
    for first in range(0, seq_q, rows):
        size = min(rows, seq_q - first)
        keys = _visible_keys(seq_q, seq_kv, first, size) if case.params["causal"] else None
        ref = chunk_oracle(case, np.asarray(first, np.int32), size, keys)
        outs = [fn(case, ref, *rest) for fn, rest in zip(functions, rests, strict=True)]
        gathered.settle()  # the copies started before this chunk, done while it computed
        for n, out in enumerate(outs):
            last[n] = out
            for j, key, x in _parts(out):
                if isinstance(x, attention_oracle.RowSums):
                    total = sums.get((n, j, key))
                    sums[n, j, key] = x if total is None else jax.tree_util.tree_map(operator.add, total, x)
                else:
                    gathered.rows_of((n, j, key), first, x)
    for at, total in sums.items():
        gathered.whole_of(at, total.finish())
    gathered.end()
    return last


_Request = tuple[device_programs.LayoutProgram, tuple[Any, ...]]


def _joined(
    requests: list[_Request], joins: Mapping[Any, int]
) -> tuple[list[_Request], Callable[[list[Any]], list[Any]]]:
    """The calls of a function that joins (``per_slice(fn, joins=i)``: its ``rest[i]`` is
    a tuple of options, its result a tuple of one result per option) that agree on every
    other argument (the same arrays, equal statics) made one call, their options in the
    order of their ``repr`` (not of the threads' asking: one program serves every case
    of the layout); returns the calls, and the function that splits their results back
    into the results of ``requests``."""
    calls: list[_Request] = []
    members: dict[int, list[int]] = {}  # a joint call: the requests it serves
    joint: dict[Any, int] = {}
    where: list[tuple[int, int | None, int]] = []  # per request: its call, and its options' span there
    for k, (fn, rest) in enumerate(requests):
        at = joins.get(fn)
        if at is None:
            where.append((len(calls), None, 0))
            calls.append((fn, rest))
            continue
        others = tuple(id(r) if layout_programs.holds_arrays(r) else r for i, r in enumerate(rest) if i != at)
        n = joint.setdefault((fn, others), len(calls))
        if n == len(calls):
            calls.append((fn, rest))
        members.setdefault(n, []).append(k)
        where.append((n, 0, len(rest[at])))
    for n, served in members.items():
        fn, rest = calls[n]
        at = joins[fn]
        options: tuple[Any, ...] = ()
        for k in sorted(served, key=lambda k: repr(requests[k][1][at])):
            where[k] = (n, len(options), where[k][2])
            options += tuple(requests[k][1][at])
        calls[n] = (fn, rest[:at] + (options,) + rest[at + 1 :])

    def split(results: list[Any]) -> list[Any]:
        return [results[n] if start is None else results[n][start : start + count] for n, start, count in where]

    return calls, split


def sliced(
    oracle: Callable[[Case], Any], expected: Callable[[Any], Any]
) -> tuple[Callable[[Case], Any], Callable[[Any], Any], Callable[..., Callable[..., Any]]]:
    """Wrappers of the spec functions that slice a large case on the device: returns
    (oracle, expected, per_slice) where ``per_slice(fn)`` wraps a bound function
    ``fn(case, ref, *rest)`` (a ``grads`` mapping in ``rest`` is sliced too). The calls
    made with one sliced case are served in shared passes (``Sliced.passes``): each
    slice's or chunk's oracle is computed once per pass, as its own program, and fed to
    every function of the pass, each its own program (so a function's results do not
    depend on which others share its pass). ``per_slice(fn, joins=i)``: ``fn``'s
    ``rest[i]`` is a tuple of options and its result a tuple of one result per option;
    the calls a pass serves that differ only there are one call, one program (a result
    the same as alone, up to float64 reassociation where ``fn`` shares work)."""

    whole_oracle = device_programs.per_layout(oracle)

    def chunk_oracle(case: Case, first_row: Any, rows: int, keys: int | None) -> Any:
        ref = oracle(_chunk_case(case, first_row, rows, keys))
        bias = case.arrays.get("bias")
        seq_q, seq_kv = case.arrays["q"].shape[1], case.arrays["k"].shape[1]
        return attention_oracle.chunk(
            ref, first_row, seq_q, None if bias is None else tuple(bias.shape), None if keys is None else seq_kv
        )

    chunk_program = device_programs.per_layout(chunk_oracle)
    compiled_ahead: set[Any] = set()  # the pass layouts whose programs ``compile_ahead`` compiled

    def compile_ahead(
        functions: list[device_programs.LayoutProgram], case: Case, rows: int | None, rests: list[list[Any]]
    ) -> None:
        """Compile every program a pass over slices like ``case`` runs (its oracle's and
        each function's, for every chunk layout: up to eight key prefixes and a shorter
        last chunk) at once, on threads, before it runs them one after another: a
        pass's first case compiles as the runner's threads did when each function was
        a call of its own. Once per pass layout."""
        statics = tuple(tuple(r for r in rest if not layout_programs.holds_arrays(r)) for rest in rests)
        arrays = tuple((name, a.shape, str(a.dtype)) for name, a in case.arrays.items())
        signature = (arrays, tuple(sorted(case.params.items())), rows, tuple(map(id, functions)), statics)
        if signature in compiled_ahead:
            return
        seq_q, seq_kv = case.arrays["q"].shape[1], case.arrays["k"].shape[1]
        first = jax.ShapeDtypeStruct((), np.int32)
        jobs: list[Callable[[], None]] = []
        for size in {seq_q} if rows is None else {min(rows, seq_q - f) for f in range(0, seq_q, rows)}:
            all_keys: list[int | None] = [None]
            if rows is not None and case.params["causal"]:
                all_keys = [
                    _visible_keys(seq_q, seq_kv, f, size) for f in range(0, seq_q, rows) if min(rows, seq_q - f) == size
                ]
            for keys in set(all_keys):
                if rows is None:
                    ref = jax.eval_shape(lambda a: oracle(Case(a, case.params)), dict(case.arrays))
                    jobs.append(functools.partial(whole_oracle.ahead, case))
                else:
                    ref = jax.eval_shape(
                        lambda a, f, size=size, keys=keys: chunk_oracle(Case(a, case.params), f, size, keys),
                        dict(case.arrays),
                        first,
                    )
                    jobs.append(functools.partial(chunk_program.ahead, case, first, size, keys))
                jobs += [
                    functools.partial(fn.ahead, case, ref, *rest) for fn, rest in zip(functions, rests, strict=True)
                ]
        device = numeric.active_device()

        def on_device(job: Callable[[], None]) -> None:
            with numeric.on_device(device):
                job()

        with concurrent.futures.ThreadPoolExecutor(min(len(jobs), 16), thread_name_prefix="pallascheck-ahead") as pool:
            for done in [pool.submit(on_device, job) for job in jobs]:
                done.result()
        compiled_ahead.add(signature)

    joining: dict[device_programs.LayoutProgram, int] = {}  # ``per_slice(fn, joins=i)``: fn's program, i

    def serve(plan: Sliced, asked: list[_Request]) -> list[Any]:
        """One pass over ``plan``'s slices (and chunks) for every request
        (``fn(case, ref, *rest)``, compiled per layout; the requests of a function that
        joins, one call: ``_joined``)."""
        requests, split = _joined(asked, joining)
        case = plan.case
        group = case.arrays["q"].shape[2] // case.arrays["k"].shape[2]
        functions: list[device_programs.LayoutProgram] = [fn for fn, _ in requests]
        gathered = _Gathered(plan, numeric.holds_results())  # a chunked case's results
        parts: list[list[Any]] = [[] for _ in requests]  # unchunked: per function, its slices' results
        last: list[Any] = []
        for s, (i, j) in enumerate(plan.slices):
            sub = _sub_case(case, i, j)
            rests = [
                [_slice_grads(r, i, j, group) if isinstance(r, Mapping) else r for r in rest] for _, rest in requests
            ]
            if s == 0:  # every slice has the first one's layout
                compile_ahead(functions, sub, plan.rows, rests)
            if plan.rows is not None:
                last = _chunked(chunk_program, functions, sub, plan.rows, rests, gathered, (i, j))
                continue
            ref = whole_oracle(sub)
            for n, (fn, rest) in enumerate(zip(functions, rests, strict=True)):
                parts[n].append(fn(sub, ref, *rest))
        if plan.rows is not None:
            gathered.finish()
            return split([_rebuilt(result, n, gathered.arrays) for n, result in enumerate(last)])

        def assembled(part: list[Any]) -> Any:  # one function's results, per slice
            if isinstance(part[0], tuple):
                return tuple(assembled([p[j] for p in part]) for j in range(len(part[0])))
            if isinstance(part[0], Mapping):
                return {k: _assemble(plan, [p[k] for p in part], k) for k in part[0]}
            return _assemble(plan, part, "out")

        return split([assembled(part) for part in parts])

    def sliced_oracle(case: Case) -> Any:
        plan = _plan(case)
        if plan is None:
            return whole_oracle(case)
        # the plan serves its own passes (a pass reads only the plan's case and layout)
        return dataclasses.replace(plan, passes=device_programs.SharedPasses(lambda requests: serve(plan, requests)))

    def expected_of(case: Case, ref: Any) -> Any:
        return expected(ref)

    def per_slice(fn: Callable[..., Any], joins: int | None = None) -> Callable[..., Any]:
        whole = device_programs.per_layout(fn)
        if joins is not None:
            joining[whole] = joins

        def run(case: Case, ref: Any, *rest: Any) -> Any:
            if not isinstance(ref, Sliced):
                return whole(case, ref, *rest)
            if ref.passes is None:  # a plan made outside ``sliced_oracle``: a pass of its own
                return serve(ref, [(whole, rest)])[0]
            return ref.passes.ask((whole, rest))

        return run

    expected_per_slice = per_slice(expected_of)

    def sliced_expected(ref: Any) -> Any:
        return expected_per_slice(ref.case, ref) if isinstance(ref, Sliced) else expected(ref)

    return sliced_oracle, sliced_expected, per_slice
