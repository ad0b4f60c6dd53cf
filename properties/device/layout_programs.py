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
before, and so does one whose case parameters cannot be hashed; on hardware its numpy
inputs are placed on the device first, as a program's are (``numeric.placed``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import jax
import numpy as np

from pallascheck.kernels.backends import Backend
from pallascheck.oracles import numeric
from pallascheck.properties.spec import Case

_TRACER_ERRORS = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
)
_eager: set[Callable[..., Any]] = set()  # spec functions that read values on the host
_ARGUMENT = object()  # in a program's statics: the place of an argument holding arrays


def holds_arrays(arg: Any) -> bool:
    # a ShapeDtypeStruct stands for an array in a program compiled ahead (``compile_ahead``)
    return isinstance(arg, Mapping) or any(
        isinstance(a, (np.ndarray, jax.Array, jax.ShapeDtypeStruct)) for a in jax.tree_util.tree_leaves(arg)
    )


@dataclasses.dataclass(frozen=True)
class _Program:
    """A spec function's ``jax.jit`` program for one layout, and the argument
    signatures it was compiled for ahead of a run (``_compile``): kept with the program,
    so they go when the cache drops it."""

    run: jax.stages.Wrapped
    compiled_for: set[tuple[Any, ...]] = dataclasses.field(default_factory=set)


# Room for the kernel-side programs and the device oracles' (properties/device/programs.py)
# of every layout a run keeps using.
@functools.lru_cache(maxsize=1024)
def _program(
    fn: Callable[..., Any],
    params: tuple[tuple[str, Any], ...],
    statics: tuple[Any, ...],
    options: tuple[tuple[str, str], ...],
) -> _Program:
    """``fn(case, *rest)`` compiled: ``rest`` is ``statics`` with the arguments that
    hold arrays put back in their places (``_ARGUMENT``)."""

    def program(arrays: Mapping[str, Any], dynamic: tuple[Any, ...]) -> Any:
        given = iter(dynamic)
        rest = [next(given) if s is _ARGUMENT else s for s in statics]
        return fn(Case(dict(arrays), dict(params)), *rest)

    return _Program(jax.jit(program, compiler_options=dict(options) or None))


_compiling = threading.Lock()  # guards every _Program.compiled_for


def _compile(program: _Program, *args: Any) -> None:
    """Compile ``program`` for ``args``' shapes once, ahead of running it: jax.jit keeps
    the executable, and the call that follows reuses it."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    signature = (tree, tuple((np.shape(a), str(getattr(a, "dtype", type(a)))) for a in leaves))
    with _compiling:
        if signature in program.compiled_for:
            return
    program.run.lower(*args).compile()
    with _compiling:
        program.compiled_for.add(signature)


def _traced(*args: Any) -> bool:
    return any(isinstance(a, jax.core.Tracer) for a in jax.tree_util.tree_leaves(args))


def compiled(
    fn: Callable[..., Any],
    case: Case,
    *rest: Any,
    compiler_options: Mapping[str, str] | None = None,
    run_alone: AbstractContextManager[Any] | None = None,
    place_inputs: bool = True,
) -> Any:
    """``fn(case, *rest)`` as one ``jax.jit`` program per layout: the case's parameters,
    its arrays' shapes and dtypes, and the hashable arguments in ``rest``; the
    arguments holding arrays (an oracle pytree, a mapping of gradients) are the
    program's inputs. A function that reads its arrays' values on the host (a tracer
    error under ``jit``) runs eagerly from then on, and so does a call whose
    arguments cannot be hashed. ``run_alone``: a lock held while the program runs (to
    its end) but not while it compiles, so that programs called from several threads
    compile at once and run one at a time. ``place_inputs``: the numpy inputs go to
    the device, and are waited for, before the program is called (``numeric.placed``), and so
    before an eager call's operations, each of which would copy them itself while
    other threads dispatch (ragged_dot's device oracle reads its group sizes on the
    host, and runs so); False hands them over as they are."""
    alone = run_alone if run_alone is not None else contextlib.nullcontext()
    traced = _traced(case.arrays, rest)  # inside another program: it runs as part of that
    if place_inputs and not traced:
        arrays, rest = numeric.placed((dict(case.arrays), rest))
        case = Case(arrays, case.params)
    if fn in _eager:
        with alone:
            return fn(case, *rest)
    dynamic = tuple(r for r in rest if holds_arrays(r))
    statics = tuple(_ARGUMENT if holds_arrays(r) else r for r in rest)
    options = tuple(sorted((compiler_options or {}).items()))
    try:
        program = _program(fn, tuple(sorted(case.params.items())), statics, options)
    except TypeError:  # unhashable parameters: no cache key
        with alone:
            return fn(case, *rest)
    try:
        if traced or run_alone is None:
            return program.run(case.arrays, dynamic)
        _compile(program, case.arrays, dynamic)
        with run_alone:
            return jax.block_until_ready(program.run(case.arrays, dynamic))
    except _TRACER_ERRORS:
        _eager.add(fn)
        with alone:
            return fn(case, *rest)


def compile_ahead(
    fn: Callable[..., Any], case: Case, *rest: Any, compiler_options: Mapping[str, str] | None = None
) -> None:
    """Compile ``fn(case, *rest)``'s program as ``compiled`` would, without running it:
    its arrays may be ``jax.ShapeDtypeStruct`` (an input another program will compute),
    so that programs a caller will run one after another compile at once, on threads.
    Nothing for a function that runs eagerly."""
    if fn in _eager:
        return
    dynamic = tuple(r for r in rest if holds_arrays(r))
    statics = tuple(_ARGUMENT if holds_arrays(r) else r for r in rest)
    options = tuple(sorted((compiler_options or {}).items()))
    try:
        program = _program(fn, tuple(sorted(case.params.items())), statics, options)
    except TypeError:  # unhashable parameters: compiled when called, if ever
        return
    try:
        _compile(program, case.arrays, dynamic)
    except _TRACER_ERRORS:
        _eager.add(fn)


def call(fn: Callable[..., Any], backend: Backend, case: Case, *statics: Any, place_inputs: bool = True) -> Any:
    """``fn(case, *statics)``: on a hardware backend one compiled program per layout
    (``statics``: the config and backend, hashable; ``place_inputs`` as ``compiled``
    takes it), else eagerly."""
    if backend.is_interpreted:
        return fn(case, *statics)
    return compiled(fn, case, *statics, place_inputs=place_inputs)


def run_kernel(run: Callable[..., Any], case: Case, config: Any, backend: Backend) -> Any:
    """A metamorphic relation's kernel call ``run(case, config, backend)`` on a
    transformed case, compiled per layout like the checks' calls: the transformed
    case keeps the case's layout (a permutation, a negation, a power-of-two scaling),
    so on hardware it runs the program the case compiled. Eager, the relations took
    7.5 of the 27.6 s that 192 small attention cases of 3 layouts took on an H100."""
    return call(run, backend, case, config, backend)
