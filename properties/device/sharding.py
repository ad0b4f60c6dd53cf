"""Hypothesis strategies for sharding layouts: mesh shapes, axis names and the
PartitionSpecs a sharded kernel accepts, over 2, 4 or 8 devices.

Any kernel with a sharded mode draws its layouts here: a collective gathers or
scatters along one named axis; a vocab-parallel cross-entropy shards the vocabulary
dimension (``partition_specs(2, layout, required={1: axis})``); attention sharded
over heads requires the heads dimension on an axis and leaves the others free or
replicated. Strategies only describe layouts; :func:`make_mesh` turns one into a
``jax.sharding.Mesh`` over the first devices of the running process (a multi-device
child, see properties/device/multidevice.py).

Shapes of drawn arrays are built from the layout with :func:`divisible_dims`, so that
every sharded dimension divides by its number of shards.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import strategies as st

DEVICE_COUNTS = (2, 4, 8)
# Names a user would pick; drawn so that no kernel assumes "x"/"y".
AXIS_NAMES = ("x", "y", "data", "model", "seq", "expert")


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A mesh shape with its axis names (outermost first)."""

    shape: tuple[int, ...]
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.names) or len(set(self.names)) != len(self.names):
            raise ValueError(f"mesh needs one distinct name per axis, got shape {self.shape} names {self.names}")
        if any(not isinstance(n, int) or n < 1 for n in self.shape):
            raise ValueError(f"mesh axis sizes must be ints >= 1, got {self.shape}")

    @property
    def devices(self) -> int:
        return math.prod(self.shape)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.names, self.shape))

    def describe(self) -> str:
        return "x".join(map(str, self.shape)) + " (" + ", ".join(self.names) + ")"


def mesh_shapes(
    devices: Sequence[int] = DEVICE_COUNTS, ndims: Sequence[int] = (1, 2)
) -> st.SearchStrategy[tuple[int, ...]]:
    """1-D meshes (n,) and 2-D meshes (a, b) with a, b >= 2 over ``devices`` devices:
    (2,), (4,), (8,), (2, 2), (2, 4), (4, 2)."""
    return st.sampled_from(mesh_shape_choices(devices, ndims))


def mesh_shape_choices(devices: Sequence[int] = DEVICE_COUNTS, ndims: Sequence[int] = (1, 2)) -> list[tuple[int, ...]]:
    """The shapes :func:`mesh_shapes` draws from, as a list (for non-Hypothesis drivers)."""
    shapes: list[tuple[int, ...]] = []
    for n in devices:
        if 1 in ndims:
            shapes.append((n,))
        if 2 in ndims:
            shapes.extend((a, n // a) for a in range(2, n) if n % a == 0 and n // a >= 2)
    if not shapes:
        raise ValueError(f"no mesh of {tuple(ndims)} dimensions over {tuple(devices)} devices")
    return shapes


def axis_names(count: int, pool: Sequence[str] = AXIS_NAMES) -> st.SearchStrategy[tuple[str, ...]]:
    """``count`` distinct axis names, in a drawn order."""
    return st.permutations(tuple(pool)).map(lambda names: tuple(names[:count]))


@st.composite
def mesh_layouts(draw: Any, devices: Sequence[int] = DEVICE_COUNTS, ndims: Sequence[int] = (1, 2)) -> MeshLayout:
    shape = draw(mesh_shapes(devices, ndims))
    return MeshLayout(shape, draw(axis_names(len(shape))))


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


@st.composite
def partition_specs(
    draw: Any,
    ndim: int,
    layout: MeshLayout,
    required: Mapping[int, str] | None = None,
    *,
    free_axes: bool = True,
    allow_tuples: bool = True,
) -> Any:
    """A PartitionSpec for a rank-``ndim`` array on ``layout``.

    ``required`` maps a dimension to the mesh axis that must shard it (the kernel's
    sharded dimension); it comes last in that dimension's entry, so a drawn spec may
    be ``P(('data', 'x'))`` for ``required={0: 'x'}``. Every other mesh axis is used
    at most once, on any dimension, or not at all (the array is replicated over it)
    when ``free_axes``; with ``free_axes=False`` only the required axes appear.
    ``allow_tuples=False`` keeps one axis per dimension.
    """
    from jax.sharding import PartitionSpec as P

    required = dict(required or {})
    for dim, axis in required.items():
        if not 0 <= dim < ndim:
            raise ValueError(f"required dimension {dim} is outside rank {ndim}")
        if axis not in layout.names:
            raise ValueError(f"required axis {axis!r} is not in mesh axes {layout.names}")
    placed: dict[int, list[str]] = {d: [] for d in range(ndim)}
    others = [a for a in layout.names if a not in required.values()]
    if free_axes:
        for axis in draw(st.permutations(others)):
            choices = [None] + [d for d in range(ndim) if allow_tuples or (not placed[d] and d not in required)]
            dim = draw(st.sampled_from(choices))
            if dim is not None:
                placed[dim].append(axis)
    for dim, axis in required.items():
        placed[dim].append(axis)
    entries = [_entry(tuple(placed[d])) for d in range(ndim)]
    while entries and entries[-1] is None and draw(st.booleans()):
        entries.pop()  # trailing replicated dims may be left out: P('x') == P('x', None)
    return P(*entries)


def shards(spec: Any, dim: int, layout: MeshLayout) -> int:
    """How many pieces ``spec`` cuts dimension ``dim`` into on ``layout``."""
    entries = tuple(spec) + (None,) * (dim + 1 - len(spec))
    entry = entries[dim]
    axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    return math.prod(layout.sizes[a] for a in axes)


def divisible_dims(spec: Any, layout: MeshLayout, per_shard: Sequence[int]) -> tuple[int, ...]:
    """Global dimensions with ``per_shard[d]`` elements in each shard of dimension d."""
    return tuple(n * shards(spec, d, layout) for d, n in enumerate(per_shard))


def make_mesh(layout: MeshLayout) -> Any:
    """The layout as a Mesh over the first ``layout.devices`` devices of this process."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    if len(devices) < layout.devices:
        raise ValueError(
            f"mesh {layout.describe()} needs {layout.devices} devices, this process has {len(devices)}; "
            "run it through properties.device.multidevice.run_with_cpu_devices"
        )
    return Mesh(np.array(devices[: layout.devices]).reshape(layout.shape), layout.names)
