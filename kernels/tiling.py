"""Facts every config space uses: which block sizes are worth trying for a length,
how much shared memory one GPU block may hold, and the registers a
warp-specialised kernel leaves its memory warpgroup."""

from __future__ import annotations

# Per-block shared memory on H100/H200 (227 KiB). Triton keeps ``num_stages`` copies
# of each pipelined input tile there.
GPU_SHARED_MEMORY_BYTES = 227 * 1024
# an mbarrier (TMA arrivals, warpgroup hand-offs) is one 8-byte word of the same SMEM
MBARRIER_BYTES = 8
# Registers per thread a warp-specialised kernel's memory warpgroup keeps (it only
# issues TMA copies and counts steps): the rest go to the compute warpgroups.
MEMORY_WARPGROUP_REGISTERS = 40


def blocks_for(size: int, choices: tuple[int, ...]) -> tuple[int, ...]:
    """Block sizes worth trying for a length: never more than one block of pure padding."""
    return tuple(b for b in choices if b < 2 * max(size, 16)) or (min(choices),)


def require_shared_memory(config: object, need: int) -> None:
    """A config whose tiles need more shared memory than a GPU block has is refused."""
    if need > GPU_SHARED_MEMORY_BYTES:
        raise ValueError(f"config {config} needs {need} bytes of shared memory, more than {GPU_SHARED_MEMORY_BYTES}")
