"""Exact top-k over the last axis of ``logits[tokens, vocab]``, blockwise, in Pallas.

``top_k(logits, k)`` returns ``(values[tokens, k], indices[tokens, k] int32)`` equal to
``jax.lax.top_k`` on the CPU, bit for bit, including ties and non-finite values.

Semantics (the order every output follows, descending):
- the order is the IEEE-754 *total order* on the input's bit patterns:
  +NaN (larger payload first) > +inf > finite values > +0.0 > -0.0 > -inf > -NaN
  (larger payload last). This is what ``lax.top_k`` does on the CPU (measured with
  jax 0.10.2 for f32, bf16 and f16): NaN is not dropped, a positive NaN ranks
  first, a negative one last, and +0.0 ranks above -0.0;
- equal bit patterns (ties) are broken by the lower vocab index first, on every
  backend. ``lax.top_k`` does the same on the CPU and on the GPU (measured on an H200
  with jax 0.11.2, f32/bf16/f16, vocab 37 to 201088, k 1 to 64: all-equal rows and
  rows of 3 or 4 distinct values give the lowest indices first, as on the CPU);
- ``values[t, j] == logits[t, indices[t, j]]`` exactly: values are gathered from the
  input by the indices, never recomputed.
- One documented difference: for bf16 only, ``lax.top_k`` on the CPU treats every NaN
  of one sign as equal (ties by index) and returns the canonical NaN 0x7FC0/0xFFC0;
  this kernel orders bf16 NaN payloads like f32/f16 ones and returns the input's bits.
  For the canonical NaN (what arithmetic produces) both agree on the CPU. On the GPU
  (H200, jax 0.11.2) ``lax.top_k`` returns *every* bf16 NaN as 0x7FFF, a -NaN too
  (it still ranks a -NaN last and returns its index): the sign and payload of a bf16
  NaN are lost in its values, not in its order. f32/f16 NaNs keep their bits there.

Total-order key: the input's bits as a signed integer ``b`` (int32 for f32; int16
sign-extended to int32 for bf16/f16), mapped to ``b if b >= 0 else b ^ 0x7F..F``. The
kernels see only these integer bits (``logits`` is bitcast before the call, the values
are gathered as bits and bitcast back): no float op ever touches a value, so no NaN
is quieted or canonicalised on the way (XLA's CPU backend does that to bf16 NaNs in
selects and gathers). Keys compare as integers exactly as the total order above; an element is the pair
(key, index), and pair A beats pair B when ``A.key > B.key`` or the keys are equal and
``A.index < B.index``. All pairs of a row are distinct, so every "largest" is unique.

Algorithm (two Pallas kernels):

1. Superset kernel (grid over blocks of ``config.block_tokens`` tokens). The vocab is
   split into ``B = config.num_blocks`` strided blocks: block ``j`` holds the indices
   ``j, j + B, j + 2B, ...``; the vocab is read in ``R = cdiv(vocab, B)`` chunks of
   ``B`` consecutive entries, one lane per block. Each block keeps its top-``m`` pairs
   in ``m`` sorted slots, updated per chunk by an insertion: the new pair beats a
   suffix of the slots (they are sorted); slot s takes slot s-1 inside that suffix,
   and the new pair at its top. Entries past the vocab (the last chunk's padding) and token
   rows past the end become the sentinel pair (INT32_MIN, INT32_MAX), which loses to
   every real pair, so it can never enter the top k (``k <= vocab`` is required).
   Stages run for each ``m`` of ``config.m_schedule`` below ``k``, then ``m = k``:
   - stopping criterion at stage ``m``: let P be the largest of the blocks' m-th
     pairs. Every entry outside the blocks' top-(m-1) slots is at most its block's
     m-th pair, hence at most P. If at least k candidate pairs (top-(m-1) slots) beat
     P, the k largest pairs of the row are all candidates. Comparing *pairs* (not
     values with ``>=``) is what keeps ties exact: with ``value >= P`` an entry equal
     to P in another block, with a lower index, could be missed;
   - stage ``m = k`` needs no criterion: every global top-k entry is in its own
     block's top k;
   - a token row that satisfies the criterion records ``m - 1`` (``k`` at the last
     stage) as its candidate slot count; the next stage runs only while some row of
     the token block has not stopped. Top-m slots in the total order are prefixes of
     top-m' slots (m < m'), so a later stage's candidates contain an earlier one's.
   The candidates (``S = next_pow2(k)`` slots of B pairs per token; a stage writes
   only its kept slots) and the per-token slot counts are written out. A row that
   stopped at an earlier stage may have a later stage's deeper slots written over its
   own: its first ``count`` slots are unchanged by that (prefixes, above).
   On ``tpu``/``tpu_interpret`` the stop state lives in SMEM scalars (per-token
   counts and a done-counter, as on a TPU the scalar core branches); elsewhere it is
   a vector and the branch reduces it (``config.stop_state`` picks either on the
   interpreters, which run both: the CPU checks the TPU's form too).
2. Selection kernel on the candidates, compiled for each candidate width
   ``c * B`` with ``c`` a power of two; ``lax.switch`` on the largest per-token count
   picks one. Columns past a row's own ``count * B`` become the sentinel on load
   (never written for that row, or deeper slots it does not need). It extracts the k
   largest pairs one at a time (max key, then min index among those keys; the
   extracted pair becomes the sentinel): no sort, so it lowers on Triton.

Why the TPU notebook this follows failed its own check ("All topk_logits match =
False. Indices match at 0%"): it packs value and row as ``((value >> 16) << 16) &
(row >> 16)``, ``&`` where ``|`` was meant, and ``row >> 16`` is 0 for every row below
2**16, so every packed key is 0: all entries tie and it returned zeros at indices
0..k-1. Had the packing been right, two more bugs were waiting: float bits compared
as signed integers rank negative values in reverse (the key map above fixes that),
and its stopping criterion counts *values* ``>=`` the pivot, which keeps the values
right but can miss a lower-index tie in another block. Its conclusion that bf16 ties
make indices uncheckable is wrong too: with a stated tie rule every index is exact.
All three are test variants (tests/broken/top_k_variants.py).

Triton: every tile is a power of two (``B``, ``block_tokens``, ``S * B``); the padded
vocab ``R * B`` and the token tail are masked on load (kernels/block_io.py) and the
token tail on store. The ``stacked`` layout slices register tiles, which Triton cannot
lower: ``top_k`` refuses it on the gpu backend.

Compile time on Triton is the cost of the unrolled slots and grows steeply with the
deepest stage (m = k); run time does not. Measured on an H200 (jax 0.11.2), superset
kernel at block_tokens 1: k=16 ~1 s, k=33 ~7 s (vocab 1000), k=64 ~45-50 s (vocab
201088, 4 warps or any other count), k=128 ~45 s (B = 32); the selection kernels
take under 1 s each. Every stage stores only its kept slots: storing all
``next_pow2(k)`` slots per stage (sentinels past the count) made k=33 take ~27 s.
One compile serves every call of the same (shape, k, config).
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
from jax.experimental.pallas import tpu as pltpu

from pallascheck.kernels import block_io, validation
from pallascheck.kernels.backends import Backend, get_backend

SENTINEL_KEY = -(2**31)  # INT32_MIN: ties with the key of one -NaN ...
SENTINEL_INDEX = 2**31 - 1  # ... whose real index is smaller, so the sentinel still loses
LAYOUTS = ("auto", "stacked", "unrolled")
STOP_STATES = ("auto", "scalars", "vector")
MAX_K = 1024  # the candidate tiles are next_pow2(k) * num_blocks wide
# The interpreters compile the unrolled layout's m slot updates one by one: at
# vocab 300, B = 8, 0.7 s at k = 5 and 3.4 s at k = 33 (the stacked layout: 0.5 s),
# so the CPU checks it on the k up to this.
UNROLLED_INTERPRETED_MAX_K = 8


@dataclasses.dataclass(frozen=True)
class Config:
    num_blocks: int = 128  # B: strided vocab blocks, one lane each
    m_schedule: tuple[int, ...] = (5, 9, 17, 33)  # slots per stage; m - 1 candidates if it stops
    block_tokens: int = 8  # token rows per program
    num_warps: int = 4  # GPU only
    layout: str = "auto"  # slot layout (see Slots): auto = unrolled on gpu, else stacked
    # where the stop state lives: auto = SMEM scalars on tpu/tpu_interpret, else a vector
    # (_superset_kernel); the interpreters run either, so the CPU checks both
    stop_state: str = "auto"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"config.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.stop_state not in STOP_STATES:
            raise ValueError(f"config.stop_state must be one of {STOP_STATES}, got {self.stop_state!r}")
        validation.require_positive_power_of_two("config.num_blocks", self.num_blocks)
        validation.require_positive_power_of_two("config.block_tokens", self.block_tokens)
        validation.require_positive_power_of_two("config.num_warps", self.num_warps)
        if isinstance(self.m_schedule, list):  # a config read back from JSON (replay)
            object.__setattr__(self, "m_schedule", tuple(self.m_schedule))
        schedule = self.m_schedule
        if (
            not isinstance(schedule, tuple)
            or not all(isinstance(m, int) and m >= 2 for m in schedule)
            or list(schedule) != sorted(set(schedule))
        ):
            raise ValueError(f"config.m_schedule must be a strictly increasing tuple of ints >= 2, got {schedule!r}")


def configs(tokens: int, vocab: int, k: int, backend: str | Backend | None = None) -> list[Config]:
    """Configs worth comparing for this shape: block counts, m schedules, token blocks."""
    be = get_backend(backend)
    if be.is_triton:
        # Short rows also get few blocks: deep slots, several stages, and stops with
        # ties at the pivot across blocks (with 128 blocks of 2 or 3 entries the
        # criterion is rarely tested). Long rows: only the production block counts.
        short = [Config(8, (2, 3, 5), 1), Config(32, (4,), 2)] if vocab <= 4096 else []
        return short + [Config(128, (5, 9, 17, 33), bt) for bt in (1, 2, 4)] + [Config(256, (3, 5, 9, 17), 1)]
    # Few blocks first (deep slots, several stages); the unrolled layout is the GPU's.
    small = [Config(8, (2, 3, 5), 1, layout="unrolled")] if k <= UNROLLED_INTERPRETED_MAX_K else []
    return [Config(8, (2, 3, 5), 1), Config(8, (3,), 2), Config(32, (4,), 2), Config()] + small


def default_config(backend: str | Backend | None = None) -> Config:
    """Config() everywhere but the GPU, where one token per program keeps the unrolled
    slots of the deepest stage (2k tiles of 128 int32) closer to the register file."""
    return Config(block_tokens=1) if get_backend(backend).is_triton else Config()


def forms(config: Config, backend: str | Backend | None = None) -> tuple[bool, bool]:
    """(stacked slots, stop state in SMEM scalars): what ``config`` runs on ``backend``."""
    be = get_backend(backend)
    stacked = config.layout == "stacked" or (config.layout == "auto" and not be.is_triton)
    scalars = config.stop_state == "scalars" or (config.stop_state == "auto" and be.name in ("tpu", "tpu_interpret"))
    return stacked, scalars


def stages(k: int, m_schedule: tuple[int, ...]) -> tuple[int, ...]:
    """The slot counts m that the superset kernel runs: the schedule below k, then k."""
    return tuple(m for m in m_schedule if m < k) + (k,)


def candidate_slots(m: int, k: int) -> int:
    """Candidate slots kept when stage ``m`` stops: its top-(m-1), or all k at m = k."""
    return k if m == k else m - 1


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def bits_of(logits: jax.Array) -> jax.Array:
    """The float's bits as a same-width signed integer (a free reinterpretation)."""
    return lax.bitcast_convert_type(logits, jnp.int32 if logits.dtype.itemsize == 4 else jnp.int16)


