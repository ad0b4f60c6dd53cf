"""Where the float64 oracles and bounds compute: numpy on the host, or JAX float64 on
the kernel's device.

The oracle modules are written once against ``xp``, a namespace that is numpy by
default and ``jax.numpy`` inside :func:`on_device`. On a GPU the oracle of a
production-size case (an attention of 4096 keys holds a dozen [b, h, s, s] float64
intermediates) is a few device seconds instead of minutes of numpy on the host; on
the CPU numpy is kept because it is faster there for the small shapes the CPU checks
(no per-operation dispatch).

``on_device`` enables float64 for its block only, never for the user's process;
kernels called from inside it must run under :func:`kernel_side`, which restores
32-bit JAX and the numpy namespace, so that a kernel is compiled as its user
compiles it. The oracles return numpy arrays or device arrays; the checks compare a
device oracle on its device (``properties/checks.compare``).

The oracle's own error. On the device, float64 is IEEE, but XLA may contract a
multiply and an add into one fused operation and sum a reduction in another order
than numpy. Each such difference is an error of at most gamma_n(2^-53) relative to
the magnitude of the sum, against bounds of at least gamma(2^-24) of the same
magnitude: some 2^29 times smaller. tests/test_device_oracles.py measures it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from pallascheck.kernels.compat import float64_enabled

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T", bound="DataclassInstance")

_DEVICE: contextvars.ContextVar[Any] = contextvars.ContextVar("pallascheck_oracle_device", default=None)
_HOLD: contextvars.ContextVar[bool] = contextvars.ContextVar("pallascheck_hold_results", default=False)

# numpy names that are types, constants or dtype helpers: the same object in both
# modes (jax.numpy's float32 is a scalar constructor, not a numpy dtype).
_SHARED = frozenset(
    {
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "bool_",
        "dtype",
        "finfo",
        "iinfo",
        "inf",
        "nan",
        "pi",
        "e",
        "ndarray",
        "integer",
        "floating",
        "generic",
    }
)


class _Namespace:
    """numpy, or jax.numpy on the device inside ``on_device``."""

    def __getattr__(self, name: str) -> Any:
        if name in _SHARED or _DEVICE.get() is None:
            return getattr(np, name)
        if name == "errstate":  # JAX computes IEEE specials without warnings
            return lambda **_: contextlib.nullcontext()
        return getattr(jnp, name)


xp = _Namespace()


def active_device() -> Any:
    """The device the oracles compute on, or None for numpy on the host."""
    return _DEVICE.get()


def namespace(*arrays: Any) -> Any:
    """jax.numpy if any of ``arrays`` is a JAX array, else numpy: for helpers that
    serve both the host and the device oracles (oracles/algebra.py)."""
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def f64(a: Any) -> Any:
    """``a`` upcast exactly to float64 where the oracles compute."""
    if (
        _DEVICE.get() is not None
        and isinstance(a, jax.Array)
        and a.dtype != np.float64
        and jnp.issubdtype(a.dtype, jnp.floating)
    ):
        return _upcast_exactly(a)
    return xp.asarray(a, dtype=np.float64)


@jax.jit
def _upcast_exactly(a: jax.Array) -> jax.Array:
    """``a`` in float64 with its subnormals kept: XLA:CPU converts with
    denormals-are-zero, a float32 or bfloat16 subnormal becomes 0 (numpy's conversion,
    on the host, keeps it). A subnormal is its mantissa bits times the dtype's
    smallest subnormal, which float64 holds exactly. One compiled program: run
    operation by operation, its bits, exponent, mantissa and two float64 candidates
    were each an array of the input's size at once (a whole production input, upcast
    eagerly by a streamed oracle: oracles/chunks.py)."""
    info = ml_dtypes.finfo(a.dtype)
    bits = lax.bitcast_convert_type(a, np.dtype(f"uint{info.bits}"))
    exponent = (bits >> info.nmant) & ((1 << info.nexp) - 1)
    magnitude = (bits & ((1 << info.nmant) - 1)).astype(np.float64) * float(info.smallest_subnormal)
    negative = (bits >> (info.bits - 1)) == 1
    return jnp.where(exponent == 0, jnp.where(negative, -magnitude, magnitude), a.astype(np.float64))


def placed(tree: Any) -> Any:
    """``tree`` with its numpy arrays copied to the default device, the copies waited
    for (its other leaves as they are). Handed numpy arrays itself, a program on a GPU
    copies them in while other threads dispatch, and under jax 0.11.2 on H100s about
    one call in 10^4 then computed from a corrupted input (XLA's own programs too:
    every output element wrong, and neither another call's output nor one input
    swapped with another call's); with inputs already on the device, none in
    1.1 * 10^5 calls (docs/results.md, "A JAX runtime fault"; ``pallascheck bench
    --dispatch-stress --inputs host`` reproduces it)."""
    copies: list[jax.Array] = []

    def put(a: Any) -> Any:
        if not isinstance(a, np.ndarray):
            return a
        copies.append(jax.device_put(a))
        return copies[-1]

    tree = jax.tree_util.tree_map(put, tree)
    jax.block_until_ready(copies)
    return tree


@contextlib.contextmanager
def on_device(device: Any, *, hold_results: bool = False) -> Iterator[None]:
    """Oracles and bounds inside the block compute in JAX float64 on ``device``.
    ``hold_results``: a streamed case's results are held on the host
    (oracles/chunks.py), where the device's share would not hold them."""
    token, hold = _DEVICE.set(device), _HOLD.set(hold_results)
    try:
        with float64_enabled(), jax.default_device(device):
            yield
    finally:
        _HOLD.reset(hold)
        _DEVICE.reset(token)


def holds_results() -> bool:
    """Whether the oracles compute on a device and hold a streamed case's results on
    the host (``on_device``)."""
    return _DEVICE.get() is not None and _HOLD.get()


@contextlib.contextmanager
def kernel_side() -> Iterator[None]:
    """Leave ``on_device`` for the block: 32-bit JAX and numpy oracles, for running
    kernels (and the relations, which run kernels) inside a device-oracle check."""
    if _DEVICE.get() is None:
        yield
        return
    token = _DEVICE.set(None)
    try:
        with float64_enabled(False):
            yield
    finally:
        _DEVICE.reset(token)


def pytree(*meta: str) -> Callable[[type[_T]], type[_T]]:
    """Class decorator: an oracle's dataclass as a JAX pytree, its arrays the leaves and
    its ``meta`` fields (shapes, scales, group ranges) static, so that a device oracle
    computed by one compiled program is passed whole to the bound's program
    (properties/device/programs.py)."""

    def register(cls: type[_T]) -> type[_T]:
        data = [f.name for f in dataclasses.fields(cls) if f.name not in meta]
        jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=list(meta))
        return cls

    return register
