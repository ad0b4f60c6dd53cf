"""What the gate checks a candidate on: units of (sizes, options, dtype), each a spec
derived from the task's reference (``from_reference``) around the candidate, and the
concrete cases the probes use."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from pallascheck.bench.gate.candidate import Candidate
from pallascheck.bench.gate.task import Dims, Task
from pallascheck.properties import strategies
from pallascheck.properties.families.derived import Input, from_reference
from pallascheck.properties.spec import Case, KernelSpec


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


def unit_spec(task: Task, candidate: Candidate, unit: Unit, index: int) -> KernelSpec:
    """The spec of ``candidate`` on ``unit``: oracle and bounds from the task's reference."""

    def kernel(*arrays: jax.Array, interpret: Any) -> Any:
        return candidate.call(interpret, *arrays, **unit.options)

    return from_reference(
        kernel,
        functools.partial(task.reference, **unit.options),
        name=f"{task.name}.{index}",
        inputs=_inputs(task, unit.dims),
        facts=task.facts,
        dtypes=(unit.dtype,),
        kinds=task.kinds,
        differentiable=task.gradients,
        interpret="interpret",
        formulations=[functools.partial(f, **unit.options) for f in task.formulations],
        gradient_formulations=[functools.partial(f, **unit.options) for f in task.gradient_formulations],
    )


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
