"""What a candidate's jaxpr shows: its Pallas calls, its host callbacks, and the costly
work it does outside Pallas, as a share of the reference's cost.

Costs are counted from the jaxpr, primitive by primitive (no run): a dot or a
convolution 2 flops per multiply-add, a reduction, cumulative op or sort one per
element it reads (sorts and top-k times log2 of the sorted length), a transcendental
one per element it writes. Elementwise arithmetic, casts and data movement are not
counted: they are what legitimately surrounds a kernel (padding, casts, reshapes) and
cost bytes, not arithmetic. Sub-jaxprs are walked (jit, custom_vjp/jvp, cond, scan
times its length, while once: its trip count is unknown); a Pallas kernel's body is
where the work should be, so it is not counted. A Pallas kernel is a ``pallas_call``
(the grid form) or a kernel of Pallas' newer forms (``core_map``, ``mpmd_map``: what
``pl.kernel`` and Mosaic GPU's ``plgpu.kernel`` trace to).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

# The share of the reference's costly work a candidate may do outside its Pallas calls.
# Derivation: what an honest kernel leaves to XLA is the sum of per-block partial results
# (a norm's parameter gradients, a split-K matmul's slices): one value per block of at
# least 8 rows (a GPU warp's MMA tile and a TPU vreg have 8 or more rows) for every 8
# rows the reduction reads, so at most 1/8 of the reference's reduction.
OUTSIDE_SHARE_LIMIT = 1 / 8

# The primitives of a Pallas kernel (their bodies are the kernel's code)
KERNELS = ("pallas_call", "core_map", "mpmd_map")
CALLBACKS = ("pure_callback", "io_callback", "ffi_call", "custom_call", "host_callback", "outside_call")
REDUCTIONS = (
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin "
    "cumsum cumprod cummax cummin cumlogsumexp reduce_precision_sum"
).split()
SORTS = ("sort", "top_k", "approx_top_k")
TRANSCENDENTALS = (
    "exp exp2 log log1p expm1 tanh logistic erf erfc erf_inv sin cos tan asin acos atan atan2 sinh cosh "
    "asinh acosh atanh rsqrt sqrt cbrt pow lgamma digamma"
).split()


@dataclasses.dataclass
class Anatomy:
    """A jaxpr's Pallas kernels, its callbacks, and its costly work by primitive."""

    pallas_calls: int = 0  # Pallas kernels (any of KERNELS)
    callbacks: list[str] = dataclasses.field(default_factory=list)
    outside: dict[str, float] = dataclasses.field(default_factory=dict)  # primitive -> flops outside Pallas
    unknown_trips: int = 0  # while loops counted once

    @property
    def outside_cost(self) -> float:
        return sum(self.outside.values())

    def heaviest(self, n: int = 3) -> list[tuple[str, float]]:
        return sorted(self.outside.items(), key=lambda kv: -kv[1])[:n]


def _size(aval: Any) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def primitive_cost(eqn: Any) -> float:
    """The flops ``eqn`` stands for by the rules of the module docstring (0: not costly)."""
    name = eqn.primitive.name
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        k = math.prod(lhs[d] for d in contract)
        return 2.0 * _size(eqn.outvars[0].aval) * k
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2.0 * _size(eqn.outvars[0].aval) * math.prod(rhs) / max(out_features, 1)
    if name in REDUCTIONS:
        return float(_size(eqn.invars[0].aval))
    if name in SORTS:
        shape = eqn.invars[0].aval.shape
        return float(_size(eqn.invars[0].aval)) * max(1.0, math.log2(max(shape[-1] if shape else 1, 2)))
    if name in TRANSCENDENTALS:
        return float(sum(_size(v.aval) for v in eqn.outvars))
    return 0.0


def _subjaxprs(eqn: Any) -> Iterator[Any]:
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jcore.Jaxpr):
                yield item


def anatomy(jaxpr: Any, into: Anatomy | None = None, times: float = 1.0, in_pallas: bool = False) -> Anatomy:
    """Walk ``jaxpr`` (a Jaxpr or ClosedJaxpr) and its sub-jaxprs."""
    into = into if into is not None else Anatomy()
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in CALLBACKS:
            into.callbacks.append(name + (" (inside a Pallas kernel)" if in_pallas else ""))
        if name in KERNELS:
            into.pallas_calls += 1
        elif not in_pallas:
            cost = primitive_cost(eqn)
            if cost:
                into.outside[name] = into.outside.get(name, 0.0) + cost * times
        inner_times = times
        if name == "scan":
            inner_times = times * eqn.params["length"]
        elif name == "while":
            into.unknown_trips += 1
        for sub in _subjaxprs(eqn):
            anatomy(sub, into, inner_times, in_pallas or name in KERNELS)
    return into


def trace(fn: Callable[..., Any], *args: Any) -> Any:
    """The ClosedJaxpr of ``fn(*args)`` (arrays or ShapeDtypeStructs: nothing runs)."""
    return jax.make_jaxpr(fn)(*args)


def pullback_jaxpr(fn: Callable[..., Any], args: tuple[Any, ...], wrt: tuple[int, ...], cotangent: Any) -> Any:
    """The ClosedJaxpr of the pullback of ``fn`` at ``args`` (the backward pass alone: the
    forward runs here, its residuals are the jaxpr's constants)."""

    def partial(*diff: Any) -> Any:
        full = list(args)
        for i, d in zip(wrt, diff):
            full[i] = d
        return fn(*full)

    _, pullback = jax.vjp(partial, *[args[i] for i in wrt])
    return jax.make_jaxpr(pullback)(cotangent)
