"""Block indices in bounds: what the interpreters do not check.

A BlockSpec's index map returns, for each grid point, the index of the block each
operand gives the kernel. On a GPU or TPU a block index past the array's last block
reads or writes memory beyond the array. The interpreters clamp it to the last block
instead (dynamic-slice semantics), so an index map that is off by one along an axis
of one block runs correctly there and the bug never shows on the CPU.
``check_block_indices`` evaluates every index map over the whole grid and raises
where one leaves the array's blocks; ``Backend.pallas_call`` runs it in the
interpreters before each call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import pallas as pl


def _leaves(tree: Any) -> list[Any]:
    """The BlockSpecs (None: the whole array) or arrays of a pallas_call argument, in order."""
    return jax.tree.leaves(tree, is_leaf=lambda x: x is None or isinstance(x, pl.BlockSpec))


def _block_size(block: Any) -> int | None:
    """Elements per block index along one axis: an int block, or 1 for a squeezed
    (None) axis. Other block kinds (``pl.Element``, ``pl.BoundedSlice``, ...) index
    by element offset, not block: None, not checked here."""
    if block is None:
        return 1
    return block if isinstance(block, int) else None


def check_block_indices(
    name: str, grid: Sequence[int], in_specs: Any, out_specs: Any, operands: Sequence[Any], out_shape: Any
) -> None:
    """Raise ``IndexError`` where a BlockSpec of ``in_specs`` (for ``operands``) or
    ``out_specs`` (for ``out_shape``) maps a point of ``grid`` to a block index
    outside ``[0, cdiv(dim, block))``, naming the kernel, operand, axis and grid point."""
    grid = tuple(int(n) for n in grid)
    points = np.meshgrid(*(np.arange(n, dtype=np.int32) for n in grid), indexing="ij")
    for role, specs, arrays in (("input", in_specs, operands), ("output", out_specs, out_shape)):
        for position, (spec, array) in enumerate(zip(_leaves(specs), _leaves(arrays))):
            if spec is None or spec.block_shape is None or spec.index_map is None:
                continue
            # the kernels' pallas_calls are traced under jit: evaluate the map on the
            # concrete grid, not into the trace
            with jax.ensure_compile_time_eval():
                indices = spec.index_map(*points)
            for axis, (block, index) in enumerate(zip(spec.block_shape, indices)):
                size = _block_size(block)
                if size is None:
                    continue
                blocks = math.ceil(array.shape[axis] / size)
                index = np.broadcast_to(np.asarray(index), grid)
                outside = (index < 0) | (index >= blocks)
                if outside.any():
                    at = tuple(int(i) for i in np.argwhere(outside)[0])
                    raise IndexError(
                        f"{name}: the BlockSpec of {role} {position} maps grid point {at} (grid {grid}) to block "
                        f"index {int(index[at])} along axis {axis}, outside its {blocks} block(s) "
                        f"({array.shape[axis]} elements in blocks of {size}); the interpreter clamps it to the "
                        f"last block, a GPU or TPU reads or writes past the array"
                    )
