"""Kernel-side calls compiled once per layout on hardware.

A check calls the kernel, its VJP, xla_reference and xla_reference's VJP with a
``Case``. Called eagerly, ``jax.vjp`` traces and linearises the kernel again for every
case and xla_reference's operations dispatch one by one: on an H100 about 0.1 s of host
work per case where the GPU work is a millisecond (the small tier checked 4.6 attention
cases/s). On a hardware backend each such call is one ``jax.jit`` program per layout
(the case's parameters and the call's config and backend): every case of the layout
runs it with new values and no tracing. That is also how users run kernels (inside
``jit``), so XLA fusing the wrapper's operations around a ``pallas_call`` is part of
what is checked; every bound holds for a fused multiply-add (one rounding where the
model charges two) and for a sum in any order within its block.

The interpreters keep the eager calls: there compilation is the cost, not dispatch,
and the interpret suite's compiled programs stay what they were. A spec function that
reads its arrays' values on the host (a tracer error under ``jit``) runs eagerly, as
before, and so does one whose case parameters cannot be hashed.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from pallascheck.kernels.backends import Backend

from .spec import Case

TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)
_eager: set[Callable[..., Any]] = set()  # spec functions that read values on the host


@functools.lru_cache(maxsize=512)
def _program(fn: Callable[..., Any], params: tuple[tuple[str, Any], ...], statics: tuple[Any, ...]) -> Callable[..., Any]:
    def program(arrays: dict[str, Any]) -> Any:
        return fn(Case(dict(arrays), dict(params)), *statics)

    return jax.jit(program)


def call(fn: Callable[..., Any], backend: Backend, case: Case, *statics: Any) -> Any:
    """``fn(case, *statics)``: on a hardware backend one compiled program per layout
    (``statics``: the config and backend, hashable), else eagerly."""
    if backend.is_interpreted or fn in _eager:
        return fn(case, *statics)
    params = tuple(sorted(case.params.items()))
    try:
        program = _program(fn, params, statics)
    except TypeError:  # unhashable parameters: no cache key
        return fn(case, *statics)
    try:
        return program(case.arrays)
    except TRACER_ERRORS:
        _eager.add(fn)
        return fn(case, *statics)


def run_kernel(run: Callable[..., Any], case: Case, config: Any, backend: Backend) -> Any:
    """A metamorphic relation's kernel call ``run(case, config, backend)`` on a
    transformed case, compiled per layout like the checks' calls: the transformed
    case keeps the case's layout (a permutation, a negation, a power-of-two scaling),
    so on hardware it runs the program the case compiled. Eager, the relations took
    7.5 of the 27.6 s that 192 small attention cases of 3 layouts took on an H100."""
    return call(run, backend, case, config, backend)
