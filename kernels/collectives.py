"""Distributed kernels built on Pallas remote DMAs: a ring all-gather, an
all-gather-matmul that overlaps communication with compute, and a
matmul-reduce-scatter, along one named axis of a mesh with any number of axes.

Every kernel runs inside ``shard_map`` on each device's local shard. The remote
copies are ``pltpu.make_async_remote_copy`` with DMA semaphores, addressed by the
ring-axis coordinate of the peer (a mesh device id ``{axis: index}``:
the device's own index on every other axis), so a 2-D mesh needs no
special case. Each kernel starts with a barrier with its two ring neighbours (the barrier
semaphore of ``collective_id``) so that no device writes into a buffer of a
neighbour that has not entered the kernel yet.

Ring all-gather (p devices on the axis, device i owns slot i of the output):
step s = 0 .. p-2 sends slot (i - s) mod p to the right neighbour, then waits for
slot (i - s - 1) mod p from the left one before forwarding it. Every step writes a
*different* slot: writing a fixed slot is the classic bug for p > 2.
``bidirectional=True`` runs a second ring leftwards: the rightward ring carries
the ceil((p-1)/2) nearest left neighbours' slots, the leftward ring the other
floor((p-1)/2), so ceil((p-1)/2) steps instead of p-1.

Each step receives on its own DMA semaphore (and, for the reduce-scatter, into its
own buffer): a device's left neighbour does not wait for it, so it may have sent
step s + 1 before this device waits for step s; on a shared semaphore that wait could
be satisfied by the later copy and the earlier slot forwarded before it landed (the
TPU interpreter's race detector reports exactly this).

All-gather-matmul ``all_gather(x, rows) @ w``: at step s the copy bringing the next
row block of x is started, the matmul of the block already present (slot
(i - s) mod p) runs while it is in flight, and only then is the copy waited for.

Matmul-reduce-scatter ``reduce_scatter(x @ w)``, K sharded: device i ends with row
block i of the sum. The partial sum for block c starts on device c + 1 and moves
right; each device adds its own f32 partial product of that block; after p - 1 hops
it reaches device c, which adds the last partial and rounds once to the output
dtype. Partial sums travel in f32.

Where this runs: the kernels above need TPU semantics (remote DMA, semaphores):
the ``tpu_interpret`` backend simulates them on N CPU devices (with race
detection); ``tpu`` lowers them with Mosaic. ``mosaic_gpu`` runs the same three ring
algorithms written for Hopper GPUs (kernels/mosaic_gpu_collectives.py: remote
references and semaphores over NVLink) on a 1-D mesh of the process's GPUs.
``xla_reference`` is the same collectives through ``lax.all_gather``/``psum_scatter``
(NCCL on GPUs).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallascheck.kernels import compat, validation
from pallascheck.kernels import mosaic_gpu_collectives as mgc
from pallascheck.kernels.backends import Backend, get_backend

KERNEL_BACKENDS = ("tpu_interpret", "tpu", "mosaic_gpu")
COLLECTIVE_ID = 0  # barrier semaphore id; every kernel here syncs only with ring neighbours


@dataclasses.dataclass(frozen=True)
class Config:
    bidirectional: bool = False  # all_gather only: two rings, half the steps

    def __post_init__(self) -> None:
        if not isinstance(self.bidirectional, bool):
            raise TypeError(f"config.bidirectional must be a bool, got {self.bidirectional!r}")


def configs() -> list[Config]:
    return [Config(False), Config(True)]


# --- trace of the kernels' communication/compute events --------------------------------
# The kernels are straight-line code per device, so the order in which their body
# issues DMA starts, matmuls and waits (recorded while the body is traced) is the
# order every device executes them in. ``record_schedule`` exposes it.
_events: list[tuple[str, int, str]] | None = None


def _event(kind: str, step: int, what: str) -> None:
    if _events is not None:
        _events.append((kind, step, what))


def record_schedule(fn: Callable[[], Any]) -> list[tuple[str, int, str]]:
    """Run ``fn`` (which must trace a kernel of this module afresh) and return the
    kernel body's events in program order: (kind, step, detail) with kind in
    start / compute / wait."""
    global _events
    _events = []
    try:
        jax.block_until_ready(fn())
        return list(_events)
    finally:
        _events = None


# --- helpers inside a kernel -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Ring:
    """Position of this device on the ring along ``axis`` of a mesh whose axes are
    ``axis_names``; peers are addressed by full mesh coordinates."""

    axis_names: tuple[str, ...]
    axis: str
    size: int

    def index(self) -> jax.Array:
        return lax.axis_index(self.axis)

    def peer(self, offset: int) -> dict[str, jax.Array]:
        """The device ``offset`` places along the ring, as a MESH device id naming only
        the ring axis: every other coordinate stays this device's own. (A positional
        tuple would have to follow the order of the axis environment, which the TPU
        interpreter does not always keep equal to the mesh's order.)"""
        return {self.axis: lax.rem(self.index() + offset + self.size, self.size)}

    def slot(self, offset: Any) -> jax.Array:
        return lax.rem(self.index() + offset + 2 * self.size, self.size)


