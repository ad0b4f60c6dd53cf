"""Deliberately broken Mosaic GPU ring collectives (kernels/mosaic_gpu_collectives.py):
each runs the real kernel with one decision of its ``Ring`` changed. They need two
or more GPUs, so they run in a GPU child process (tests/test_gpu_collectives.py,
``--backend mosaic_gpu``); ``DEADLOCKS`` names those that must come back as a
timeout (``MAY_HANG``: those that may end either way), ``NEEDS_THREE`` those that a ring of two cannot show (on two devices the
left and right neighbour are one device, and a doubled signal has no later wait to
mislead).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallascheck.kernels import collectives
from pallascheck.kernels import mosaic_gpu_collectives as mgc
from pallascheck.kernels.backends import get_backend


def _all_gather(ring: mgc.Ring) -> Callable[..., jax.Array]:
    def run(x, *, mesh, axis, spec=None, config=None, backend=None):
        get_backend(backend).require_available()
        return collectives._gpu_all_gather_jit(x, mesh, axis, config or mgc.Config(), ring)

    return run


def _all_gather_matmul(ring: mgc.Ring) -> Callable[..., jax.Array]:
    def run(x, w, *, mesh, axis, out_dtype=None, config=None, backend=None):
        out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
        return collectives._gpu_all_gather_matmul_jit(x, w, mesh, axis, out_dtype, config or mgc.Config(), ring)

    return run


def _matmul_reduce_scatter(ring: mgc.Ring) -> Callable[..., jax.Array]:
    def run(x, w, *, mesh, axis, row_axis=None, out_dtype=None, config=None, backend=None):
        out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
        return collectives._gpu_matmul_reduce_scatter_jit(x, w, mesh, axis, out_dtype, config or mgc.Config(), ring)

    return run


def _ring(**changes: Any) -> mgc.Ring:
    return dataclasses.replace(mgc.RING, **changes)


VARIANTS: dict[str, tuple[str, Callable[..., jax.Array]]] = {
    # sends to the left neighbour while forwarding the slots a rightward ring forwards
    "all_gather_wrong_neighbour": ("all_gather", _all_gather(_ring(step=-1))),
    # forwards without waiting for the slot to arrive from the left
    "all_gather_missing_wait": ("all_gather", _all_gather(_ring(wait_forward=False))),
    # signals each step twice: a later wait passes before its slot has landed
    "all_gather_chunk_sent_twice": ("all_gather", _all_gather(_ring(signals=2))),
    # forwards the slot of the step before again (a stale slot)
    "all_gather_stale_slot": ("all_gather", _all_gather(_ring(forward_lag=1))),
    # the matmul reads a gathered slot without waiting for its boxes
    "all_gather_matmul_missing_wait": ("all_gather_matmul", _all_gather_matmul(_ring(wait_slot=False))),
    "all_gather_matmul_wrong_neighbour": ("all_gather_matmul", _all_gather_matmul(_ring(step=-1))),
    # every step's running sums land in one receive slot, overwritten before read
    "matmul_reduce_scatter_stale_slot": ("matmul_reduce_scatter", _matmul_reduce_scatter(_ring(recv_slots=1))),
    "matmul_reduce_scatter_missing_wait": (
        "matmul_reduce_scatter",
        _matmul_reduce_scatter(_ring(wait_forward=False)),
    ),
    "matmul_reduce_scatter_wrong_neighbour": ("matmul_reduce_scatter", _matmul_reduce_scatter(_ring(step=-1))),
    # no CTA ever signals: every wait waits forever
    "deadlock_never_signalled": ("all_gather", _all_gather(_ring(signals=0))),
}
DEADLOCKS = ("deadlock_never_signalled",)
# Sending x blocks leftwards while the matmul waits for the slots a rightward ring
# fills: the slot a device waits for never gets its count, so this one hangs (seen on
# 4 H100s) rather than computing wrong values; a hang is a catch too.
MAY_HANG = ("all_gather_matmul_wrong_neighbour",)
NEEDS_THREE = (
    "all_gather_wrong_neighbour",
    "all_gather_missing_wait",
    "all_gather_chunk_sent_twice",
    "all_gather_stale_slot",
    "all_gather_matmul_wrong_neighbour",
    "matmul_reduce_scatter_stale_slot",
    "matmul_reduce_scatter_wrong_neighbour",
)
