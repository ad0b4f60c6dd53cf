"""Probes the property runner does not make: state carried between calls, and outputs
on poisoned memory.

Hidden state: inputs A and B of the shown sizes (different values), A then B on the
candidate, B then A on a fresh copy of it (its module executed again: none of the first
copy's state). A first call within its bound and a later one outside it, in either
order, is state carried from the earlier call (a cache keyed by shape, the previous
call's result returned). A candidate wrong on its first call is left to the values
checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from pallascheck.bench.gate import memory, units
from pallascheck.bench.gate.candidate import Candidate
from pallascheck.bench.gate.task import Task
from pallascheck.kernels.backends import Backend
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import checks
from pallascheck.properties.spec import Case, KernelSpec


@dataclasses.dataclass(frozen=True)
class Judged:
    """A case's float64 oracle and bound, and a judge of any output for it."""

    expected: np.ndarray
    bound: np.ndarray

    def __call__(self, out: Any) -> checks.Outcome:
        return checks.compare(np.asarray(jax.device_get(out)), self.expected, self.bound)


def judged(spec: KernelSpec, case: Case, backend: Backend) -> Judged:
    ref = spec.oracle(case)
    config = spec.default_config_for(backend)
    return Judged(np.asarray(spec.expected(ref)), np.asarray(spec.bound(case, ref, config, arithmetic_for(backend))))


def run(spec: KernelSpec, case: Case, backend: Backend, before: Callable[[], Any] | None = None) -> Any:
    """The candidate's output on ``case`` (``before()`` called first: the poison)."""
    with backend.placement():
        if before is not None:
            before()
        return jax.block_until_ready(spec.kernel(case, spec.default_config_for(backend), backend))


@dataclasses.dataclass(frozen=True)
class StateFinding:
    order: str  # "A then B" or "B then A"
    first: float  # budget used by the first call
    later: float  # by the later call
    detail: str


def hidden_state(
    task: Task, candidate: Candidate, unit: units.Unit, backend: Backend, seed: int
) -> tuple[StateFinding | None, bool]:
    """The first order in which a later call went wrong after a right first call while
    the same input was right as a first call (None: none did), and whether both orders
    were run (False: no fresh copy to run B then A). An input wrong in both orders is a
    wrong value, not state: it is left to the values checks. Without a fresh copy there
    is nothing to contrast with, and a later call wrong after a right first one is taken
    as state."""
    spec = units.unit_spec(task, candidate, unit, 0)
    a, b = units.case(task, unit, seed), units.case(task, unit, seed + 7919)
    judge = {"A": judged(spec, a, backend), "B": judged(spec, b, backend)}
    cases = {"A": a, "B": b}
    fresh = candidate.fresh()
    orders = [("A", "B", spec)]
    if fresh is not None:
        orders.append(("B", "A", units.unit_spec(task, fresh, unit, 0)))
    first_right: dict[str, bool] = {}
    wrong_later: list[StateFinding] = []
    for first, later, on in orders:
        first_outcome = judge[first](run(on, cases[first], backend))
        later_outcome = judge[later](run(on, cases[later], backend))
        first_right[first] = first_outcome.passed
        if first_outcome.passed and not later_outcome.passed:
            wrong_later.append(
                StateFinding(
                    f"{first} then {later}",
                    first_outcome.budget_used,
                    later_outcome.budget_used,
                    later_outcome.detail,
                )
            )
    for finding in wrong_later:
        later = finding.order[-1]
        if first_right.get(later, True):  # right as a first call, or no fresh copy to tell
            return finding, fresh is not None
    return None, fresh is not None


def differing_elements(first: np.ndarray, second: np.ndarray) -> int:
    """How many elements of two outputs of one input differ in their bits (all of them
    where shape or dtype differ)."""
    if first.shape != second.shape or first.dtype != second.dtype:
        return int(first.size)
    as_bytes = [np.frombuffer(a.tobytes(), np.uint8).reshape(a.size, a.dtype.itemsize) for a in (first, second)]
    return int(np.any(as_bytes[0] != as_bytes[1], axis=1).sum())


def nan_where_finite(out: np.ndarray, expected: np.ndarray) -> bool:
    """Whether a float output holds NaN where the oracle is finite (the poison, or
    Pallas' interpreter's NaN fill, read back from an unwritten tile)."""
    floating = bool(jax.numpy.issubdtype(out.dtype, jax.numpy.floating))
    return floating and bool(np.any(np.isnan(out.astype(np.float64)) & np.isfinite(expected)))


def rerun_differs(task: Task, candidate: Candidate, unit: units.Unit, backend: Backend, seed: int) -> tuple[int, int]:
    """(elements whose bits differ, elements) between two calls in a row on one input."""
    spec = units.unit_spec(task, candidate, unit, 0)
    case = units.case(task, unit, seed + 3)
    first, second = (np.asarray(jax.device_get(run(spec, case, backend))) for _ in range(2))
    return differing_elements(first, second), int(first.size)


# What the run-twice checks cannot show on an interpreter (said in its verdicts).
RACES_ON_INTERPRETERS = (
    "races between a grid's programs (atomic adds in the order they land, writes to one tile): an "
    "interpreter runs the programs one after another, so two calls never differ for that reason; a GPU's "
    "run-twice checks show it"
)


def poisoner(backend: Backend) -> Callable[[], int] | None:
    """A function that poisons the free memory of ``backend``'s device and returns the
    bytes poisoned; None where the device has no allocator to poison (the CPU:
    ``memory.ON_CPU``)."""
    device = jax.devices(backend.platform)[0]
    if not memory.has_pool(device):
        return None
    return lambda: memory.poison_free_memory(device) or 0


def poisoned_run(
    task: Task, candidate: Candidate, unit: units.Unit, backend: Backend, seed: int
) -> tuple[checks.Outcome, int, bool] | None:
    """The shown unit run twice, the device's free memory poisoned before each call, the
    second output judged (the first call's freed buffers are in the pool then): its
    outcome, the bytes poisoned and whether it holds NaN where the oracle is finite
    (the poison read back); None where there is no allocator to poison."""
    poison = poisoner(backend)
    if poison is None:
        return None
    spec = units.unit_spec(task, candidate, unit, 0)
    a, b = units.case(task, unit, seed + 1), units.case(task, unit, seed + 2)
    poisoned: list[int] = []

    def before() -> None:
        poisoned.append(poison())

    run(spec, a, backend, before=before)
    out = run(spec, b, backend, before=before)
    judge = judged(spec, b, backend)
    return judge(out), min(poisoned), nan_where_finite(np.asarray(jax.device_get(out)), judge.expected)