def _neighbour_barrier(ring: Ring) -> None:
    """Both ring neighbours have entered the kernel once this returns."""
    sem = pltpu.get_barrier_semaphore()
    for offset in (-1, 1):
        pl.semaphore_signal(sem, 1, device_id=ring.peer(offset))
    pl.semaphore_wait(sem, 2)


def _rows(ref: Any, slot: Any, size: int) -> Any:
    return ref.at[pl.ds(pl.multiple_of(slot * size, size), size)]


def _remote(src: Any, dst: Any, send: Any, recv: Any, ring: Ring, offset: int) -> Any:
    return pltpu.make_async_remote_copy(
        src_ref=src,
        dst_ref=dst,
        send_sem=send,
        recv_sem=recv,
        device_id=ring.peer(offset),
    )


# --- kernels ---------------------------------------------------------------------------
def _all_gather_kernel(x_ref, out_ref, local_sem, send_sems, recv_sems, *, ring: Ring, bidirectional: bool):
    """Ring all-gather of row blocks (HBM to HBM); lane 0 is the rightward ring."""
    rows, p = x_ref.shape[0], ring.size
    _neighbour_barrier(ring)
    local = pltpu.make_async_copy(x_ref, _rows(out_ref, ring.index(), rows), local_sem)
    local.start()
    local.wait()  # the first remote send reads this slot
    directions = [(1, 0, p - 1 if not bidirectional else -(-(p - 1) // 2))]
    if bidirectional:
        directions.append((-1, 1, (p - 1) // 2))
    for s in range(max(n for _, _, n in directions)):
        copies = []
        for direction, lane, n in directions:
            if s < n:
                slot = ring.slot(-direction * s)
                block = _rows(out_ref, slot, rows)
                copy = _remote(block, block, send_sems.at[lane], recv_sems.at[lane, s], ring, direction)
                copy.start()
                _event("start", s, f"send slot i{-direction * s:+d} to {'right' if direction > 0 else 'left'}")
                copies.append(copy)
        for copy in copies:
            copy.wait_send()
            copy.wait_recv()  # the slot forwarded next step has arrived
            _event("wait", s, "send and receive done")


def _all_gather_matmul_kernel(x_ref, w_ref, out_ref, gathered_ref, send_sem, recv_sems, *, ring: Ring):
    """out[block j] = x_j @ w_local for all j, x_j arriving over the ring into the
    VMEM buffer ``gathered_ref``."""
    rows, p = x_ref.shape[0], ring.size
    _neighbour_barrier(ring)
    _rows(gathered_ref, ring.index(), rows)[...] = x_ref[...]
    w = w_ref[...]
    for s in range(p):
        slot = ring.slot(-s)
        copy = None
        if s < p - 1:  # bring the next block while this one is multiplied
            block = _rows(gathered_ref, slot, rows)
            copy = _remote(block, block, send_sem, recv_sems.at[s], ring, 1)
            copy.start()
            _event("start", s, f"send x block i{-s:+d} to right")
        _rows(out_ref, slot, rows)[...] = jnp.dot(
            _rows(gathered_ref, slot, rows)[...], w, preferred_element_type=jnp.float32
        ).astype(out_ref.dtype)
        _event("compute", s, f"matmul x block i{-s:+d}")
        if copy is not None:
            copy.wait_send()
            copy.wait_recv()
            _event("wait", s, f"received x block i{-s - 1:+d}")


def _matmul_reduce_scatter_kernel(x_ref, w_ref, out_ref, acc_ref, recv_ref, send_sem, recv_sems, *, ring: Ring):
    """The running sum travels right; at step s device i adds its partial of block
    (i - s - 1). ``acc_ref`` is the send buffer, ``recv_ref[s - 1]`` step s's landing
    buffer."""
    p = ring.size
    rows = out_ref.shape[0]
    w = w_ref[...]
    _neighbour_barrier(ring)

    def partial(block):
        return jnp.dot(_rows(x_ref, block, rows)[...], w, preferred_element_type=jnp.float32)

    acc_ref[...] = partial(ring.slot(-1))
    _event("compute", 0, "partial of block i-1")
    for s in range(1, p):
        copy = _remote(acc_ref, recv_ref.at[s - 1], send_sem, recv_sems.at[s - 1], ring, 1)
        copy.start()
        _event("start", s, "send running sum to right")
        mine = partial(ring.slot(-s - 1))  # overlaps the copy in flight
        _event("compute", s, f"partial of block i{-s - 1:+d}")
        copy.wait_send()
        copy.wait_recv()
        _event("wait", s, "received running sum from left")
        acc_ref[...] = recv_ref[s - 1] + mine  # the send above has read acc_ref out already
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


# --- launching ------------------------------------------------------------------------
def _require_kernel_backend(backend: Backend) -> None:
    if backend.name not in KERNEL_BACKENDS:
        raise ValueError(
            f"backend must be one of {KERNEL_BACKENDS} for the ring kernels (got {backend}); "
            "elsewhere use collectives.xla_reference_* (lax collectives: NCCL on GPUs)"
        )
    if backend.name == "mosaic_gpu":
        backend.require_available()


def _gpu_config(config: Any, mesh: Mesh, axis: str) -> mgc.Config:
    """The Mosaic GPU kernels run on a 1-D mesh (one ring over the process's GPUs)
    and take a mosaic_gpu_collectives.Config."""
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"the mosaic_gpu collectives run on a 1-D mesh; got axes {tuple(mesh.axis_names)} "
            f"(make a mesh of the GPUs on axis {axis!r} alone)"
        )
    config = mgc.Config() if config is None else config
    if not isinstance(config, mgc.Config):
        raise TypeError(f"config must be a mosaic_gpu_collectives.Config on mosaic_gpu, got {type(config).__name__}")
    return config


def _call(kernel, backend: Backend, out_shape, scratch_shapes, *args, memory_space: Any = pl.ANY):
    """One program; operands whole in ``memory_space`` (HBM for pure DMA kernels,
    VMEM where the kernel computes on them)."""
    spec = pl.BlockSpec(memory_space=memory_space)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=0,
            grid=(1,),
            in_specs=[spec] * len(args),
            out_specs=spec,
            scratch_shapes=scratch_shapes,
        ),
        interpret=backend.interpret_arg(),
        compiler_params=compat.tpu_compiler_params_collective(COLLECTIVE_ID),
    )(*args)


def _ring(mesh: Mesh, axis: str) -> Ring:
    return Ring(tuple(mesh.axis_names), axis, mesh.shape[axis])


# --- argument checks -------------------------------------------------------------------
def _spec_entries(spec: P, ndim: int) -> tuple[Any, ...]:
    return tuple(spec) + (None,) * (ndim - len(spec))


def _axes_of(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def validate_layout(name: str, shape: Sequence[int], spec: Any, mesh: Mesh) -> None:
    """``spec`` must be a PartitionSpec over ``mesh``'s axes that tiles ``shape``."""
    if not isinstance(spec, P):
        raise TypeError(f"{name}_spec must be a jax.sharding.PartitionSpec, got {type(spec).__name__}")
    if len(spec) > len(shape):
        raise ValueError(f"{name}_spec {spec} has more entries than {name} has dimensions ({len(shape)})")
    used: list[str] = []
    for dim, entry in enumerate(_spec_entries(spec, len(shape))):
        axes = _axes_of(entry)
        for axis in axes:
            if axis not in mesh.shape:
                raise ValueError(f"{name}_spec names axis {axis!r}, which is not a mesh axis {tuple(mesh.axis_names)}")
            if axis in used:
                raise ValueError(f"{name}_spec uses mesh axis {axis!r} twice: {spec}")
            used.append(axis)
        parts = 1
        for axis in axes:
            parts *= mesh.shape[axis]
        if shape[dim] % parts:
            raise ValueError(
                f"{name} dimension {dim} (size {shape[dim]}) is not divisible by the {parts} shards of "
                f"mesh axes {axes} in {name}_spec {spec}"
            )


def _validate_axis(mesh: Any, axis: Any) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.shape:
        raise ValueError(f"axis {axis!r} is not a mesh axis; the mesh has {tuple(mesh.axis_names)}")


def _validate_operand(name: str, a: Any, rank: int) -> None:
    validation.require_array(name, a)
    validation.require_rank(name, a, rank)
    validation.require_float_dtype(name, a.dtype)
    validation.require_nonempty(name, tuple(a.shape))


def _require_spec(name: str, spec: P, expected: P) -> None:
    if tuple(spec) != tuple(expected):
        raise ValueError(f"{name}_spec must be {expected} for this kernel, got {spec}")


# --- public API -----------------------------------------------------------------------
def all_gather(
    x: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    spec: P | None = None,
    config: Config | mgc.Config | None = None,
    backend: str | Backend | None = None,
) -> jax.Array:
    """Gather ``x``'s dimension 0, sharded over mesh ``axis``, onto every device of that axis.

    ``spec`` is x's PartitionSpec (default ``P(axis)``). Dimension 0 must be sharded
    over ``axis``, alone or as the last (minor) axis of a tuple such as
    ``P(('x', 'y'))``; the other dimensions may be sharded over other mesh axes or
    replicated. Returns the same global values with ``axis`` dropped from dimension
    0's sharding: every device of the ring holds all p blocks (bit-exact copies).
    ``config``: a collectives.Config on the TPU backends, a
    mosaic_gpu_collectives.Config on mosaic_gpu.
    """
    _validate_axis(mesh, axis)
    spec = P(axis) if spec is None else spec
    validation.require_array("x", x)
    if x.ndim < 1:
        raise ValueError(f"x must have rank >= 1, got shape {tuple(x.shape)}")
    validation.require_nonempty("x", tuple(x.shape))
    validate_layout("x", x.shape, spec, mesh)
    if _axes_of(_spec_entries(spec, x.ndim)[0])[-1:] != (axis,):
        raise ValueError(f"spec must shard dimension 0 over axis {axis!r} (last in a tuple), got {spec}")
    backend = get_backend(backend)
    _require_kernel_backend(backend)
    if backend.name == "mosaic_gpu":
        if _spec_entries(spec, x.ndim) != (axis,) + (None,) * (x.ndim - 1):
            raise ValueError(f"spec must be P({axis!r}) on mosaic_gpu (a 1-D mesh), got {spec}")
        return _gpu_all_gather_jit(x, mesh, axis, _gpu_config(config, mesh, axis))
    config = Config() if config is None else config
    if not isinstance(config, Config):
        raise TypeError(f"config must be a collectives.Config, got {type(config).__name__}")
    return _all_gather_jit(x, mesh, axis, spec, config, backend)


def _gathered_spec(spec: P, ndim: int) -> P:
    """``spec`` with the (last) ring axis dropped from dimension 0."""
    entries = _spec_entries(spec, ndim)
    rest = _axes_of(entries[0])[:-1]
    return P(rest[0] if len(rest) == 1 else (rest or None), *entries[1:])


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _all_gather_jit(x, mesh, axis, spec, config, backend, body=_all_gather_kernel):
    ring = _ring(mesh, axis)
    out_spec = _gathered_spec(spec, x.ndim)

    def local(block):
        shape = (block.shape[0] * ring.size,) + block.shape[1:]
        lanes, steps = (2, -(-(ring.size - 1) // 2)) if config.bidirectional else (1, ring.size - 1)
        return _call(
            functools.partial(body, ring=ring, bidirectional=config.bidirectional),
            backend,
            jax.ShapeDtypeStruct(shape, block.dtype),
            [pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA((lanes,)), pltpu.SemaphoreType.DMA((lanes, steps))],
            block,
        )

    return compat.shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=out_spec, check_vma=False)(x)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _gpu_all_gather_jit(x, mesh, axis, config, ring=mgc.RING):
    local = functools.partial(mgc.all_gather_local, axis=axis, p=mesh.shape[axis], config=config, ring=ring)
    return compat.shard_map(local, mesh=mesh, in_specs=(P(axis),), out_specs=P(), check_vma=False)(x)


def _validate_matmul(x, w, mesh, axis):
    _validate_axis(mesh, axis)
    _validate_operand("x", x, 2)
    _validate_operand("w", w, 2)
    if x.dtype != w.dtype:
        raise TypeError(f"x and w must have the same dtype, got {x.dtype} and {w.dtype}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"contracting dimensions must match: x.shape[1]={x.shape[1]} != w.shape[0]={w.shape[0]}")


def all_gather_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    out_dtype: Any = None,
    config: mgc.Config | None = None,
    backend: str | Backend | None = None,
) -> jax.Array:
    """``x @ w`` with x's rows sharded over ``axis`` (``P(axis, None)``) and w's columns
    sharded over it (``P(None, axis)``); the result is ``P(None, axis)``.

    The tensor-parallel column-linear layer: each device multiplies every row block
    of x, arriving over the ring, by its own columns of w, each step's matmul
    overlapping the next block's copy. Accumulates in f32, rounds once to
    ``out_dtype`` (default x's dtype). ``config`` (mosaic_gpu only): the copy/compute
    split and the matmul tile.
    """
    _validate_matmul(x, w, mesh, axis)
    validate_layout("x", x.shape, P(axis, None), mesh)
    validate_layout("w", w.shape, P(None, axis), mesh)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    validation.require_float_dtype("out_dtype", out_dtype)
    backend = get_backend(backend)
    _require_kernel_backend(backend)
    if backend.name == "mosaic_gpu":
        return _gpu_all_gather_matmul_jit(x, w, mesh, axis, out_dtype, _gpu_config(config, mesh, axis))
    _require_no_config(config)
    return _all_gather_matmul_jit(x, w, mesh, axis, out_dtype, backend)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _all_gather_matmul_jit(x, w, mesh, axis, out_dtype, backend, body=_all_gather_matmul_kernel):
    ring = _ring(mesh, axis)

    def local(xb, wb):
        m = xb.shape[0] * ring.size
        return _call(
            functools.partial(body, ring=ring),
            backend,
            jax.ShapeDtypeStruct((m, wb.shape[1]), out_dtype),
            [
                pltpu.VMEM((m, xb.shape[1]), xb.dtype),
                pltpu.SemaphoreType.DMA,
                pltpu.SemaphoreType.DMA((max(ring.size - 1, 1),)),
            ],
            xb,
            wb,
            memory_space=pltpu.VMEM,
        )

    return compat.shard_map(
        local, mesh=mesh, in_specs=(P(axis, None), P(None, axis)), out_specs=P(None, axis), check_vma=False
    )(x, w)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _gpu_all_gather_matmul_jit(x, w, mesh, axis, out_dtype, config, ring=mgc.RING):
    local = functools.partial(
        mgc.all_gather_matmul_local, axis=axis, p=mesh.shape[axis], out_dtype=out_dtype, config=config, ring=ring
    )
    return compat.shard_map(
        local, mesh=mesh, in_specs=(P(axis, None), P(None, axis)), out_specs=P(None, axis), check_vma=False
    )(x, w)


def _require_no_config(config: Any) -> None:
    if config is not None:
        raise TypeError("config is taken only on mosaic_gpu (the TPU ring matmuls have no tuning knobs)")


def _reduce_scatter_specs(axis: str, row_axis: str | None) -> tuple[P, P, P]:
    """x, w and output specs of the K-sharded matmul."""
    out_rows = axis if row_axis is None else (row_axis, axis)
    return P(row_axis, axis), P(axis, None), P(out_rows, None)


def matmul_reduce_scatter(
    x: jax.Array,
    w: jax.Array,
    *,
    mesh: Mesh,
    axis: str,
    row_axis: str | None = None,
    out_dtype: Any = None,
    config: mgc.Config | None = None,
    backend: str | Backend | None = None,
) -> jax.Array:
    """``x @ w`` with the contracting dimension sharded over ``axis`` (x ``P(row_axis, axis)``,
    w ``P(axis, None)``); the result's rows are scattered over ``axis`` within the
    ``row_axis`` blocks: ``P((row_axis, axis), None)`` (``P(axis, None)`` without one).

    The tensor-parallel row-linear layer; ``row_axis`` is the seed layout's
    data-parallel axis. Each device's f32 partial products are summed around the
    ring in f32 (p - 1 additions per element, in ring order) and rounded once to
    ``out_dtype`` (default x's dtype). x's rows per ``row_axis`` block must divide by
    the axis size. ``config`` (mosaic_gpu only): the matmul tile and CTAs.
    """
    _validate_matmul(x, w, mesh, axis)
    if row_axis is not None:
        _validate_axis(mesh, row_axis)
        if row_axis == axis:
            raise ValueError(f"row_axis must differ from axis, both are {axis!r}")
    x_spec, w_spec, out_spec = _reduce_scatter_specs(axis, row_axis)
    validate_layout("x", x.shape, x_spec, mesh)
    validate_layout("w", w.shape, w_spec, mesh)
    validate_layout("out", (x.shape[0], w.shape[1]), out_spec, mesh)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    validation.require_float_dtype("out_dtype", out_dtype)
    backend = get_backend(backend)
    _require_kernel_backend(backend)
    if backend.name == "mosaic_gpu":
        return _gpu_matmul_reduce_scatter_jit(x, w, mesh, axis, out_dtype, _gpu_config(config, mesh, axis))
    _require_no_config(config)
    return _matmul_reduce_scatter_jit(x, w, mesh, axis, row_axis, out_dtype, backend)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7))
def _matmul_reduce_scatter_jit(x, w, mesh, axis, row_axis, out_dtype, backend, body=_matmul_reduce_scatter_kernel):
    ring = _ring(mesh, axis)
    x_spec, w_spec, out_spec = _reduce_scatter_specs(axis, row_axis)

    def local(xb, wb):
        rows = xb.shape[0] // ring.size
        return _call(
            functools.partial(body, ring=ring),
            backend,
            jax.ShapeDtypeStruct((rows, wb.shape[1]), out_dtype),
            [
                pltpu.VMEM((rows, wb.shape[1]), jnp.float32),
                pltpu.VMEM((max(ring.size - 1, 1), rows, wb.shape[1]), jnp.float32),
                pltpu.SemaphoreType.DMA,
                pltpu.SemaphoreType.DMA((max(ring.size - 1, 1),)),
            ],
            xb,
            wb,
            memory_space=pltpu.VMEM,
        )

    return compat.shard_map(local, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec, check_vma=False)(x, w)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6))
