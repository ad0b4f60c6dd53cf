"""Poisoned memory between calls: the device allocator's free memory filled with NaN, so
that an output tile a candidate never writes cannot inherit an earlier call's correct
result from a freed buffer.

Every byte is set to 0xFF: a NaN in f32, bf16, f16 and f64 alike (all exponent bits set,
a nonzero mantissa), whatever dtype later reads the buffer. The poison arrays are
allocated in chunks until the free memory the allocator reports is nearly used up, then
deleted: the allocator keeps their blocks in its pool and hands them out to the next
call's buffers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

CHUNK_BYTES = 256 * 2**20
# Left free for the candidate's own compile-time and launch allocations while poisoned.
HEADROOM_BYTES = 512 * 2**20

ON_CPU = (
    "poisoned free device memory between calls: the CPU has no device allocator pool to poison; "
    "Pallas' interpreter itself fills every output with NaN (integers with their minimum) before the "
    "kernel runs, so unwritten output tiles are shown, but not a read of another call's freed buffer "
    "(input_output_aliases, scratch): that needs a GPU"
)


def poison_free_memory(device: Any) -> int | None:
    """Fill ``device``'s free allocator memory with 0xFF bytes and free it again; the
    bytes poisoned, or None where the device reports no allocator (the CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)) - HEADROOM_BYTES
    chunks = []
    poisoned = 0
    while poisoned + CHUNK_BYTES <= free:
        try:
            chunks.append(jnp.full((CHUNK_BYTES,), 0xFF, jnp.uint8, device=device))
        except Exception:  # noqa: BLE001 - the allocator is full sooner than it said: poisoned what fit
            break
        poisoned += CHUNK_BYTES
    jax.block_until_ready(chunks)
    for chunk in chunks:
        chunk.delete()
    return poisoned
