"""Oracle gradients: reverse-mode autodiff of a float64 jax.numpy function.

The function is run with float64 enabled, on the CPU, so its VJP is exact up to
float64 rounding; inputs are the kernel's own input values upcast exactly. The
forward and backward pass are compiled as one program: run op by op, every
primitive of the oracle compiles on its own for each new shape, which cost more
than the kernels' own compilation in interpret mode.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from pallascheck.kernels.compat import float64_enabled


def vjp64(
    fn: Callable[..., Any], primals: Sequence[Any], cotangent: Any
) -> tuple[np.ndarray, ...]:
    """Gradients of ``sum(fn(*primals) * cotangent)`` w.r.t. each primal, in float64."""

    def gradients(args: Sequence[jax.Array], ct: jax.Array) -> tuple[jax.Array, ...]:
        _, pullback = jax.vjp(fn, *args)
        return pullback(ct)

    cpu = jax.devices("cpu")[0]
    with float64_enabled(), jax.default_device(cpu):
        args = [np.asarray(p, dtype=np.float64) for p in primals]
        grads = jax.jit(gradients)(args, np.asarray(cotangent, dtype=np.float64))
        return tuple(np.asarray(g, dtype=np.float64) for g in grads)
