"""What the gate checks a candidate on: units of (sizes, options, dtype), each a spec
derived from the task's reference (``from_reference``) around the candidate, and the
concrete cases the probes use."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from pallascheck.bench.gate.candidate import Candidate
from pallascheck.bench.gate.task import Dims, Task
from pallascheck.kernels.backends import NAMES
from pallascheck.oracles.tolerance import Arithmetic
from pallascheck.properties import strategies
from pallascheck.properties.families.derived import AS_WRITTEN, DerivedOracle, Input, from_reference
from pallascheck.properties.spec import Case, KernelSpec

# A unit whose value checks left more than this share of its elements unverifiable
# "checked little": a fault at one element, placed independently of the near-ties the
# inputs decide, escapes the check with probability equal to that share, so beyond 1/2
# the check misses such a fault more often than it finds it.
CHECKED_LITTLE_SHARE = 0.5


@dataclasses.dataclass(frozen=True)
class Unit:
    """One compiled layout the gate checks: ``kind`` "shown" (the sizes the author was
    shown, default options), "option" (shown sizes, another option set) or "drawn"
    (sizes drawn beyond the shown ones, default options)."""

    kind: str
    dims: Dims
    options: dict[str, Any]
    dtype: str

    def label(self) -> str:
        dims = ",".join(f"{k}={v}" for k, v in self.dims.items())
        options = "".join(f" {k}={v!r}" for k, v in self.options.items())
        return f"{self.kind} {dims} {self.dtype}{options}"


def plan(task: Task, seed: int, drawn: int) -> list[Unit]:
    """The shown sizes in every dtype, each other option set at the shown sizes, and
    ``drawn`` sizes drawn from the domain by ``seed`` (the dtypes in turn)."""
    shown, default = dict(task.shown), task.default_options()
    units = [Unit("shown", shown, default, d) for d in task.dtypes]
    units += [Unit("option", shown, options, task.dtypes[0]) for options in task.option_sets()[1:]]
    units += [
        Unit("drawn", dims, default, task.dtypes[i % len(task.dtypes)])
        for i, dims in enumerate(task.draw_dims(seed, drawn))
    ]
    return units


def _inputs(task: Task, dims: Dims) -> dict[str, Input]:
    def values(arg_values: Any) -> Any:
        return lambda rng, shape, dtype: arg_values(rng, dims, shape, dtype)

    return {
        name: Input(
            arg.shape_for(dims),
            arg.dtype,
            None if arg.values is None else values(arg.values),
            dims[arg.reduction] if isinstance(arg.reduction, str) else arg.reduction,
            arg.kinds,
            arg.differentiable,
        )
        for name, arg in task.inputs.items()
    }


@dataclasses.dataclass
class Unverifiable:
    """The elements of a unit's cases that no bound holds for, counted as the checks saw
    them. The derivation marks an element unverifiable where an operation of the
    reference decides it from operands closer than their error bounds (a rounding tie, a
    divisor whose interval reaches 0): there a correct kernel may go either way. The
    mark comes from the inputs and the task's facts alone, never from the candidate's
    output, so a candidate cannot make an element unverifiable; it is not compared, and
    the verdict says how many and where."""

    elements: int = 0
    unverifiable: int = 0
    first: str = ""  # where the first one was, and the operation that decided it

    def add(self, name: str, bound: np.ndarray, why: Callable[[tuple[int, ...]], str]) -> None:
        marked = np.isnan(bound)
        self.elements += int(bound.size)
        count = int(marked.sum())
        if count and not self.first:
            at = tuple(int(i) for i in np.argwhere(marked)[0])
            self.first = f"{name}{list(at)} ({why(at)})"
        self.unverifiable += count

    @property
    def share(self) -> float:
        return self.unverifiable / self.elements if self.elements else 0.0

    @property
    def checked_little(self) -> bool:
        return self.share > CHECKED_LITTLE_SHARE


def _unbounded_where_unverifiable(bound: np.ndarray) -> np.ndarray:
    """``from_reference`` marks an unverifiable element with a NaN bound, which fails
    (verify asks the spec's author to draw inputs away from the tie). A gate's task
    cannot steer every draw, and the element is no fault of the candidate's: no bound
    there (an infinite one compares nothing), counted by ``Unverifiable``."""
    return np.where(np.isnan(bound), np.inf, bound)


def unit_spec(
    task: Task, candidate: Candidate, unit: Unit, index: int, unverifiable: Unverifiable | None = None
) -> KernelSpec:
    """The spec of ``candidate`` on ``unit``: oracle and bounds from the task's reference,
    no bound at the elements the derivation finds unverifiable (``unverifiable`` counts
    those of the value and gradient checks)."""

    def kernel(*arrays: jax.Array, interpret: Any) -> Any:
        return candidate.call(interpret, *arrays, **unit.options)

    spec = from_reference(
        kernel,
        functools.partial(task.reference, **unit.options),
        name=f"{task.name}.{index}",
        inputs=_inputs(task, unit.dims),
        facts=task.facts,
        dtypes=(unit.dtype,),
        kinds=task.kinds,
        differentiable=task.gradients,
        # on whichever backend the gate is asked for: where it runs is the candidate's to
        # know (a Mosaic GPU kernel, a generic one), and one that cannot raises there
        backends=NAMES,
        interpret="interpret",
        formulations=[functools.partial(f, **unit.options) for f in task.formulations],
        gradient_formulations=[functools.partial(f, **unit.options) for f in task.gradient_formulations],
    )
    values_bound, gradients = spec.bound, spec.gradients

    def counted(config: Any, arith: Arithmetic) -> bool:
        # the checks' own bound, once a case: not xla_reference's, not the probabilistic one
        return unverifiable is not None and config is not None and not arith.probabilistic

    def bound(case: Case, ref: DerivedOracle, config: Any, arith: Arithmetic) -> np.ndarray:
        b = np.asarray(values_bound(case, ref, config, arith))
        if counted(config, arith) and unverifiable is not None:
            unverifiable.add("out", b, lambda at: ref.values(config or AS_WRITTEN, arith).explain(0, at))
        return _unbounded_where_unverifiable(b)

    spec = dataclasses.replace(spec, bound=bound)
    if gradients is not None:
        gradient_bound = gradients.bound

        def grad_bound(case: Case, ref: Any, grads: Any, config: Any, arith: Arithmetic) -> dict[str, np.ndarray]:
            bounds = {k: np.asarray(v) for k, v in gradient_bound(case, ref, grads, config, arith).items()}
            if counted(config, arith) and unverifiable is not None:
                for k, b in bounds.items():
                    unverifiable.add(k, b, lambda at: "the derivation of the reference's VJP")
            return {k: _unbounded_where_unverifiable(b) for k, b in bounds.items()}

        spec = dataclasses.replace(spec, gradients=dataclasses.replace(gradients, bound=grad_bound))
    return spec


def case(task: Task, unit: Unit, seed: int) -> Case:
    """Normal-kind inputs of ``unit`` from ``seed`` (the probes' inputs)."""
    arrays: dict[str, np.ndarray] = {}
    for i, (name, arg) in enumerate(task.inputs.items()):
        shape = arg.shape_for(unit.dims)
        dtype = strategies.np_dtype(arg.dtype or unit.dtype)
        if arg.values is not None:
            arrays[name] = np.asarray(arg.values(np.random.default_rng(seed + i), unit.dims, shape, dtype)).astype(
                dtype
            )
        else:
            reduction = unit.dims[arg.reduction] if isinstance(arg.reduction, str) else arg.reduction
            arrays[name] = strategies.elements(seed + i, shape, dtype.name, "normal", reduction=reduction)
    return Case(arrays, {})


def arguments(task: Task, case: Case) -> tuple[np.ndarray, ...]:
    return tuple(case.arrays[name] for name in task.inputs)
