"""Deliberately broken top-k kernels. Each runs the real kernels (kernels/top_k.py)
with one of its swappable ``Parts`` replaced, or (the flipped tie rule) on its input
reversed; the sensitivity test requires the bit-exact checks to catch each."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallascheck.kernels import top_k
from pallascheck.properties.families.top_k import make_spec


def _with(parts: top_k.Parts) -> Callable[..., Any]:
    return functools.partial(top_k.top_k, parts=parts)


def _higher_index_first(logits: jax.Array, k: int, **options: Any) -> tuple[jax.Array, jax.Array]:
    """Ties broken by the higher index: the kernel on each row reversed, its indices
    mapped back (a tie rule inside the kernel that prefers the higher index returns
    exactly these)."""
    values, indices = top_k.top_k(logits[:, ::-1], k, **options)
    return values, logits.shape[1] - 1 - indices


def _stops_on_values_at_least_pivot(slots: top_k.Slots, m: int, k: int) -> jax.Array:
    """The notebook's criterion: count candidate *values* >= the largest m-th value.
    An entry equal to that value, outside the candidates and with a lower index than
    a candidate, is then missed (values stay right, indices break the tie rule)."""
    pivot_key, _ = top_k.largest_pair(*slots.slot(m - 1))
    count = jnp.zeros(pivot_key.shape, jnp.int32)
    for s in range(m - 1):
        count += jnp.sum((slots.slot(s)[0] >= pivot_key).astype(jnp.int32), axis=-1, keepdims=True)
    return count >= k


def _raw_bit_keys(bits: jax.Array) -> jax.Array:
    """The notebook's order: float bits compared as signed integers, so negative
    values rank in reverse (-2 above -1)."""
    return bits.astype(jnp.int32)


def _and_packed_keys(bits: jax.Array) -> jax.Array:
    """The notebook's packing: ``((value >> 16) << 16) & (row >> 16)`` with ``&``
    where ``|`` was meant. For fewer than 2**16 rows per block ``row >> 16`` is 0, so
    every key is 0: all entries tie and the first k indices come out (its own check
    printed "All topk_logits match = False. Indices match at 0%")."""
    row_high_bits = jnp.zeros(bits.shape, jnp.int32)  # row index >> 16 for every row < 2**16
    return ((top_k.total_order_keys(bits) >> 16) << 16) & row_high_bits


_BROKEN: dict[str, Callable[..., Any]] = {
    # keeps top-(m-2) where the criterion proved top-(m-1) (k at the last stage is kept)
    "stops_one_m_early": _with(top_k.Parts(candidate_slots=lambda m, k: k if m == k else m - 2)),
    "tie_break_flipped": _higher_index_first,
    "criterion_on_values_at_least_pivot": _with(top_k.Parts(stops=_stops_on_values_at_least_pivot)),
    "vocab_tail_unmasked": _with(top_k.Parts(mask_vocab_tail=False)),
    "raw_bits_order": _with(top_k.Parts(keys=_raw_bit_keys)),
    "and_packed_keys": _with(top_k.Parts(keys=_and_packed_keys)),
}
EXAMPLES = 30
# The pieces replaced above see integer keys only, so one dtype shows each bug, except
# the key maps themselves: float32 (int32 bits) and bfloat16 (int16 bits, f16's path too).
_DTYPES = {"raw_bits_order": ("float32", "bfloat16"), "and_packed_keys": ("float32", "bfloat16")}

VARIANTS = {
    name: (make_spec(kernel, name=f"top_k[{name}]"), _DTYPES.get(name, ("float32",)), EXAMPLES)
    for name, kernel in _BROKEN.items()
}