def _gpu_matmul_reduce_scatter_jit(x, w, mesh, axis, out_dtype, config, ring=mgc.RING):
    local = functools.partial(
        mgc.matmul_reduce_scatter_local, axis=axis, p=mesh.shape[axis], out_dtype=out_dtype, config=config, ring=ring
    )
    return compat.shard_map(
        local, mesh=mesh, in_specs=(P(None, axis), P(axis, None)), out_specs=P(axis, None), check_vma=False
    )(x, w)


# --- xla_reference: what a user writes instead (NCCL on GPUs) ---------------------------
def xla_reference_all_gather(x: jax.Array, *, mesh: Mesh, axis: str, spec: P | None = None) -> jax.Array:
    spec = P(axis) if spec is None else spec
    out_spec = _gathered_spec(spec, x.ndim)
    fn = compat.shard_map(
        lambda b: lax.all_gather(b, axis, axis=0, tiled=True),
        mesh=mesh,
        in_specs=(spec,),
        out_specs=out_spec,
        check_vma=False,
    )
    return jax.jit(fn)(x)


def xla_reference_all_gather_matmul(
    x: jax.Array, w: jax.Array, *, mesh: Mesh, axis: str, out_dtype: Any = None
) -> jax.Array:
    out_dtype = x.dtype if out_dtype is None else out_dtype

    def local(xb, wb):
        full = lax.all_gather(xb, axis, axis=0, tiled=True)
        return jnp.dot(full, wb, preferred_element_type=jnp.float32).astype(out_dtype)

    fn = compat.shard_map(
        local, mesh=mesh, in_specs=(P(axis, None), P(None, axis)), out_specs=P(None, axis), check_vma=False
    )
    return jax.jit(fn)(x, w)


def xla_reference_matmul_reduce_scatter(
    x: jax.Array, w: jax.Array, *, mesh: Mesh, axis: str, row_axis: str | None = None, out_dtype: Any = None
) -> jax.Array:
    """Partials rounded to ``out_dtype`` first, then ``psum_scatter`` in ``out_dtype``:
    what a user writes (the seed's ``psum`` of per-device results)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    x_spec, w_spec, out_spec = _reduce_scatter_specs(axis, row_axis)

    def local(xb, wb):
        part = jnp.dot(xb, wb, preferred_element_type=jnp.float32).astype(out_dtype)
        return lax.psum_scatter(part, axis, scatter_dimension=0, tiled=True)

    fn = compat.shard_map(local, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec, check_vma=False)
    return jax.jit(fn)(x, w)


def sharded(a: Any, mesh: Mesh, spec: P) -> jax.Array:
    """Place a host array on ``mesh`` with ``spec``."""
    return jax.device_put(a, NamedSharding(mesh, spec))