def total_order_keys(bits: jax.Array) -> jax.Array:
    """int32 keys that order like the IEEE total order of the floats with these bits
    (int32 bits of f32, int16 bits of bf16/f16; see the module docstring)."""
    flip = 0x7FFFFFFF if bits.dtype.itemsize == 4 else 0x7FFF
    bits = bits.astype(jnp.int32)  # sign-extending int16 bits keeps their order
    return jnp.where(bits < 0, bits ^ flip, bits)


def beats(key_a, index_a, key_b, index_b):
    """Pair a ranks above pair b: larger key, or the same key and a lower index."""
    return (key_a > key_b) | ((key_a == key_b) & (index_a < index_b))


def largest_pair(keys, indices):
    """The largest pair along the last axis (keepdims): max key, then the lowest
    index holding it."""
    key = jnp.max(keys, axis=-1, keepdims=True)
    index = jnp.min(jnp.where(keys == key, indices, SENTINEL_INDEX), axis=-1, keepdims=True)
    return key, index


class Slots:
    """Each block's top-m pairs, sorted, slot 0 the largest, in one of two layouts:

    - stacked (interpreters, TPU): ``keys``/``indices`` are arrays [m, bt, B]; one
      insertion is a handful of whole-array ops (a shift by one slot where the new
      pair wins), so the compiled size does not grow with m;
    - unrolled (Triton, which has no slicing or concatenation of register tiles):
      tuples of m arrays [bt, B]; one insertion is the same update slot by slot.
    Both give the same slots; tests run both layouts on the CPU.
    """

    def __init__(self, keys, indices):
        self.keys, self.indices = keys, indices

    @staticmethod
    def empty(m: int, shape: tuple[int, int], stacked: bool) -> Slots:
        key = jnp.full(shape, SENTINEL_KEY, jnp.int32)
        index = jnp.full(shape, SENTINEL_INDEX, jnp.int32)
        if stacked:
            return Slots(jnp.broadcast_to(key, (m,) + shape), jnp.broadcast_to(index, (m,) + shape))
        return Slots((key,) * m, (index,) * m)

    @property
    def stacked(self) -> bool:
        return not isinstance(self.keys, tuple)

    def insert(self, key, index) -> Slots:
        """Insert one pair per lane; the smallest pair falls off the end."""
        if self.stacked:
            win = beats(key[None], index[None], self.keys, self.indices)  # F..F T..T
            above = jnp.concatenate([jnp.zeros_like(win[:1]), win[:-1]], axis=0)

            def shifted(old, new):  # slot s takes slot s-1 below the insertion point
                down = jnp.concatenate([old[:1], old[:-1]], axis=0)
                return jnp.where(win, jnp.where(above, down, new[None]), old)

            return Slots(shifted(self.keys, key), shifted(self.indices, index))
        # The stacked update written per slot: every compare reads the old slots, so
        # the m updates are independent (a sinking compare-exchange would chain them,
        # and Triton's compile time grows steeply with that chain's length).
        wins = [beats(key, index, k_s, i_s) for k_s, i_s in zip(self.keys, self.indices)]

        def shifted_each(old, new):
            return tuple(
                jnp.where(wins[s], jnp.where(wins[s - 1], old[s - 1], new) if s else new, old[s])
                for s in range(len(old))
            )

        return Slots(shifted_each(self.keys, key), shifted_each(self.indices, index))

    def slot(self, s: int):
        return self.keys[s], self.indices[s]

    def count_beating(self, slots: int, key, index):
        """Per row (keepdims), how many pairs in slots [0, slots) beat (key, index)."""
        if self.stacked:
            wins = beats(self.keys[:slots], self.indices[:slots], key[None], index[None])
            return jnp.sum(jnp.sum(wins.astype(jnp.int32), axis=0), axis=-1, keepdims=True)
        count = jnp.zeros(key.shape, jnp.int32)
        for s in range(slots):
            wins = beats(self.keys[s], self.indices[s], key, index)
            count += jnp.sum(wins.astype(jnp.int32), axis=-1, keepdims=True)
        return count


