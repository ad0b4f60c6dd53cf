"""Poisoned memory between calls: the device allocator's free memory filled with NaN, so
that an output tile a candidate never writes cannot inherit an earlier call's correct
result from a freed buffer.

Every byte is set to 0xFF: a NaN in f32, bf16, f16 and f64 alike (all exponent bits set,
a nonzero mantissa), whatever dtype later reads the buffer. Poison arrays are allocated
until no free block is left, then deleted: the allocator keeps their blocks in its pool
and hands them out to the next call's buffers. Every free block is filled, the small
ones between live buffers included: a best-fit allocator hands a small output exactly
such a block (often the previous call's own output, freed), so filling only the large
free region leaves the block an unwritten tile reads from holding an earlier result.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CHUNK_BYTES = 256 * 2**20
# The allocator's granularity (XLA's BFC allocator rounds every request up to 256 bytes):
# a free block smaller than this holds no buffer
SMALLEST_BYTES = 256
# At most this many poison arrays at once: 80 GB in 256 MiB chunks is ~320, and a pool
# fragmented into more free blocks than the rest is not worth a poison array each
MOST_CHUNKS = 4096

ON_CPU = (
    "poisoned free device memory between calls: the CPU has no device allocator pool to poison; "
    "Pallas' interpreter itself fills every output with NaN (integers with their minimum) before the "
    "kernel runs, so unwritten output tiles are shown, but not a read of another call's freed buffer "
    "(input_output_aliases, scratch): that needs a GPU"
)


def _filled(size: int, device: Any) -> jax.Array:
    """A device array of ``size`` 0xFF bytes: the full chunk from one compiled fill, a
    block of another size copied from the host (no compile per size)."""
    if size == CHUNK_BYTES:
        return jnp.full((CHUNK_BYTES,), 0xFF, jnp.uint8, device=device)
    return jax.device_put(np.full((size,), 0xFF, np.uint8), device)


def has_pool(device: Any) -> bool:
    """Whether ``device`` reports an allocator pool whose free blocks can be poisoned
    (not the CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return stats is not None and "largest_free_block_bytes" in stats


def poison_free_memory(device: Any) -> int | None:
    """Fill every free block of ``device``'s allocator with 0xFF bytes and free them
    again; the bytes poisoned, or None where the device reports no allocator (the CPU)."""
    if not has_pool(device):
        return None
    chunks: list[jax.Array] = []
    poisoned = 0
    while len(chunks) < MOST_CHUNKS:
        largest = int(device.memory_stats()["largest_free_block_bytes"])
        if largest < SMALLEST_BYTES:
            break
        size = min(CHUNK_BYTES, largest - largest % SMALLEST_BYTES)
        try:
            chunks.append(_filled(size, device))
        except Exception:  # noqa: BLE001 - the allocator is full sooner than it said: poisoned what fit
            break
        jax.block_until_ready(chunks[-1])  # its block taken before the next is asked for
        poisoned += size
    for chunk in chunks:
        chunk.delete()
    return poisoned
