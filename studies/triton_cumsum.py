"""jnp.cumsum(axis=-1) inside a Triton Pallas kernel against float64: right where the
block is as wide as the array's rows, wrong where it is wider.

Measured on an H100 (jax 0.11.2, Triton backend), 4 rows, five runs a setting:

- the block as wide as the rows (n = 64 in 64-wide blocks, 128 in 128-wide ones, 1 or 4
  rows a block): err/scale ~2e-8, the same bits every run;
- n = 48 in (1, 64) blocks: err/scale 0.327 with the padding masked to 0, 0.0525
  without; in (4, 64) blocks right;
- n = 1000 in (1, 1024) and (4, 1024) blocks: err/scale 0.03 to 0.09, and 24 to 96
  elements differing over the five runs.

(err/scale: the largest |kernel - float64| over the largest running sum of |x|.) A
prefix sum of an element j < n cannot depend on the padding past n, so the fault is in
JAX's Triton lowering of the scan or in Triton's scan on a padded block, not in the
kernel: the gate's honest corpus keeps it as an expected finding
(tests/gate_corpus/honest.py, ``pallas_cumsum``), and ``pallas_cumsum_by_dot`` computes
the running sums as a dot instead. On a GPU:

    python -m studies.triton_cumsum
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# (n, block width): as wide as the row, and wider
SETTINGS = ((48, 64), (64, 64), (128, 128), (1000, 1024))
RUNS = 5


def _kernel(x_ref: Any, o_ref: Any, *, n: int, mask: bool) -> None:
    x = x_ref[...].astype(jnp.float32)
    if mask:
        x = jnp.where(jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) < n, x, 0.0)
    o_ref[...] = jnp.cumsum(x, axis=-1).astype(o_ref.dtype)


def scan(x: jax.Array, width: int, rows_per_block: int, mask: bool) -> jax.Array:
    """cumsum of each row of ``x`` in (rows_per_block, width) blocks."""
    rows, n = x.shape
    return pl.pallas_call(
        functools.partial(_kernel, n=n, mask=mask),
        grid=(rows // rows_per_block,),
        in_specs=[pl.BlockSpec((rows_per_block, width), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((rows_per_block, width), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, n), x.dtype),
    )(x)


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print("| n | block | padding masked | inputs | err/scale | elements differing over 5 runs |")
    print("|---|---|---|---|---|---|")
    for n, width in SETTINGS:
        for rows_per_block in (1, 4):
            for mask in (True, False):
                for kind in ("normal", "subnormal"):
                    x = rng.standard_normal((4, n)).astype(np.float32)
                    if kind == "subnormal":
                        x = (x * 1e-38).astype(np.float32)
                    want = np.cumsum(x.astype(np.float64), axis=-1)
                    outs = [np.asarray(scan(jnp.asarray(x), width, rows_per_block, mask)) for _ in range(RUNS)]
                    differ = sum(int((o.view(np.int32) != outs[0].view(np.int32)).sum()) for o in outs[1:])
                    err = max(float(np.max(np.abs(o - want))) for o in outs)
                    scale = float(np.max(np.cumsum(np.abs(x.astype(np.float64)), axis=-1)))
                    print(f"| {n} | ({rows_per_block}, {width}) | {mask} | {kind} | {err / scale:.3g} | {differ} |")


if __name__ == "__main__":
    main()
