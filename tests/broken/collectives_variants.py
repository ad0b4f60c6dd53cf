"""Deliberately broken distributed kernels. Each reuses the real launch code of
kernels/collectives.py (mesh, shard_map, semaphores, buffers) and changes one thing
in the kernel body; tests/test_collectives.py requires the multi-device checks
(properties/families/collectives.py) to catch every one.

They need N CPU devices, so they run in a child process, and one of them deadlocks
by design; hence they are not in ``broken.MODULES`` (whose single-process
``(spec, dtypes, examples)`` contract they do not fit). ``VARIANTS`` maps a name to
(the property that runs it, the broken kernel with the public signature);
``DEADLOCKS`` names those that must come back as a timeout.
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

from pallascheck.kernels import collectives
from pallascheck.kernels.backends import get_backend
from pallascheck.kernels.collectives import Ring, _neighbour_barrier, _remote, _rows


@dataclasses.dataclass(frozen=True)
class OffByOneOtherAxes(Ring):
    """The ring neighbour, but with every *other* mesh coordinate shifted by one too:
    a wrong device on a 2-D mesh (a bijection, so nothing deadlocks); on a 1-D mesh
    it is the right one."""

    def peer(self, offset: int) -> dict[str, jax.Array]:
        others = {
            name: lax.rem(lax.axis_index(name) + 1, lax.axis_size(name))
            for name in self.axis_names
            if name != self.axis
        }
        return {**super().peer(offset), **others}


def _all_gather_body(
    x_ref,
    out_ref,
    local_sem,
    send_sems,
    recv_sems,
    *,
    ring: Ring,
    bidirectional: bool,
    same_slot=False,
    wait_recv=True,
    shared_recv_sem=False,
    skip_last_send_on=None,
    ring_cls=Ring,
):
    """kernels/collectives.py's _all_gather_kernel (rightward ring) with a switch per bug."""
    ring = ring_cls(ring.axis_names, ring.axis, ring.size)
    rows, p = x_ref.shape[0], ring.size
    _neighbour_barrier(ring)
    local = pltpu.make_async_copy(x_ref, _rows(out_ref, ring.index(), rows), local_sem)
    local.start()
    local.wait()
    for s in range(p - 1):
        slot = ring.index() if same_slot else ring.slot(-s)  # the seed: "keeps writing to the same location"
        block = _rows(out_ref, slot, rows)
        copy = _remote(block, block, send_sems.at[0], recv_sems.at[0, 0 if shared_recv_sem else s], ring, 1)
        sends = True
        if skip_last_send_on is not None and s == p - 2:
            sends = ring.index() != skip_last_send_on

        @pl.when(sends)
        def _():
            copy.start()
            copy.wait_send()

        if wait_recv:
            copy.wait_recv()


def _all_gather_variant(**switches: Any) -> Callable[..., jax.Array]:
    body = functools.partial(_all_gather_body, **switches)

    def run(x, *, mesh, axis, spec=None, config=None, backend=None):
        spec = collectives.P(axis) if spec is None else spec
        # unidirectional only: the bugs live in the rightward ring
        return collectives._all_gather_jit(x, mesh, axis, spec, collectives.Config(False), get_backend(backend), body)

    return run


def _reduce_scatter_wrong_order(x_ref, w_ref, out_ref, acc_ref, recv_ref, send_sem, recv_sems, *, ring: Ring):
    """The real reduce-scatter with the partial of block (i + s + 1) added at step s
    instead of (i - s - 1): the chunks go round the ring the wrong way."""
    p, rows = ring.size, out_ref.shape[0]
    w = w_ref[...]
    _neighbour_barrier(ring)

    def partial(block):
        return jnp.dot(_rows(x_ref, block, rows)[...], w, preferred_element_type=jnp.float32)

    acc_ref[...] = partial(ring.slot(1))
    for s in range(1, p):
        copy = _remote(acc_ref, recv_ref.at[s - 1], send_sem, recv_sems.at[s - 1], ring, 1)
        copy.start()
        mine = partial(ring.slot(s + 1))
        copy.wait_send()
        copy.wait_recv()
        acc_ref[...] = recv_ref[s - 1] + mine
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _reduce_scatter_variant(body) -> Callable[..., jax.Array]:
    def run(x, w, *, mesh, axis, row_axis=None, out_dtype=None, backend=None):
        out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
        return collectives._matmul_reduce_scatter_jit(x, w, mesh, axis, row_axis, out_dtype, get_backend(backend), body)

    return run


VARIANTS: dict[str, tuple[str, Callable[..., jax.Array]]] = {
    # the seed's ring: every step sends to the neighbour's slot of this device
    "same_destination_slot": ("all_gather", _all_gather_variant(same_slot=True)),
    # a device on another row/column of a 2-D mesh gets the block
    "wrong_neighbour_2d": ("all_gather", _all_gather_variant(ring_cls=OffByOneOtherAxes)),
    # forward a slot without waiting for it to arrive
    "missing_wait": ("all_gather", _all_gather_variant(wait_recv=False)),
    # one receive semaphore for all steps: a later copy can satisfy an earlier wait
    "shared_receive_semaphore": ("all_gather", _all_gather_variant(shared_recv_sem=True)),
    "reduce_scatter_wrong_chunk_order": ("matmul_reduce_scatter", _reduce_scatter_variant(_reduce_scatter_wrong_order)),
    # device 0 never sends its last block: its right neighbour waits forever
    "deadlock_missing_send": ("all_gather", _all_gather_variant(skip_last_send_on=0)),
}
DEADLOCKS = ("deadlock_missing_send",)