def stops(slots: Slots, m: int, k: int):
    """Stage m's criterion per token row, shape (block_tokens, 1): at least k of the
    top-(m-1) slots' pairs beat the largest m-th pair over the blocks."""
    pivot_key, pivot_index = largest_pair(*slots.slot(m - 1))
    return slots.count_beating(m - 1, pivot_key, pivot_index) >= k


@dataclasses.dataclass(frozen=True)
class Parts:
    """The swappable pieces of the algorithm (test variants replace one each)."""

    keys: Callable[[jax.Array], jax.Array] = total_order_keys
    stops: Callable[..., jax.Array] = stops
    candidate_slots: Callable[[int, int], int] = candidate_slots
    mask_vocab_tail: bool = True


def _superset_kernel(
    bits_ref,
    cand_key_ref,
    cand_index_ref,
    count_ref,
    *scratch,
    tokens: int,
    vocab: int,
    k: int,
    num_blocks: int,
    schedule: tuple[int, ...],
    parts: Parts,
    masked_io: bool,
    stacked: bool,
    smem_state: bool,
):
    bt, padded = bits_ref.shape
    slots_out = cand_key_ref.shape[1] // num_blocks
    rows = pl.program_id(0) * bt + lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    row_ok = rows < tokens
    lane = lax.broadcasted_iota(jnp.int32, (1, num_blocks), 1)

    def block_top(m: int) -> Slots:
        def chunk(r, carry):
            start = pl.multiple_of(r * num_blocks, num_blocks)
            cols = start + lane
            # unmasked (a test variant), the load reads past the vocab what the block holds there
            ok = row_ok & ((cols < vocab) | (not parts.mask_vocab_tail))
            x = block_io.load(bits_ref.at[:, pl.ds(start, num_blocks)], ok, masked_io=masked_io)
            key = jnp.where(ok, parts.keys(x), SENTINEL_KEY)
            index = jnp.where(ok, jnp.broadcast_to(cols, key.shape), SENTINEL_INDEX)
            slots = Slots(*carry).insert(key, index)
            return slots.keys, slots.indices

        empty = Slots.empty(m, (bt, num_blocks), stacked)
        return Slots(*lax.fori_loop(0, padded // num_blocks, chunk, (empty.keys, empty.indices)))

    def write_candidates(slots: Slots, count: int):
        """Slots [0, count) only: the selection masks every column past a row's own
        count, so nothing past it is ever read (one store per kept slot, not per
        output slot: on Triton each store is unrolled code)."""
        if stacked:  # one store: slot s at columns [s*B, (s+1)*B)

            def flat(stack):
                kept = jnp.transpose(stack[:count], (1, 0, 2)).reshape(bt, count * num_blocks)
                fill = jnp.zeros((bt, (slots_out - count) * num_blocks), jnp.int32)
                return jnp.concatenate([kept, fill], axis=1)

            cand_key_ref[...] = flat(slots.keys)
            cand_index_ref[...] = flat(slots.indices)
            return
        for s in range(count):
            cols = pl.ds(s * num_blocks, num_blocks)
            block_io.store(cand_key_ref.at[:, cols], slots.keys[s], row_ok, masked_io=masked_io)
            block_io.store(cand_index_ref.at[:, cols], slots.indices[s], row_ok, masked_io=masked_io)

    if smem_state:  # per-token counts and the done-counter as SMEM scalars
        count_smem, done_smem = scratch
        for t in range(bt):
            count_smem[t] = 0

    def stage(i: int, counts):
        m = schedule[i]
        slots = block_top(m)
        count = parts.candidate_slots(m, k)
        write_candidates(slots, count)
        done = parts.stops(slots, m, k) if m < k else jnp.ones((bt, 1), jnp.bool_)
        done = done | ~row_ok  # rows past the end never hold the loop
        if smem_state:
            done_smem[0] = 0
            for t in range(bt):
                first = (count_smem[t] == 0) & done[t, 0]
                count_smem[t] = jnp.where(first, count, count_smem[t])
                done_smem[0] += (count_smem[t] != 0).astype(jnp.int32)
            row = lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
            counts = jnp.zeros((bt, 1), jnp.int32)
            for t in range(bt):
                counts = jnp.where(row == t, count_smem[t], counts)
            more = done_smem[0] < bt
        else:
            counts = jnp.where((counts == 0) & done, count, counts)
            more = jnp.min(counts) == 0  # an int reduction: Triton has no reduce_or
        block_io.store(count_ref, counts, row_ok, masked_io=masked_io)
        if i + 1 < len(schedule):
            pl.when(more)(lambda: stage(i + 1, counts))

    stage(0, jnp.zeros((bt, 1), jnp.int32))


def _select_kernel(
    key_ref, index_ref, count_ref, out_ref, *, tokens: int, k: int, num_blocks: int, parts: Parts, masked_io: bool
):
    bt, width = key_ref.shape
    rows = pl.program_id(0) * bt + lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    row_ok = rows < tokens
    counts = block_io.load(count_ref, row_ok, masked_io=masked_io)
    # A row's candidates are its first count * B columns (slot-major); the rest were
    # never written for this row (or hold a later stage's deeper slots, also unneeded).
    kept = row_ok & (lax.broadcasted_iota(jnp.int32, (bt, width), 1) < counts * num_blocks)
    keys = jnp.where(kept, block_io.load(key_ref, kept, masked_io=masked_io), SENTINEL_KEY)
    indices = jnp.where(kept, block_io.load(index_ref, kept, masked_io=masked_io), SENTINEL_INDEX)
    column = lax.broadcasted_iota(jnp.int32, out_ref.shape, 1)

    def extract(j, carry):
        keys, indices, out = carry
        key, index = largest_pair(keys, indices)
        taken = (keys == key) & (indices == index)
        return (
            jnp.where(taken, SENTINEL_KEY, keys),
            jnp.where(taken, SENTINEL_INDEX, indices),
            jnp.where(column == j, index, out),
        )

    out = jnp.zeros(out_ref.shape, jnp.int32)
    _, _, out = lax.fori_loop(0, k, extract, (keys, indices, out))
    block_io.store(out_ref, out, row_ok, masked_io=masked_io)


def _superset(bits, k: int, config: Config, backend: Backend, parts: Parts):
    """Per token: candidate pairs (slot-major, [tokens, next_pow2(k) * B]) and how many
    slots of them are kept ([tokens, 1])."""
    tokens, vocab = bits.shape
    nb, bt = config.num_blocks, config.block_tokens
    padded = pl.cdiv(vocab, nb) * nb
    slots_out = _next_pow2(k)
    schedule = stages(k, config.m_schedule)
    grid = (pl.cdiv(tokens, bt),)
    masked_io = backend.is_triton
    stacked, smem_state = forms(config, backend)
    scratch = [pltpu.SMEM((bt,), jnp.int32), pltpu.SMEM((1,), jnp.int32)] if smem_state else []
    cand_key, cand_index, counts = backend.pallas_call(
        functools.partial(
            _superset_kernel,
            tokens=tokens,
            vocab=vocab,
            k=k,
            num_blocks=nb,
            schedule=schedule,
            parts=parts,
            masked_io=masked_io,
            stacked=stacked,
            smem_state=smem_state,
        ),
        grid=grid,
        in_specs=[pl.BlockSpec((bt, padded), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((bt, slots_out * nb), lambda i: (i, 0))] * 2
        + [pl.BlockSpec((bt, 1), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((tokens, slots_out * nb), jnp.int32)] * 2
        + [jax.ShapeDtypeStruct((tokens, 1), jnp.int32)],
        scratch_shapes=scratch,
        num_warps=config.num_warps,
        dimension_semantics=("parallel",),
        name="pallascheck_top_k_superset",
    )(bits)
    return cand_key, cand_index, counts


def _select(cand_key, cand_index, counts, k: int, config: Config, backend: Backend, parts: Parts):
    """Top-k indices among each row's candidates, by a selection kernel as wide as the
    largest count needs (a power of two of slots: one compile per width)."""
    tokens = counts.shape[0]
    nb, bt = config.num_blocks, config.block_tokens
    slots_out = _next_pow2(k)
    grid = (pl.cdiv(tokens, bt),)

    def select(width_slots: int):
        def run(cand_key, cand_index, counts):
            spec = pl.BlockSpec((bt, width_slots * nb), lambda i: (i, 0))
            return backend.pallas_call(
                functools.partial(
                    _select_kernel, tokens=tokens, k=k, num_blocks=nb, parts=parts, masked_io=backend.is_triton
                ),
                grid=grid,
                in_specs=[spec, spec, pl.BlockSpec((bt, 1), lambda i: (i, 0))],
                out_specs=pl.BlockSpec((bt, slots_out), lambda i: (i, 0)),
                out_shape=jax.ShapeDtypeStruct((tokens, slots_out), jnp.int32),
                num_warps=config.num_warps,
                dimension_semantics=("parallel",),
                name="pallascheck_top_k_select",
            )(cand_key, cand_index, counts)

        return run

    widths = sorted({_next_pow2(parts.candidate_slots(m, k)) for m in stages(k, config.m_schedule)})
    needed = jnp.max(counts)
    branch = jnp.sum(jnp.asarray(widths, jnp.int32) < needed)  # the narrowest width >= needed
    return lax.switch(branch, [select(w) for w in widths], cand_key, cand_index, counts)[:, :k]


def _top_k_indices(bits, k: int, config: Config, backend: Backend, parts: Parts):
    cand_key, cand_index, counts = _superset(bits, k, config, backend, parts)
    return _select(cand_key, cand_index, counts, k, config, backend, parts), counts[:, 0]


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _top_k(logits, k, config, backend, parts):
    bits = bits_of(logits)
    indices, _ = _top_k_indices(bits, k, config, backend, parts)
    values = lax.bitcast_convert_type(jnp.take_along_axis(bits, indices, axis=1), logits.dtype)
    return values, indices


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def candidate_counts(logits, k: int, config: Config, backend: Backend) -> jax.Array:
    """Per token, the candidate slots the superset kernel kept (for tests and tuning)."""
    return _top_k_indices(bits_of(logits), k, config, backend, Parts())[1]


def validate(logits: Any, k: Any, config: Any) -> None:
    validation.require_array("logits", logits)
    validation.require_rank("logits", logits, 2, "; use jax.vmap(top_k) for more leading axes")
    validation.require_float_dtype("logits", logits.dtype)
    validation.require_nonempty("logits", tuple(logits.shape))
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= k <= min(logits.shape[1], MAX_K):
        raise ValueError(f"k must satisfy 1 <= k <= min(vocab, {MAX_K}), got k={k} for vocab {logits.shape[1]}")
    if not isinstance(config, Config):
        raise TypeError(f"config must be a top_k.Config, got {type(config).__name__}")


def top_k(
    logits: jax.Array,
    k: int,
    *,
    config: Config | None = None,
    backend: str | Backend | None = None,
    parts: Parts = Parts(),
) -> tuple[jax.Array, jax.Array]:
    """``(values, indices)`` of the k largest entries of each row of ``logits[tokens, vocab]``
    (f32, bf16 or f16), in descending total order, ties to the lower index; equal to
    ``jax.lax.top_k`` on the CPU bit for bit (see the module docstring)."""
    backend = get_backend(backend)
    config = default_config(backend) if config is None else config
    validate(logits, k, config)
    if backend.is_triton and config.layout == "stacked":
        raise ValueError(
            "config.layout 'stacked' does not lower on Triton (it slices register tiles); "
            "use 'auto' or 'unrolled' on the gpu backend"
        )
    if backend.is_triton and config.stop_state == "scalars":
        raise ValueError(
            "config.stop_state 'scalars' does not lower on Triton (it keeps the stop state in SMEM); "
            "use 'auto' or 'vector' on the gpu backend"
        )
    return _top_k(logits, k, config, backend, parts)


@functools.partial(jax.jit, static_argnums=(1,))
def xla_reference(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """What a user writes instead: ``jax.lax.top_k``."""
    return lax.top_k(logits, k)
