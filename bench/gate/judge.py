"""``gate(task, candidate)``: the verdict on a candidate kernel for a task.

Order (cheapest first; by default the gate stops at the first failing stage, so a
search loop pays little for a bad candidate, and says what it left unchecked):

1. the jaxprs (nothing runs): the output's shape and dtype, a ``pallas_call`` in the
   forward and (gradients asked) in the backward, no host callbacks, the costly work
   outside Pallas within ``integrity.OUTSIDE_SHARE_LIMIT`` of the reference's;
2. hidden state (``probes.hidden_state``) and, on a GPU, poisoned memory;
3. the property runner's values, gradients and bitwise-determinism checks on every unit
   (``units.plan``: the shown sizes in every dtype, every option set, sizes drawn
   beyond the shown ones), against bounds derived from the task's facts; a value
   failure is named by what explains it (poison, a lower precision, the drawn sizes,
   an option);
4. timing on a GPU (``speed.py``).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pallascheck.bench.gate import integrity, memory, probes, speed, units
from pallascheck.bench.gate.candidate import Candidate, NotLoadable, load_candidate
from pallascheck.bench.gate.task import Task, load_task
from pallascheck.bench.gate.verdict import Reason, Verdict
from pallascheck.kernels.backends import Backend, get_backend
from pallascheck.oracles import derive
from pallascheck.oracles.derive import Facts
from pallascheck.oracles.tolerance import SEQUENTIAL, arithmetic_for
from pallascheck.properties import checks, runner, strategies
from pallascheck.properties.device import compilation
from pallascheck.properties.spec import Case

# A lower precision than declared: every intermediate and every dot operand in bf16, any
# order. An error within this bound and outside the declared one is a precision
# shortfall, not a wrong formula.
LOWER_PRECISION = Facts(compute_dtype="bfloat16", order=SEQUENTIAL, dot_operands="bfloat16")
CHECKS = ("values", "deterministic")
EXCESS_PRECISION = (
    "bf16/f16 intermediates rounded as written: XLA:CPU computed them in f32 (excess precision); "
    f"start the process with XLA_FLAGS={compilation.AS_WRITTEN_CPU_FLAGS[0]} (the corpus study does)"
)


class _Stop(Exception):
    """The first failing stage ended the verdict (``stop_at_first``)."""


def gate(
    task: Task | str,
    candidate: Callable[..., Any] | str,
    *,
    backend: Backend | str | None = None,
    seed: int = 0,
    drawn: int = 2,
    examples: int = 1,
    stop_at_first: bool = True,
    budget_s: float | None = None,
    timed: bool = True,
    dtypes: Sequence[str] | None = None,
) -> Verdict:
    """The verdict on ``candidate`` for ``task`` (a Task, a shipped task's name or a
    task file); ``candidate``: a callable or ``FILE.py:NAME`` / ``MODULE:NAME``.

    ``drawn``: sizes drawn beyond the shown ones; ``examples``: Hypothesis examples per
    unit; ``stop_at_first``: end at the first failing stage; ``budget_s``: start no
    unit after this many seconds (those left are listed as not checked); ``timed``:
    time the candidate on hardware; ``dtypes``: only these of the task's dtypes (None:
    all)."""
    start = time.perf_counter()
    if drawn < 0 or examples < 1:
        raise ValueError(f"gate: drawn must be >= 0 and examples >= 1, got drawn={drawn}, examples={examples}")
    task = (load_task(task) if isinstance(task, str) else task).only_dtypes(dtypes)
    backend = get_backend(backend)
    source = candidate if isinstance(candidate, str) else ""
    name = source or getattr(candidate, "__qualname__", repr(candidate))
    verdict = Verdict(task.name, name, str(backend), seed, environment=_environment(backend))
    replay = _replay(task, source, backend, seed, drawn, examples, dtypes)
    try:
        loaded = load_candidate(candidate) if isinstance(candidate, str) else Candidate(candidate, "")
        _judge(task, loaded, backend, seed, drawn, examples, stop_at_first, budget_s, timed, verdict, replay, start)
    except NotLoadable as err:
        verdict.reasons.append(Reason("not_loadable", str(err), replay=replay))
        verdict.not_checked.append("every check: there is no candidate to run")
    except _Stop:
        pass
    verdict.seconds = time.perf_counter() - start
    return verdict


def _environment(backend: Backend) -> dict[str, str]:
    device = jax.devices(backend.platform)[0]
    return {"jax": jax.__version__, "device": device.device_kind, "platform": backend.platform}


def _replay(
    task: Task, source: str, backend: Backend, seed: int, drawn: int, examples: int, dtypes: Sequence[str] | None
) -> str:
    if not source:
        only = "" if dtypes is None else f", dtypes={list(task.dtypes)!r}"
        return f"gate(TASK {task.name}, the candidate, backend={str(backend)!r}, seed={seed}, drawn={drawn}{only})"
    command = shlex.join(
        ["pallascheck", "gate", task.name, source, "--backend", str(backend), "--seed", str(seed)]
        + ["--drawn", str(drawn), "--examples", str(examples)]
        + [arg for d in (() if dtypes is None else task.dtypes) for arg in ("--dtype", d)]
    )
    as_written = backend.platform == "cpu" and not compilation.excess_precision_allowed()
    return f"XLA_FLAGS={compilation.AS_WRITTEN_CPU_FLAGS[0]} {command}" if as_written else command


def _judge(
    task: Task,
    candidate: Candidate,
    backend: Backend,
    seed: int,
    drawn: int,
    examples: int,
    stop_at_first: bool,
    budget_s: float | None,
    timed: bool,
    verdict: Verdict,
    replay: str,
    start: float,
) -> None:
    plan = units.plan(task, seed, drawn)
    shown = plan[0]
    later = ["hidden state", "poisoned memory", "values, gradients and determinism on every unit", "timing"]

    def stage_done(stage: str) -> None:
        later.remove(stage)
        if stop_at_first and verdict.reasons:
            verdict.not_checked.extend(f"{s} (stopped at the first failing stage)" for s in later)
            raise _Stop

    # the jaxprs of a fresh copy, where there is one: tracing runs the candidate's Python,
    # and a stateful candidate must meet the probes with its state untouched
    _static(task, candidate.fresh() or candidate, shown, backend, verdict, replay)
    later.insert(0, "jaxprs")
    stage_done("jaxprs")

    state, both_orders = _probe(
        verdict, replay, shown, lambda: probes.hidden_state(task, candidate, shown, backend, seed)
    )
    if not both_orders:
        verdict.not_checked.append(
            "hidden state in the order B then A: the candidate has no module-level name to reload"
        )
    verdict.checked.append({"check": "hidden_state", "unit": shown.label(), "passed": state is None})
    if state is not None:
        verdict.reasons.append(
            Reason(
                "hidden_state",
                f"{state.order}: the first call within its bound (budget used {state.first:.3g}), the later one "
                f"outside it ({state.later:.3g})",
                {"order": state.order, "detail": state.detail},
                replay,
            )
        )
    # two calls on one input, as a user makes them (outside any compiled program of the
    # property runner, which on hardware traces a candidate's Python once per layout)
    differing, elements = _probe(
        verdict, replay, shown, lambda: probes.rerun_differs(task, candidate, shown, backend, seed)
    )
    verdict.checked.append({"check": "rerun_bits", "unit": shown.label(), "passed": differing == 0})
    if differing:
        verdict.reasons.append(
            Reason(
                "nondeterministic",
                f"two calls on one input of {shown.label()}: {differing} of {elements} output elements differ in their bits",
                {"unit": shown.label(), "differing": differing, "elements": elements},
                replay,
            )
        )
    stage_done("hidden state")

    poisoned = _probe(verdict, replay, shown, lambda: probes.poisoned_run(task, candidate, shown, backend, seed))
    if poisoned is None:
        verdict.not_checked.append(memory.ON_CPU)
    else:
        outcome, poisoned_bytes, nan_where_finite = poisoned
        verdict.checked.append(
            {"check": "poisoned_memory", "unit": shown.label(), "passed": not nan_where_finite, "bytes": poisoned_bytes}
        )
        # only NaN where the oracle is finite is the poison's doing; an output wrong in
        # other ways (zeros, a lower precision) is judged by the value checks, which say why
        if nan_where_finite:
            verdict.reasons.append(
                Reason(
                    "poisoned_output",
                    f"after {poisoned_bytes / 2**30:.1f} GiB of free device memory was filled with NaN: {outcome.detail}",
                    {"budget_used": outcome.budget_used},
                    replay,
                )
            )
    if backend.is_interpreted:
        verdict.not_checked.append(probes.RACES_ON_INTERPRETERS)
    stage_done("poisoned memory")
    if backend.platform == "cpu" and compilation.excess_precision_allowed():
        verdict.not_checked.append(EXCESS_PRECISION)

    _properties(task, candidate, plan, backend, seed, examples, stop_at_first, budget_s, verdict, replay, start)
    stage_done("values, gradients and determinism on every unit")

    if timed:
        verdict.timing = speed.time_candidate(task, candidate, shown, backend, seed)
        if verdict.timing.get("revalidated") is False:
            verdict.reasons.append(
                Reason(
                    "wrong_when_timed",
                    "an output of the timed calls is outside its bound",
                    {"worst_budget": verdict.timing["revalidated_worst_budget"]},
                    replay,
                )
            )
    else:
        verdict.timing = {"status": "not timed", "summary": "not timed (timed=False)"}
    later.remove("timing")


def _static(
    task: Task, candidate: Candidate, shown: units.Unit, backend: Backend, verdict: Verdict, replay: str
) -> None:
    case = units.case(task, shown, 0)
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in units.arguments(task, case)]
    interpret = backend.interpret_arg()

    def kernel(*a: Any) -> Any:
        return candidate.call(interpret, *a, **shown.options)

    def reference(*a: Any) -> Any:
        return task.reference(*a, **shown.options)

    try:
        jaxpr = integrity.trace(kernel, *args)
    except Exception as err:  # noqa: BLE001 - a candidate that cannot be traced on the task's shown input fails
        verdict.reasons.append(
            Reason("crash", f"tracing at the shown sizes raised {type(err).__name__}: {err}"[:600], replay=replay)
        )
        return
    want = jax.eval_shape(reference, *args)
    got = jaxpr.out_avals
    if len(got) != 1 or got[0].shape != want.shape or got[0].dtype != (task.facts.out_dtype or want.dtype):
        verdict.reasons.append(
            Reason(
                "wrong_signature",
                f"returns {[(a.shape, str(a.dtype)) for a in got]}, the task wants one {want.shape} {want.dtype}",
                replay=replay,
            )
        )
        return
    _anatomy_reasons(
        "forward", integrity.anatomy(jaxpr), integrity.anatomy(integrity.trace(reference, *args)), verdict, replay
    )
    verdict.checked.append({"check": "jaxpr", "unit": shown.label(), "passed": not verdict.reasons})
    if task.gradients:
        wrt = tuple(i for i, a in enumerate(task.inputs.values()) if a.differentiable and a.dtype is None)
        arrays = tuple(jax.numpy.asarray(a) for a in units.arguments(task, case))
        cotangent = jax.numpy.ones(want.shape, want.dtype)
        try:
            with backend.placement():
                backward = integrity.pullback_jaxpr(kernel, arrays, wrt, cotangent)
                reference_backward = integrity.pullback_jaxpr(reference, arrays, wrt, cotangent)
        except Exception as err:  # noqa: BLE001 - no VJP where the task asks for gradients fails
            verdict.reasons.append(
                Reason("crash", f"the VJP at the shown sizes raised {type(err).__name__}: {err}"[:600], replay=replay)
            )
            return
        mine, theirs = integrity.anatomy(backward), integrity.anatomy(reference_backward)
        if mine.pallas_calls == 0:
            verdict.reasons.append(
                Reason(
                    "no_pallas_call_in_vjp",
                    "the backward pass holds no Pallas kernel",
                    {"outside_flops": mine.outside},
                    replay,
                )
            )
        _anatomy_reasons("backward", mine, theirs, verdict, replay)


def _anatomy_reasons(
    which: str, mine: integrity.Anatomy, theirs: integrity.Anatomy, verdict: Verdict, replay: str
) -> None:
    if which == "forward" and mine.pallas_calls == 0:
        verdict.reasons.append(
            Reason(
                "no_pallas_call",
                f"the jaxpr holds no Pallas kernel ({', '.join(integrity.KERNELS)})",
                {"outside_flops": mine.outside},
                replay,
            )
        )
    if mine.callbacks:
        verdict.reasons.append(
            Reason("host_callback", f"the {which} jaxpr calls {sorted(set(mine.callbacks))}", {}, replay)
        )
    if theirs.outside_cost == 0:
        verdict.not_checked.append(
            f"work outside Pallas ({which}): the reference has no costly primitive to compare with"
        )
        return
    share = mine.outside_cost / theirs.outside_cost
    if share > integrity.OUTSIDE_SHARE_LIMIT and mine.pallas_calls > 0:
        verdict.reasons.append(
            Reason(
                "work_outside_pallas",
                f"the {which} pass does {share:.0%} of the reference's costly work outside pallas_call "
                f"(limit {integrity.OUTSIDE_SHARE_LIMIT:.1%}): {', '.join(f'{k} {v:.3g} flops' for k, v in mine.heaviest())}",
                {"share": share, "outside_flops": mine.outside, "reference_flops": theirs.outside},
                replay,
            )
        )
    if mine.unknown_trips:
        verdict.not_checked.append(
            f"work outside Pallas ({which}): {mine.unknown_trips} while loop(s) counted once each"
        )


def _properties(
    task: Task,
    candidate: Candidate,
    plan: list[units.Unit],
    backend: Backend,
    seed: int,
    examples: int,
    stop_at_first: bool,
    budget_s: float | None,
    verdict: Verdict,
    replay: str,
    start: float,
) -> None:
    selected = CHECKS + (("gradients",) if task.gradients else ())
    with tempfile.TemporaryDirectory(prefix="pallascheck-gate-") as failures:
        for index, unit in enumerate(plan):
            if budget_s is not None and time.perf_counter() - start > budget_s:
                verdict.not_checked.extend(f"unit {u.label()} (time budget {budget_s:g} s spent)" for u in plan[index:])
                return
            unverifiable = units.Unverifiable()
            spec = units.unit_spec(task, candidate, unit, index, unverifiable)
            tally = runner.run_property(
                spec,
                unit.dtype,
                backend,
                examples=examples,
                seed=runner.derived_seed(seed, unit.label()),
                selected=selected,
                failure_dir=failures,
                replay_hint=replay,
            )
            for check, outcome in tally.outcomes.items():
                entry = {
                    "check": check,
                    "unit": unit.label(),
                    "passed": outcome.passed,
                    "budget_used": outcome.budget_used,
                    "cases": outcome.examples,
                }
                if check in ("values", "gradients"):
                    entry |= {"elements": unverifiable.elements, "unverifiable": unverifiable.unverifiable}
                verdict.checked.append(entry)
                _note_worst(verdict, outcome, unit)
            _say_unverifiable(verdict, unit, unverifiable)
            for finding in tally.findings:
                verdict.reasons.append(_reason(task, spec, unit, backend, finding, failures, replay))
            if stop_at_first and verdict.reasons:
                verdict.not_checked.extend(
                    f"unit {u.label()} (stopped at the first failing unit)" for u in plan[index + 1 :]
                )
                return


def _say_unverifiable(verdict: Verdict, unit: units.Unit, unverifiable: units.Unverifiable) -> None:
    """Elements no bound holds for were not compared: said, never folded into a pass."""
    if not unverifiable.unverifiable:
        return
    counted = f"{unverifiable.unverifiable} of {unverifiable.elements} elements"
    verdict.not_checked.append(
        f"unit {unit.label()}: {counted} unverifiable, not compared (first at {unverifiable.first}): "
        "the inputs put them within the error bounds of a decision, where a correct kernel may go either way"
    )
    if unverifiable.checked_little:
        verdict.not_checked.append(
            f"unit {unit.label()} checked little: {unverifiable.share:.0%} of its elements unverifiable, more than "
            f"{units.CHECKED_LITTLE_SHARE:.0%}; a fault at one element escapes its value checks more often than not"
        )


def _probe[T](verdict: Verdict, replay: str, unit: units.Unit, probe: Callable[[], T]) -> T:
    """``probe()``; a candidate that raises in it (it does not lower on this backend, it
    fails at run time) ends the verdict with a ``crash`` reason naming the exception."""
    try:
        return probe()
    except Exception as err:  # noqa: BLE001 - whatever the candidate raises is its verdict
        first_line = (str(err).strip().splitlines() or [""])[0]
        verdict.reasons.append(
            Reason(
                "crash",
                f"at {unit.label()}: {type(err).__name__}: {first_line}"[:400],
                {"unit": unit.label(), "exception": type(err).__name__, "message": str(err)[:2000]},
                replay,
            )
        )
        verdict.not_checked.append("every later stage: the candidate raised")
        raise _Stop from err


def _note_worst(verdict: Verdict, outcome: checks.Outcome, unit: units.Unit) -> None:
    worst = outcome.worst
    if worst is None or worst.error is None or worst.bound is None:
        return
    if verdict.worst is None or outcome.budget_used > verdict.worst["budget_used"]:
        verdict.worst = {
            "error": worst.error,
            "bound": worst.bound,
            "budget_used": outcome.budget_used,
            "where": f"{outcome.check} {worst.name}{list(worst.index)} of {unit.label()}",
        }


def _reason(
    task: Task, spec: Any, unit: units.Unit, backend: Backend, finding: runner.Finding, failures: str, replay: str
) -> Reason:
    evidence: dict[str, Any] = {"unit": unit.label(), "message": finding.message[:2000]}
    if finding.outcome is not None and finding.outcome.worst is not None:
        evidence["worst"] = dataclasses.asdict(finding.outcome.worst)
    first_line = finding.message.splitlines()[1].strip() if "\n" in finding.message else finding.message
    if finding.check == "crash":
        wrong = "must return one array of shape" in finding.message
        return Reason("wrong_signature" if wrong else "crash", first_line[:400], evidence, replay)
    if finding.check == "deterministic":
        return Reason("nondeterministic", f"at {unit.label()}: {first_line}"[:400], evidence, replay)
    if finding.check == "gradients":
        return Reason("wrong_gradients", f"at {unit.label()}: {first_line}"[:400], evidence, replay)
    name = _value_reason(task, spec, unit, backend, finding, failures)
    return Reason(name, f"at {unit.label()}: {first_line}"[:400], evidence, replay)


def _value_reason(
    task: Task, spec: Any, unit: units.Unit, backend: Backend, finding: runner.Finding, failures: str
) -> str:
    """What explains a value failure, from the failing case saved by the runner: NaN
    where the oracle is finite (the interpreter's and the gate's poison), an error a
    lower precision explains, else where it happened (drawn sizes, an option, the shown
    sizes)."""
    path = runner.failure_path(failures, spec.name, unit.dtype, finding.check)
    if os.path.exists(path):
        case = Case.load(path)
        case = Case({k: v for k, v in case.arrays.items()}, {})
        judged = probes.judged(spec, case, backend)
        # on a device, its free memory poisoned before each call, as in the poisoned-memory
        # probe: an unwritten tile then reads NaN, never a stale buffer's changing bytes
        poison = probes.poisoner(backend)
        out, again = (np.asarray(jax.device_get(probes.run(spec, case, backend, before=poison))) for _ in range(2))
        # a failure that comes and goes between calls on one input (a flipped bit every
        # other call, a race) is nondeterminism, whichever call the value check saw
        if probes.differing_elements(out, again):
            return "nondeterministic"
        if probes.nan_where_finite(out, judged.expected):
            return "poisoned_output"
        if _lower_precision_explains(task, unit, backend, case, out):
            return "lower_precision"
    return {"drawn": "wrong_beyond_shown_shapes", "option": "wrong_under_option"}.get(unit.kind, "wrong_values")


def _lower_precision_explains(task: Task, unit: units.Unit, backend: Backend, case: Case, out: np.ndarray) -> bool:
    """Whether ``out`` is within the bound of ``LOWER_PRECISION``, on the inputs as given
    or with the float inputs rounded to bf16 first (a kernel that casts its inputs down)."""
    exact = tuple(case.arrays[n] for n in task.inputs)
    rounded = tuple(
        a.astype(strategies.np_dtype("bfloat16")) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating) else a
        for a in exact
    )
    for args in (exact, rounded):
        with backend.placement():
            lower = derive.derive(
                lambda *a: task.reference(*a, **unit.options),
                args,
                facts=LOWER_PRECISION,
                arith=arithmetic_for(backend),
            )
        # an element the lower precision leaves unverifiable cannot show that it explains
        # the error there (bf16 leaves softmax's row max undecided: as no bound, it would
        # "explain" an output of zeros)
        bound = np.where(lower.unverifiable[0], np.nan, lower.bounds[0])
        if checks.compare(out, lower.values[0], bound).passed:
            return True
    return False
