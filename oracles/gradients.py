"""Oracle gradients: reverse-mode autodiff of a float64 jax.numpy function.

The function is run with float64 enabled, on the device the oracles compute on (the
CPU, or the kernel's GPU inside ``numeric.on_device``), so its VJP is exact up to
float64 rounding; inputs are the kernel's own input values upcast exactly. The
forward and backward pass are compiled as one program: run op by op, every
primitive of the oracle compiles on its own for each new shape, which cost more
than the kernels' own compilation in interpret mode.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pallascheck.kernels.compat import float64_enabled
from pallascheck.oracles.numeric import active_device, f64


@functools.lru_cache(maxsize=256)
def _compiled(fn: Callable[..., Any], static: tuple[Any, ...]) -> Callable[..., Any]:
    """One jitted VJP per (function, static arguments): a module-level ``fn`` is
    compiled once per shape, however many cases or slices use it."""

    def gradients(args: Sequence[jax.Array], ct: jax.Array, constants: Sequence[Any]) -> tuple[jax.Array, ...]:
        _, pullback = jax.vjp(lambda *p: fn(*p, *constants, *static), *args)
        return pullback(ct)

    return jax.jit(gradients)


def vjp64(
    fn: Callable[..., Any],
    primals: Sequence[Any],
    cotangent: Any,
    *,
    constants: Sequence[Any] = (),
    static: tuple[Any, ...] = (),
) -> tuple[np.ndarray, ...]:
    """Gradients of ``sum(fn(*primals, *constants, *static) * cotangent)`` w.r.t.
    each primal, in float64. ``constants`` (arrays) and ``static`` (hashable Python
    values) are passed after the primals; pass a module-level ``fn`` with them rather
    than a closure, so that its compiled VJP is reused."""
    device = active_device()
    with float64_enabled(), jax.default_device(device or jax.devices("cpu")[0]):
        args = [f64(p) for p in primals]
        grads = _compiled(fn, tuple(static))(args, f64(cotangent), tuple(constants))
        # on the host the bounds compute in numpy; on a device the arrays stay there
        return tuple(g if device is not None else np.asarray(g, dtype=np.float64) for g in grads)
