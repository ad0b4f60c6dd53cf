"""Apply a KernelSpec's checks to drawn cases, under Hypothesis.

``check_case`` runs every applicable check on one case; ``run_property`` drives
it with Hypothesis and aggregates outcomes per check. Both are used by
``pallascheck verify`` and by the pytest suite.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import math
import os
import random
import re
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, Phase, find, given, settings, target
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase
from hypothesis.errors import HypothesisWarning, NoSuchExample

from pallascheck.kernels.backends import Backend
from pallascheck.kernels.compat import reset_tpu_interpreter
from pallascheck.oracles import numeric
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import check_kinds, checks, pairs, production, strategies
from pallascheck.properties.check_kinds import CHECKS
from pallascheck.properties.device import identity as device_identity
from pallascheck.properties.device import layout_programs
from pallascheck.properties.device import programs as device_programs
from pallascheck.properties.spec import AnyOrderContract, Case, CodePath, KernelSpec, Parameter, ProductionCases


def _np(a: Any) -> np.ndarray:
    return np.asarray(jax.device_get(a))


def config_to_json(config: Any) -> Any:
    return dataclasses.asdict(cast(Any, config)) if dataclasses.is_dataclass(config) else config  # an instance


@dataclasses.dataclass(frozen=True)
class Finding:
    """One failure of a property run: the check that failed ("crash" for an exception
    that is not a CheckFailure), its message, and its outcome (where, error, bound;
    None for a crash)."""

    check: str
    message: str
    outcome: checks.Outcome | None = None


@dataclasses.dataclass
class Tally:
    """Per-check aggregate over examples.

    ``contract_budgets``: the worst budget used under the spec's accuracy contract by
    the outputs of the "values", "gradients" and "reference" checks. The "contract"
    check fails on the kernel's; xla_reference's is reported, never a failure (it is
    the baseline a user writes, not the kernel under test)."""

    outcomes: dict[str, checks.Outcome] = dataclasses.field(default_factory=dict)
    contract_budgets: dict[str, float] = dataclasses.field(default_factory=dict)
    probabilistic_budget: float = 0.0
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # Every distinct failure Hypothesis reported, each under its own check (it reports
    # several at once as an ExceptionGroup: "Hypothesis found 2 distinct failures").
    findings: list[Finding] = dataclasses.field(default_factory=list)
    # the spec's declared code paths (KernelSpec.paths_for) and the cases that reached each
    paths_declared: tuple[str, ...] = ()
    paths_required: tuple[str, ...] = ()  # of those, the ones the spec requires (not inferred)
    paths: dict[str, int] = dataclasses.field(default_factory=dict)
    # the pairs of the spec's declared parameters (KernelSpec.parameters_for, labelled
    # by pairs.label) and the cases that met each
    pairs_declared: tuple[str, ...] = ()
    pairs: dict[str, int] = dataclasses.field(default_factory=dict)
    # checks left out of some cases, and why (xla_reference too large for the device)
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)
    # why the property stopped before its budget with no finding ("" if it did not): the
    # device ran out of memory, which says nothing of the kernel's values
    stopped: str = ""

    @property
    def failure(self) -> str:
        """Every finding's message ("" when the checks passed), the first first."""
        return "\n\n".join(f.message for f in self.findings)

    @property
    def failed_outcome(self) -> checks.Outcome | None:
        """The first failing check's outcome (where, error, bound)."""
        return self.findings[0].outcome if self.findings else None

    def add(self, outcome: checks.Outcome, seconds: float) -> None:
        name = outcome.check
        self.outcomes[name] = self.outcomes[name].merge(outcome) if name in self.outcomes else outcome
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def add_contract_budget(self, check: str, budget: float) -> None:
        self.contract_budgets[check] = max(self.contract_budgets.get(check, 0.0), budget)


def check_case(
    spec: KernelSpec,
    case: Case,
    config: Any,
    backend: Backend,
    *,
    context: checks.Context,
    selected: Sequence[str] = CHECKS,
    tally: Tally | None = None,
) -> Tally:
    """Run the selected checks on one case (on the backend's device: ``Backend.placement``);
    raises CheckFailure on the first failure."""
    tally = tally if tally is not None else Tally()
    if "reference" in selected and spec.reference_bytes is not None:
        needs, limit = spec.reference_bytes(case), production.memory_limit(backend)
        if needs > limit:
            selected = [c for c in selected if c != "reference"]
            tally.left_out["reference"] = (
                f"xla_reference needs ~{needs / 2**30:.0f} GiB at this layout, the process may use {limit / 2**30:.0f} GiB"
            )
    device = oracle_device(backend, case)
    # a streamed case's results held on the host where the process's share would not hold them
    sized = spec.results_on_device_bytes
    hold = device is not None and sized is not None and sized(case) > production.memory_limit(backend)
    with (
        backend.placement(),
        numeric.on_device(device, hold_results=hold) if device is not None else contextlib.nullcontext(),
    ):
        try:
            return _check_case(
                spec,
                case,
                config,
                backend,
                context=context,
                selected=selected,
                tally=tally,
            )
        except checks.CheckFailure as failure:
            raise _explained(spec, case, config, backend, failure) from None


EXPLAINED = ("values", "reference", "gradients", "contract")


def _explained(
    spec: KernelSpec, case: Case, config: Any, backend: Backend, failure: checks.CheckFailure
) -> checks.CheckFailure:
    """``failure`` with the inputs at its worst element and the spec's explanation of
    it appended."""
    worst = failure.outcome.worst
    if failure.outcome.check not in EXPLAINED or worst is None:
        return failure
    notes = [inputs_at(case, worst)]
    if spec.explain is not None:
        config = None if failure.context.config == "xla_reference" else config
        notes.append(spec.explain(case, spec.oracle(case), config, arithmetic_for(backend), failure.outcome))
    detail = "\n  ".join([failure.outcome.detail, *notes])
    return checks.CheckFailure(dataclasses.replace(failure.outcome, detail=detail), failure.context)


# An input's slice at the worst element is printed value by value up to this many
# elements, and as its range of magnitudes beyond
SHOWN_VALUES = 8


def inputs_at(case: Case, worst: checks.Worst) -> str:
    """The case's inputs where the worst output element reads them, as far as shapes
    tell: an input of the output's shape at the same element (an elementwise kernel,
    a norm's row element), any other at the leading axes it shares with the output (a
    matmul's row of ``a``, a batch's row), whole where it shares none; with the
    element kinds drawn. A few values are printed, more as their magnitude range."""
    kinds = f" (element kinds drawn: {', '.join(case.kinds)})" if case.kinds else ""
    lines = [f"inputs at {worst.name}{list(worst.index)}{kinds}:"]
    for name, array in case.arrays.items():
        if array.shape == worst.shape:
            at = worst.index
        else:
            at = ()
            for size, out_size, i in zip(array.shape, worst.shape, worst.index):
                if size != out_size:
                    break
                at += (i,)
        label = name + (f"[{', '.join([*map(str, at), *([':'] * (array.ndim - len(at)))])}]" if array.ndim else "")
        lines.append(f"  {label}: {_values(np.asarray(array)[at])}")
    return "\n  ".join(lines)


def _values(part: np.ndarray) -> str:
    """A few values as they are; more as their count, magnitude range and the
    subnormal and non-finite ones among them."""
    wide = part.astype(np.float64).reshape(-1)
    if wide.size <= SHOWN_VALUES:
        shown = ", ".join(f"{v:.6g}" for v in wide)
        return shown if part.ndim == 0 else f"[{shown}]"
    finite = np.abs(wide[np.isfinite(wide)])
    parts = [f"{wide.size} values"]
    if finite.size:
        parts.append(f"|x| from {finite.min():.3g} to {finite.max():.3g}")
    if part.dtype.kind not in "biu":
        tiny = float(ml_dtypes.finfo(part.dtype).smallest_normal)
        special = {
            "subnormal": int(((finite > 0) & (finite < tiny)).sum()),
            "zero": int((finite == 0).sum()),
            "inf": int(np.isinf(wide).sum()),
            "nan": int(np.isnan(wide).sum()),
        }
        parts += [f"{n} {what}" for what, n in special.items() if n]
    return ", ".join(parts)


ORACLES_ENV_VAR = "PALLASCHECK_ORACLES"
# Elements of a case's largest array from which a GPU backend's oracles run on the GPU.
# Below it numpy on the host is faster: on an H100, `verify --backend mosaic_gpu
# --examples 15` (small tier, arrays of at most ~1e5 elements) took 28.7 s with host
# oracles and 76.9 s with device ones (JAX compiles each operation for each new shape);
# a production attention case (arrays of 1.7e7) is minutes of numpy on the host.
DEVICE_ORACLE_ELEMENTS = 2**20


def oracle_device(backend: Backend, case: Case) -> Any:
    """Where a check's oracles and bounds compute (oracles/numeric.py): JAX float64 on
    the kernel's GPU for a GPU backend's large cases (``DEVICE_ORACLE_ELEMENTS``),
    else numpy on the host. $PALLASCHECK_ORACLES=device or host overrides the choice
    (``device`` on a CPU backend: JAX float64 on the CPU)."""
    choice = os.environ.get(ORACLES_ENV_VAR, "")
    if choice not in ("", "device", "host"):
        raise ValueError(f"${ORACLES_ENV_VAR} must be 'device' or 'host', got {choice!r}")
    if not choice:
        large = max((a.size for a in case.arrays.values()), default=0) >= DEVICE_ORACLE_ELEMENTS
        choice = "device" if backend.platform != "cpu" and large else "host"
    return None if choice == "host" else jax.devices(backend.platform)[0]


def _check_case(
    spec: KernelSpec,
    case: Case,
    config: Any,
    backend: Backend,
    *,
    context: checks.Context,
    selected: Sequence[str],
    tally: Tally,
) -> Tally:
    arith = arithmetic_for(backend)
    ctx = context.with_config(config)
    start = time.perf_counter()

    def kernel_side(fn: Callable[..., Any], *statics: Any) -> Any:
        """``fn(case, *statics)`` outside the oracles' float64 scope, compiled per layout
        on hardware (layout_programs.py)."""
        with numeric.kernel_side():
            return layout_programs.call(fn, backend, case, *statics)

    def kernel_side_started(fn: Callable[..., Any], *statics: Any) -> Callable[[], Any]:
        """``kernel_side(fn, *statics)``'s result when asked. On hardware the call
        starts now on a thread, so that a layout's first case compiles its kernel VJP
        and xla_reference while this thread computes the oracles and compiles and runs
        the forward (XLA's compiler and the GPU release the GIL); ``_check_case`` waits for
        it before it returns or raises. The interpreters call it when asked, as before."""
        if backend.is_interpreted:
            return functools.cache(lambda: kernel_side(fn, *statics))

        def run() -> Any:
            with backend.placement():
                return kernel_side(fn, *statics)

        started.append(_KERNEL_SIDE_THREADS.submit(run))
        return started[-1].result

    def oracle_side_started(fn: Callable[[], Any]) -> Callable[[], Any]:
        """``fn()``, an oracle or a bound, when asked. With device oracles the call starts
        now on a thread, so that a layout's first case compiles its float64 programs at
        the same time (a production attention case on an H100: 11 programs, 23-26 s of
        compiling one after another); they still run one at a time
        (properties/device/programs.py). The calls are submitted in the order they
        depend on each other: a bound that needs the exact gradients waits for them on
        its own thread, and they were submitted before it, so they never wait for a
        thread it holds. Host oracles are computed when asked, as before."""
        device, hold = numeric.active_device(), numeric.holds_results()
        if device is None:
            return functools.cache(fn)

        def run() -> Any:
            with numeric.on_device(device, hold_results=hold):
                return fn()

        started.append(_ORACLE_SIDE_THREADS.submit(run))
        return started[-1].result

    started: list[concurrent.futures.Future] = []
    held: list[Any] = []  # the case's oracle (_checks)
    try:
        return _checks(
            spec,
            case,
            config,
            backend,
            ctx=ctx,
            selected=selected,
            tally=tally,
            arith=arith,
            start=start,
            kernel_side=kernel_side,
            kernel_side_started=kernel_side_started,
            oracle_side_started=oracle_side_started,
            held=held,
        )
    finally:  # nothing of this case runs on beside the next one (its memory, its GPU time)
        for oracle in held:  # calls held for a round a failed check no longer asks
            device_programs.release(oracle)
        for future in started:
            future.cancel()  # those not begun: a failed check needs them no more
        concurrent.futures.wait(started)


def _is_reference_bound(contract: Any, bound: Any) -> bool:
    """Whether ``contract`` is ``bound`` at config None (xla_reference's bound)."""
    return isinstance(contract, AnyOrderContract) and contract.bound is bound


# Two: the kernel VJP and xla_reference (or its VJP) of one case at a time.
_KERNEL_SIDE_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="pallascheck-kernel")
# One per oracle-side call a case makes at most (_checks: expected, the exact gradients,
# eight bounds), so that all of them compile at once.
_ORACLE_SIDE_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=10, thread_name_prefix="pallascheck-oracle")


def _oracle_side(
    spec: KernelSpec,
    case: Case,
    ref: Any,
    config: Any,
    default: Any,
    arith: Any,
    need: frozenset[str],
    has_gradients: bool,
    reference_vjp: bool,
    started: Callable[[Callable[[], Any]], Callable[[], Any]],
) -> dict[str, Callable[[], Any]]:
    """Every oracle-side call the checks ``need``, started at once (``started``), by
    name: first those of the oracle alone, then those that read the exact gradients
    (submitted after what they need, so they never wait for a thread they hold). An
    oracle computed in parts serves each of the two rounds in one pass
    (``device_programs.asked_in_rounds``); a gradient bound that reads no exact
    gradient (``GradientSpec.bound_reads_gradients``) is asked in the first. A contract
    that is xla_reference's bound (spec.AnyOrderContract) is computed and held once."""
    g = spec.gradients
    got: dict[str, Callable[[], Any]] = {}
    first: dict[str, Callable[[], Any]] = {"expected": lambda: spec.expected(ref)}
    second: dict[str, Callable[[], Any]] = {}
    reads = g is None or g.bound_reads_gradients
    by_gradients = second if reads else first

    def exact() -> Any:
        return got["exact_gradients"]() if reads else None

    if "exact_gradients" in need and (has_gradients or reference_vjp) and g is not None:
        first["exact_gradients"] = lambda: g.oracle_vjp(case, ref)
    if "bound" in need:
        first["bound"] = lambda: spec.bound(case, ref, config, arith)
    if "probabilistic_bound" in need:
        first["probabilistic_bound"] = lambda: spec.bound(case, ref, config, arith.with_probabilistic())
    if "reference_bound" in need:
        first["reference_bound"] = lambda: spec.bound(case, ref, None, arith)
    contract = spec.contract
    same = "reference_bound" in need and _is_reference_bound(contract, spec.bound)
    if contract is not None and "contract_bound" in need and not same:
        first["contract_bound"] = lambda: contract(case, ref, arith)
    if "default_bound" in need and config != default:
        first["default_bound"] = lambda: spec.bound(case, ref, default, arith)
    if reference_vjp and g is not None:
        by_gradients["reference_gradient_bound"] = lambda: g.bound(case, ref, exact(), None, arith)
    if has_gradients and g is not None:
        by_gradients["gradient_bound"] = lambda: g.bound(case, ref, exact(), config, arith)
    g_contract = None if g is None else g.contract
    same_gradients = reference_vjp and g is not None and _is_reference_bound(g_contract, g.bound)
    if "gradient_contract_bound" in need and has_gradients and g_contract is not None and not same_gradients:
        by_gradients["gradient_contract_bound"] = lambda: g_contract(case, ref, exact(), arith)
    device_programs.asked_in_rounds(ref, [len(first), len(second)])
    for name, call in (first | second).items():  # ``got`` holds a call's getter before the next starts
        got[name] = started(call)
    if same:
        got["contract_bound"] = got["reference_bound"]
    if same_gradients:
        got["gradient_contract_bound"] = got["reference_gradient_bound"]
    return got


def _checks(
    spec: KernelSpec,
    case: Case,
    config: Any,
    backend: Backend,
    *,
    ctx: checks.Context,
    selected: Sequence[str],
    tally: Tally,
    arith: Any,
    start: float,
    kernel_side: Callable[..., Any],
    kernel_side_started: Callable[..., Callable[[], Any]],
    oracle_side_started: Callable[[Callable[[], Any]], Callable[[], Any]],
    held: list[Any],
) -> Tally:
    def timed(name: str, fn: Callable[[], checks.Outcome]) -> None:
        t0 = time.perf_counter()
        outcome = dataclasses.replace(fn(), check=name)
        tally.add(outcome, time.perf_counter() - t0 + (values_setup_seconds if name == "values" else 0.0))

    has_gradients = spec.gradients is not None and "gradients" in selected
    # Started first, where a thread runs them (see kernel_side_started); computed once
    # and shared by the checks: the kernel's output (values, configs_agree, run 0 of
    # deterministic, the untransformed side of the relations) and the float64
    # gradients, the most expensive oracle ("reference" and "gradients").
    if has_gradients and spec.gradients is not None:
        vjp_result = kernel_side_started(spec.gradients.kernel_vjp, config, backend)
    if "reference" in selected:
        reference_result = kernel_side_started(spec.reference)
        if spec.gradients is not None and spec.gradients.reference_vjp is not None:
            reference_vjp_result = kernel_side_started(spec.gradients.reference_vjp)
    ref = spec.oracle(case)
    held.append(ref)  # released when the case ends (_check_case)
    g = spec.gradients
    reference_vjp = "reference" in selected and g is not None and g.reference_vjp is not None
    need = check_kinds.needs(selected)
    default = spec.default_config_for(backend)
    g_contract = None if g is None else g.contract
    gradient_contract = has_gradients and g_contract is not None
    got = _oracle_side(spec, case, ref, config, default, arith, need, has_gradients, reference_vjp, oracle_side_started)

    def asked(name: str) -> Callable[[], Any]:
        """The result of an oracle-side call, when asked (only a check that needs it asks)."""
        return lambda: got[name]()

    expected_result, exact_gradients = asked("expected"), asked("exact_gradients")
    bound_result, prob_bound = asked("bound"), asked("probabilistic_bound")
    reference_bound, reference_gradient_bound = asked("reference_bound"), asked("reference_gradient_bound")
    contract_bound, default_bound = asked("contract_bound"), asked("default_bound")
    gradient_bound, gradient_contract_bound = asked("gradient_bound"), asked("gradient_contract_bound")
    expected = expected_result()
    kernel_out = functools.cache(lambda: _np(kernel_side(spec.kernel, config, backend)))
    kernel_gradients = functools.cache(lambda: {k: _np(v) for k, v in vjp_result().items()})
    if {"values", "configs_agree"} & set(selected):
        out = kernel_out()
        bound = bound_result()
    values_setup_seconds = time.perf_counter() - start  # oracle + kernel run + bound
    if "values" in selected:
        timed(
            "values",
            _rerun_on_failure(
                lambda: checks.check_values(out, expected, bound, context=ctx),
                backend,
                failing=lambda: out,
                rerun=lambda: _np(kernel_side(spec.kernel, config, backend)),
                judge=lambda again: checks.compare(again, expected, bound),
            ),
        )
        tally.probabilistic_budget = max(
            tally.probabilistic_budget, checks.compare(out, expected, prob_bound()).budget_used
        )
    if "reference" in selected:

        def reference() -> checks.Outcome:
            ref_ctx = dataclasses.replace(ctx, config="xla_reference")
            reference_out = _np(reference_result())
            o = checks.check_values(reference_out, expected, reference_bound(), context=ref_ctx)
            if spec.contract is not None:
                contract_used = checks.compare(reference_out, expected, contract_bound()).budget_used
                tally.add_contract_budget("reference", contract_used)
            if reference_vjp:
                got = {k: _np(v) for k, v in reference_vjp_result().items()}
                o = o.merge(checks.check_gradients(got, exact_gradients(), reference_gradient_bound(), context=ref_ctx))
                o.examples = 1
            return o

        timed("reference", reference)
    if "configs_agree" in selected and config != default:

        def agree() -> checks.Outcome:
            other = _np(kernel_side(spec.kernel, default, backend))
            return checks.check_configs_agree({config: (out, bound), default: (other, default_bound())}, context=ctx)

        timed("configs_agree", agree)
    if has_gradients and g is not None:

        def gradients() -> checks.Outcome:
            checks.check_gradient_dtypes(kernel_gradients(), case.arrays, context=ctx)
            return checks.check_gradients(kernel_gradients(), exact_gradients(), gradient_bound(), context=ctx)

        timed(
            "gradients",
            _rerun_on_failure(
                gradients,
                backend,
                failing=kernel_gradients,
                rerun=lambda: {k: _np(v) for k, v in kernel_side(g.kernel_vjp, config, backend).items()},
                judge=lambda again: checks.check_gradients(
                    again, exact_gradients(), gradient_bound(), context=ctx, raise_on_failure=False
                ),
            ),
        )
    if "contract" in selected and (spec.contract is not None or gradient_contract):

        def contract() -> checks.Outcome:
            parts = []
            if spec.contract is not None:
                parts.append(checks.compare(kernel_out(), expected, contract_bound()))
                tally.add_contract_budget("values", parts[-1].budget_used)
            if gradient_contract:
                parts.append(
                    checks.check_gradients(
                        kernel_gradients(),
                        exact_gradients(),
                        gradient_contract_bound(),
                        context=ctx,
                        raise_on_failure=False,
                    )
                )
                tally.add_contract_budget("gradients", parts[-1].budget_used)
            o = functools.reduce(checks.Outcome.merge, parts)
            o.examples = 1
            if not o.passed:
                raise checks.CheckFailure(dataclasses.replace(o, check="contract"), ctx)
            return o

        timed("contract", contract)
    if "deterministic" in selected:

        def deterministic() -> checks.Outcome:
            runs: list[Callable[[], Any]] = [kernel_out, lambda: kernel_side(spec.kernel, config, backend)]
            if backend.facts.shuffles_grid:  # a different grid shuffle must not change bits
                shuffled = Backend("tpu_interpret", backend.seed + 1)
                runs.append(lambda: kernel_side(spec.kernel, config, shuffled))
            return checks.check_same_bits(runs, context=ctx)

        timed("deterministic", deterministic)
    if "metamorphic" in selected:
        for relation in spec.relations:

            def metamorphic(relation=relation) -> checks.Outcome:
                # a relation runs kernels and oracles both: on the host side, in numpy
                with numeric.kernel_side():
                    lhs, rhs, rel_bound = relation.run(case, config, backend, kernel_out())
                return checks.check_relation(_np(lhs), _np(rhs), rel_bound, relation=relation.name, context=ctx)

            timed("metamorphic", metamorphic)
    return tally


# On hardware a failing output is computed again from the same inputs before the
# failure is reported. An uninitialised read, a race in a kernel or a fault of the
# runtime gives an output that changes from run to run (the Mosaic GPU matmul variant
# that adds a shared-memory tile it never wrote to its sum: every element, every run,
# on an H100); a failure no replay in a fresh process shows (two GLU production
# failures on an H100, docs/results.md) can then be told from a steady one. The
# failure stands either way. The interpreters compute the same bits each time, and
# rerunning there would cost compiles: they report as before.
RERUNS_ON_FAILURE = 2


def _rerun_on_failure(
    check: Callable[[], checks.Outcome],
    backend: Backend,
    *,
    failing: Callable[[], Any],
    rerun: Callable[[], Any],
    judge: Callable[[Any], checks.Outcome],
) -> Callable[[], checks.Outcome]:
    """``check``, whose CheckFailure on hardware also says what ``RERUNS_ON_FAILURE``
    reruns gave (``checks.rerun_note``): ``failing()`` is the output it judged,
    ``rerun()`` computes it again, ``judge`` checks a rerun's output the same way."""
    if backend.is_interpreted:
        return check

    def checked() -> checks.Outcome:
        try:
            return check()
        except checks.CheckFailure as failure:
            reruns = []
            for _ in range(RERUNS_ON_FAILURE):
                try:
                    reruns.append(rerun())
                except Exception as err:  # noqa: BLE001 - reported with the failure it would otherwise hide
                    reruns.append(err)
            note = checks.rerun_note(
                failing(), reruns, judge, device=device_identity.describe(jax.devices()[0])
            )  # where hardware checks run
            outcome = dataclasses.replace(failure.outcome, detail=f"{failure.outcome.detail}\n  {note}")
            raise checks.CheckFailure(outcome, failure.context) from failure

    return checked


def run_errors(spec: KernelSpec, *, context: checks.Context) -> checks.Outcome:
    """Every bad input of the spec raises its promised exception."""
    outcome = checks.Outcome("errors", True, 0.0, "no bad inputs declared", examples=0)
    for bad in spec.bad_inputs():
        o = checks.check_errors(
            bad.call,
            bad.exception,
            bad.match,
            context=dataclasses.replace(context, config=bad.name),
            raise_on_failure=False,
        )
        if not o.passed:
            o.detail = f"{bad.name}: {o.detail}"
        outcome = o if outcome.examples == 0 else outcome.merge(o)
    return outcome


@dataclasses.dataclass(frozen=True)
class Search:
    """How a fuzz campaign steers ``run_property`` (the default: plain random draws).

    ``targeted``: each example reports every check's budget used to
    ``hypothesis.target``, so Hypothesis climbs toward the inputs that use the most
    of their bound. ``config_slot``: always this index into the config space (mod
    its size). ``database``: Hypothesis' example database (a directory, or a database
    object: a cluster's, shared across nodes), under
    ``database_key``, so that a resumed campaign starts from what the last one found
    (failing examples and the best-scoring targets). ``before_case(case, config)``
    and ``after_case(case, config, tally)`` see every case, ``tally`` holding that
    case's outcomes only (a worker saves the case before it runs, so that a hang or a
    crash leaves its input behind)."""

    targeted: bool = False
    config_slot: int | None = None
    database: str | ExampleDatabase | None = None  # a directory, or a database (a cluster's shared one)
    database_key: str = ""
    before_case: Callable[[Case, Any], None] | None = None
    after_case: Callable[[Case, Any, Tally], None] | None = None


def _merge_into(tally: Tally, case_tally: Tally) -> None:
    tally.left_out.update(case_tally.left_out)
    for name, outcome in case_tally.outcomes.items():
        tally.add(outcome, case_tally.seconds.get(name, 0.0))
    for name, budget in case_tally.contract_budgets.items():
        tally.add_contract_budget(name, budget)
    tally.probabilistic_budget = max(tally.probabilistic_budget, case_tally.probabilistic_budget)


def _report_targets(budgets: dict[str, float]) -> None:
    """The example's worst budget used per check, for Hypothesis' hill climbing (it
    takes finite scores only; an infinite budget is a failure, reported anyway)."""
    for name, budget in budgets.items():
        if math.isfinite(budget):
            target(budget, label=name)


EXAMPLES = 4
"""Hypothesis examples per kernel x dtype property by default: ``pallascheck verify``'s
``--examples`` and the pytest plugin's ``ci`` profile (a user's ``spec_tests``), one
number so that both check a kernel alike. Four, not three: the suite's draws in the
callback interpreters take input kinds and configs in turn, one per example, and reach
every kind a property offers within four (tests/test_default_draws.py)."""

PRODUCTION_EXAMPLES = 1
"""Hypothesis examples per production layout by default (``pallascheck verify
--shapes production``): every named layout is checked in every dtype, one compiled
layout of ``HARDWARE_CASES_PER_LAYOUT`` cases (or the layout's own ``cases``) each."""


def default_examples(shapes: str) -> int:
    """verify's examples per kernel x dtype at the ``shapes`` tier when none are asked
    for (at the production tier: per layout)."""
    return PRODUCTION_EXAMPLES if shapes == "production" else EXAMPLES


CASES_PER_LAYOUT = 2
"""Cases checked per Hypothesis example in Pallas' generic interpreter. They share a
layout (shapes, static parameters, config: see ``strategies.layout``) and so one
compiled kernel, and differ in their values. Compilation is most of a check's cost in
interpret mode; a second case of the same layout costs a run, not a compile."""

CALLBACK_CASES_PER_LAYOUT = 1
"""Cases per Hypothesis example in the interpreters that call back into Python for
every ref operation (``Facts.callback_interpreter``): there a case's run costs about what
its compile does, so a second case saves nothing. Input kinds and configs are then
taken in turn, not at random (``strategies.InTurn``, ``run_property``), so
that a property's examples draw every kind and config that two random cases each
drew (tests/test_default_draws.py)."""

SHAPE_TIERS = ("small", "production")
# On hardware a compile costs seconds and a small case milliseconds: one compiled
# layout checks many value draws. A production case costs its oracle (about a second).
HARDWARE_CASES_PER_LAYOUT = {"small": 16, "production": 4}
# A fuzz campaign on hardware checks 64 value draws per small-tier layout: on an H100 a
# layout's compilations take 2-5 s and each case of it 10-30 ms once compiled, so a
# layout of 16 cases spends most of its time compiling, and a campaign is after volume.
CAMPAIGN_HARDWARE_CASES_PER_LAYOUT = {"small": 64, "production": 4}


def layout_cases(backend: Backend, shapes: str = "small", *, campaign: bool = False) -> int:
    """Cases per Hypothesis example (per compiled layout) on ``backend``; ``campaign``:
    in a fuzz campaign."""
    if backend.facts.callback_interpreter:
        return CALLBACK_CASES_PER_LAYOUT
    if backend.is_interpreted:
        return CASES_PER_LAYOUT
    return (CAMPAIGN_HARDWARE_CASES_PER_LAYOUT if campaign else HARDWARE_CASES_PER_LAYOUT)[shapes]


def example_cases(spec: KernelSpec, backend: Backend, shapes: str = "small", layout: str | None = None) -> int:
    """Cases per Hypothesis example of ``spec`` on ``backend``: those the production
    layout named ``layout`` declares (``Layout.cases``), else ``layout_cases``."""
    declared = next((l.cases for l in spec.production_layouts if l.name == layout), None)
    return declared or layout_cases(backend, shapes)


def tier_checks(selected: Sequence[str], shapes: str) -> list[str]:
    """The checks a shape tier runs: at the production tier not the metamorphic
    relations (see ``run_property``)."""
    return [c for c in selected if shapes == "small" or c != "metamorphic"]


def tier_cases(spec: KernelSpec, shapes: str) -> Callable[[str, Backend], st.SearchStrategy[Case]]:
    """The spec's case strategy for a shape tier; a ValueError saying so where the
    spec has no production tier."""
    if shapes not in SHAPE_TIERS:
        raise ValueError(f"shapes must be one of {SHAPE_TIERS}, got {shapes!r}")
    if shapes == "small":
        return spec.cases
    if spec.production is None:
        raise ValueError(
            f"{spec.name} has no production shape tier (properties/production.py lists the families that have one)"
        )
    return spec.production


def derived_seed(seed: int, label: str) -> int:
    """A seed of its own for ``label``'s run under ``seed``, the same in every process
    (no ``hash()``), so that a replay draws the same."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{label}".encode()).digest()[:8], "little")


def dtype_seed(seed: int, dtype: str) -> int:
    """The Hypothesis seed of ``seed``'s run in ``dtype``: one seed for every dtype
    would draw the same layouts in each (the strategies' choices do not depend on
    the dtype), so a run over three dtypes would see a third of the layouts it pays
    for."""
    return derived_seed(seed, dtype)


def fingerprint(case: Case) -> tuple[str, ...]:
    """A digest per array of ``case``: the cases of one layout are drawn distinct by it."""
    # hashed in place: copying the arrays first took 9.8 of the 102 s that a GLU
    # production check spent on an H100's host, most of the rest drawing them
    return tuple(
        hashlib.sha1(np.ascontiguousarray(a).reshape(-1).view(np.uint8)).hexdigest() for a in case.arrays.values()
    )


def run_property(
    spec: KernelSpec,
    dtype: str,
    backend: Backend,
    *,
    examples: int,
    seed: int = 0,
    selected: Sequence[str] = CHECKS,
    shrink: bool = False,
    failure_dir: str | None = None,
    replay_hint: str = "",
    cases_per_layout: int | None = None,
    search: Search = Search(),
    shapes: str = "small",
    cover_pairs: bool = False,
    layout: str | None = None,
) -> Tally:
    """Draw ``examples`` Hypothesis examples, each a config and ``cases_per_layout``
    distinct cases of one layout, and run the checks on every case.

    The config is drawn once per example, as an index into the first case's config
    space; a spec whose cases do not share their layout still gets a valid config for
    each case. On failure the tally records the message; with ``failure_dir`` the
    failing case is saved as .npz for ``pallascheck replay``. ``search`` steers the
    draws for a fuzz campaign. ``shapes``: the shape tier (``SHAPE_TIERS``);
    ``cases_per_layout``: default ``example_cases(spec, backend, shapes, layout)``. The production
    tier leaves out the metamorphic relations: they run kernels and oracles on
    transformed copies of the case on the host, minutes at these sizes; the small
    tier checks them. ``cover_pairs``: draw for the pairs of the spec's declared
    parameters that the draws missed (``verify --cover-pairs``; not by default, nor in
    the suite's spec tests: at about 16 extra examples per kernel x dtype, each mostly
    a new compile, a CPU verify took 3.3x as long); the pairs met are counted either way.
    ``layout``: at the production tier, only the layouts whose name contains it.
    """
    if layout is not None and shapes != "production":
        raise ValueError(f"layout names production layouts: it needs shapes='production', got shapes={shapes!r}")
    selected = tier_checks(selected, shapes)
    tally = Tally()
    context = checks.Context(kernel=spec.name, dtype=dtype, backend=str(backend), replay=replay_hint)
    per_layout = example_cases(spec, backend, shapes, layout) if cases_per_layout is None else cases_per_layout
    case_lists = st.lists(
        strategies.with_drawn_kinds(
            tier_cases(spec, shapes)(dtype, backend)
            if layout is None
            else cast(ProductionCases, spec.production)(dtype, backend, layout)
        ),
        min_size=per_layout,
        max_size=per_layout,
        unique_by=fingerprint,
    )
    # Few examples, each one layout: one case each in the callback interpreters, and on
    # hardware a compiled layout of many cases (verify draws 3 per dtype there). Random
    # draws of so few left the Mosaic GPU attention's warp-specialised dk/dv kernel and
    # its 200-key layout undrawn on an H100 (docs/mutation.md); in turn, they are drawn.
    few_layouts = per_layout == 1 or not backend.is_interpreted
    if few_layouts and not search.targeted and search.database is None:
        dtypes = list(spec.dtypes_for(backend))
        drawn = strategies.in_turn(
            case_lists,
            lambda case: config_space(spec, case, backend),
            strategies.InTurn(dtypes.index(dtype) if dtype in dtypes else 0, len(dtypes) or 1, seed),
        )
    else:
        drawn = case_lists.flatmap(
            lambda cases: st.tuples(st.just(cases), st.integers(0, len(config_space(spec, cases[0], backend)) - 1))
        )
    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    phases += [Phase.target] if search.targeted else []
    # shrinking a production case costs a production case per step: the case found is
    # the reproducer
    phases += [Phase.shrink] if shrink and shapes == "small" else []
    database = DirectoryBasedExampleDatabase(search.database) if isinstance(search.database, str) else search.database

    declared = spec.paths_for(backend, shapes)
    tally.paths_declared = tuple(p.name for p in declared)
    tally.paths_required = tuple(p.name for p in declared if p.required)
    parameters = spec.parameters_for(backend, shapes)
    declared_pairs = pairs.declared(parameters)
    tally.pairs_declared = tuple(pairs.label(p) for p in declared_pairs)

    def check_example(cases_and_config: tuple[list[Case], int]) -> None:
        cases, index = cases_and_config
        index = index if search.config_slot is None else search.config_slot
        budgets: dict[str, float] = {}
        try:
            for case in cases:
                config = _config_of(spec, case, backend, index)
                for path in declared:
                    if path.reached(case, config):
                        tally.paths[path.name] = tally.paths.get(path.name, 0) + 1
                for pair in pairs.met(parameters, case, config):
                    tally.pairs[pairs.label(pair)] = tally.pairs.get(pairs.label(pair), 0) + 1
                if search.before_case is not None:
                    search.before_case(case, config)
                case_tally = Tally()
                try:
                    check_case(spec, case, config, backend, context=context, selected=selected, tally=case_tally)
                except Exception as failure:  # a crash is a finding too: keep its input
                    if failure_dir is not None:
                        save_failure(failure_dir, spec, dtype, backend, case, config, failure, declared, parameters)
                    _merge_into(tally, case_tally)  # the checks this case passed before it failed
                    if search.after_case is not None and isinstance(failure, checks.CheckFailure):
                        case_tally.add(failure.outcome, 0.0)
                        search.after_case(case, config, case_tally)
                    raise
                finally:
                    if backend.name == "tpu_interpret":
                        reset_tpu_interpreter()
                _merge_into(tally, case_tally)
                if search.after_case is not None:
                    search.after_case(case, config, case_tally)
                for name, outcome in case_tally.outcomes.items():
                    budgets[name] = max(budgets.get(name, 0.0), outcome.budget_used)
        finally:
            if search.targeted:
                _report_targets(budgets)

    @settings(
        max_examples=examples,
        database=database,
        deadline=None,
        phases=phases,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @hypothesis_seed(dtype_seed(seed, dtype))
    @given(drawn)
    def property_(cases_and_config: tuple[list[Case], int]) -> None:
        check_example(cases_and_config)

    if search.database is not None:
        key = f"{spec.name}/{dtype}/{backend}/{search.database_key}/{sorted(selected)}"
        property_._hypothesis_internal_database_key = hashlib.sha1(key.encode()).digest()  # type: ignore[attr-defined]  # Hypothesis' own hook, set as Hypothesis sets it
    try:
        property_()
    except ExceptionGroup as group:  # several distinct failures: each is booked under its check
        for failure in _leaves(group):
            _book(tally, failure, context)
    except Exception as failure:  # noqa: BLE001 - a kernel that crashes is a failed check
        _book(tally, failure, context)
    # Paths by rule: a declared path the budgeted draws missed is drawn for (shapes,
    # options and a config that reach it) and checked, so that every run reaches what
    # its spec declares; the budgeted draws themselves are unchanged. A fuzz campaign's
    # draws are the search's own.
    steered = search.targeted or search.config_slot is not None or search.database is not None
    missing = [p for p in declared if p.name not in tally.paths]
    # drawn freely, not in turn: a turn replays its first draw for a repeated token, and
    # a search's many draws repeat Hypothesis' favourite tokens
    free = case_lists.flatmap(
        lambda cases: st.tuples(st.just(cases), st.integers(0, len(config_space(spec, cases[0], backend)) - 1))
    )
    attempt = 0
    while missing and not steered and not tally.findings and not tally.stopped:
        attempt += 1
        chosen = _draw_reaching(free, missing, spec, backend, dtype_seed(seed, dtype) + attempt)
        if chosen is None:
            break  # no draw reaches the rest: reported as not reached
        try:
            check_example(chosen)
        except Exception as failure:  # noqa: BLE001 - as above: booked under its check
            _book(tally, failure, context)
        missing = [p for p in declared if p.name not in tally.paths]
    # Pairs by rule, the same way: an example drawn for each pair of parameter values
    # not met yet, the one of its draws that meets the most open pairs (a greedy
    # covering array); a pair no draw meets is given up on and reported not met.
    given_up: set[pairs.Pair] = set()
    while cover_pairs and not steered and not tally.findings and not tally.stopped:
        open_pairs = [p for p in declared_pairs if pairs.label(p) not in tally.pairs and p not in given_up]
        if not open_pairs:
            break
        attempt += 1
        chosen = _draw_covering(free, open_pairs, parameters, spec, backend, dtype_seed(seed, dtype) + attempt)
        if chosen is None:
            given_up.add(open_pairs[0])
            continue
        try:
            check_example(chosen)
        except Exception as failure:  # noqa: BLE001 - as above: booked under its check
            _book(tally, failure, context)
    return tally


# How many examples may be drawn (shapes, options and a config; no check runs) to find
# one that reaches a missed path: the rarest declared path of the shipped specs is about
# one draw in 24 on its backend, so all 400 miss it with probability (23/24)^400 < 1e-7.
PATH_DRAWS = 400


def _config_of(spec: KernelSpec, case: Case, backend: Backend, index: int) -> Any:
    """The config an example's drawn ``index`` gives ``case``: an index into the first
    case's config space, taken modulo this case's own (a spec whose cases do not share
    their layout still gets a valid config for each)."""
    space = config_space(spec, case, backend)
    return space[index % len(space)]


class NoConfig(Exception):
    """The kernel has no config for a drawn case on the backend (its config space is
    empty: at a production layout the Mosaic GPU attention's tiles at head_dim 256 fit
    no SMEM): nothing can run it, so the case is not checked, saying why; not a crash."""


def config_space(spec: KernelSpec, case: Case, backend: Backend) -> list[Any]:
    """The configs ``spec`` offers ``case`` on ``backend``; ``NoConfig`` where none."""
    space = list(spec.configs(case, backend))
    if not space:
        shapes = ", ".join(f"{name} {tuple(np.shape(a))}" for name, a in case.arrays.items())
        raise NoConfig(f"{spec.name} has no config for these shapes on {backend} ({shapes})")
    return space


def _reached(
    example: tuple[list[Case], int], paths: Sequence[CodePath], spec: KernelSpec, backend: Backend
) -> set[str]:
    """The names of ``paths`` that checking ``example`` reaches (each case under its own
    config, as ``run_property`` checks it)."""
    cases, index = example
    names = set()
    for case in cases:
        config = _config_of(spec, case, backend, index)
        names |= {p.name for p in paths if p.reached(case, config)}
    return names


def _draw_reaching(
    drawn: st.SearchStrategy[tuple[list[Case], int]],
    missing: Sequence[CodePath],
    spec: KernelSpec,
    backend: Backend,
    seed: int,
) -> tuple[list[Case], int] | None:
    """An example of ``drawn`` that reaches at least one of the ``missing`` paths, and
    of the first ``PATH_CANDIDATES`` draws that do, the one reaching the most of them
    (all of them ends the search at once); None where none of ``PATH_DRAWS`` draws does.
    Each example drawn for a path is checked in full: in the callback interpreters an
    example costs seconds, a draw milliseconds."""
    best: tuple[int, tuple[list[Case], int]] | None = None
    found = 0

    def reaches(example: tuple[list[Case], int]) -> bool:
        nonlocal best, found
        reached = len(_reached(example, missing, spec, backend))
        if reached:
            found += 1
            best = (reached, example) if best is None or reached > best[0] else best
        return found >= PATH_CANDIDATES or reached == len(missing)

    with warnings.catch_warnings():
        # find() describes the example it returns, arrays and all; the example is ours to report
        warnings.simplefilter("ignore", HypothesisWarning)
        try:
            find(drawn, reaches, settings=_drawing_settings(), random=random.Random(seed))
        except NoSuchExample:
            pass  # fewer than PATH_CANDIDATES reached one: the best of those, if any
    return None if best is None else best[1]


# Of the draws that reach a missed path, how many are compared for the other missed
# paths they reach: the attention kernels' Mosaic GPU paths, drawn for one at a time,
# took 4 examples beyond the budget, each a case in the Mosaic GPU interpreter.
PATH_CANDIDATES = 8


def _drawing_settings() -> settings:
    """Hypothesis' settings for drawing toward a path or a pair: up to PATH_DRAWS
    generated examples (read when called: tests lower it), nothing stored or shrunk."""
    return settings(
        max_examples=PATH_DRAWS,
        phases=[Phase.generate],
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


# Of the draws that meet the pair a covering example is drawn for, how many are
# compared for the other open pairs they meet (the greedy step): more find a better
# example at the price of more draws (no check runs while drawing).
PAIR_CANDIDATES = 4


def _draw_covering(
    drawn: st.SearchStrategy[tuple[list[Case], int]],
    open_pairs: Sequence[pairs.Pair],
    parameters: Sequence[Parameter],
    spec: KernelSpec,
    backend: Backend,
    seed: int,
) -> tuple[list[Case], int] | None:
    """An example that meets ``open_pairs[0]``, and of those found the one meeting the
    most of ``open_pairs``: its element kind pinned where the pair names one, each
    drawn layout tried under every config of its space (the config pinned by index),
    shapes and options drawn until ``PAIR_CANDIDATES`` layouts meet the pair or
    ``PATH_DRAWS`` were drawn. None where no draw meets it."""
    target, wanted = open_pairs[0], set(open_pairs)
    best: tuple[int, tuple[list[Case], int]] | None = None
    found = 0

    def meets(example: tuple[list[Case], int]) -> bool:
        nonlocal best, found
        cases = example[0]
        # each case under the config of each index, as _config_of gives it
        spaces = [config_space(spec, case, backend) for case in cases]
        scored = []
        for index in range(len(spaces[0])):
            met = set().union(
                *(pairs.met(parameters, case, space[index % len(space)]) for case, space in zip(cases, spaces))
            )
            if target in met:
                scored.append((len(met & wanted), (cases, index)))
        if scored:
            found += 1
            top = max(scored, key=lambda pair: pair[0])
            best = top if best is None or top[0] > best[0] else best
        return found >= PAIR_CANDIDATES

    with strategies.pinned_element_kind(pairs.pinned_kind(target, parameters)), warnings.catch_warnings():
        # find() describes the example it returns, arrays and all; the example is ours to report
        warnings.simplefilter("ignore", HypothesisWarning)
        try:
            find(
                drawn,
                meets,
                settings=_drawing_settings(),
                random=random.Random(seed),
            )
        except NoSuchExample:
            pass  # fewer than PAIR_CANDIDATES met it: the best of those, if any
    return None if best is None else best[1]


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    return [leaf for e in group.exceptions for leaf in (_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])]


def failed_check(failure: BaseException) -> str:
    """The check a failure belongs to: a CheckFailure's (an xla_reference comparison is
    the "reference" check; "metamorphic:NAME" is "metamorphic"), else "crash"."""
    if not isinstance(failure, checks.CheckFailure):
        return "crash"
    return "reference" if failure.context.config == "xla_reference" else failure.outcome.check.split(":")[0]


def out_of_device_memory(failure: BaseException) -> bool:
    """Whether ``failure`` is XLA's refusal of a device allocation (RESOURCE_EXHAUSTED
    and out of memory): on a GPU shared by several processes, each growing its own
    allocator's pool, it comes of the sharing, not of the kernel under test."""
    text = str(failure)
    return (
        not isinstance(failure, checks.CheckFailure)
        and "RESOURCE_EXHAUSTED" in text
        and "out of memory" in text.lower()
    )


def _book(tally: Tally, failure: BaseException, context: checks.Context) -> None:
    if isinstance(failure, NoConfig):  # not a finding: nothing can run the case
        tally.stopped = tally.stopped or str(failure)
        return
    if out_of_device_memory(failure):  # not a finding: the rest is not checked, saying why
        first = next((line.strip() for line in str(failure).splitlines() if "RESOURCE_EXHAUSTED" in line), "")
        tally.stopped = tally.stopped or (
            f"the device ran out of memory ({first[:160]}); fewer processes sharing it (--jobs) leave each more"
        )
        return
    check = failed_check(failure)
    if isinstance(failure, checks.CheckFailure):
        tally.add(dataclasses.replace(failure.outcome, check=check, examples=0), 0.0)
        tally.findings.append(Finding(check, str(failure), failure.outcome))
    else:
        tally.add(checks.Outcome("crash", False, float("inf"), repr(failure), examples=0), 0.0)
        tally.findings.append(Finding("crash", f"[crash] {context.describe()}\n  {type(failure).__name__}: {failure}"))


def save_failure(
    directory: str,
    spec: KernelSpec,
    dtype: str,
    backend: Backend,
    case: Case,
    config: Any,
    failure: Exception,
    paths: Sequence[CodePath] = (),
    parameters: Sequence[Parameter] = (),
) -> str:
    """Save the failing case as ``failure_path(directory, spec.name, dtype, check)``
    (check "crash" for an exception that is not a CheckFailure), naming the declared
    ``paths`` it reaches and the pairs of the declared ``parameters`` it meets;
    returns the path."""
    os.makedirs(directory, exist_ok=True)
    check = failed_check(failure)
    message = str(failure)
    if check == "crash":
        message = f"{type(failure).__name__}: {failure}"
    path = failure_path(directory, spec.name, dtype, check)
    meta = {
        "kernel": spec.name,
        "dtype": dtype,
        "backend": str(backend),
        "check": check,
        "config": config_to_json(config),
        "message": message,
        "paths": [p.name for p in paths if p.reached(case, config)],
        "pairs": sorted(pairs.label(p) for p in pairs.met(parameters, case, config)),
    }
    Case(case.arrays, {**case.params, "__failure__": meta}).save(path)
    return path


def failure_path(directory: str, kernel: str, dtype: str, check: str) -> str:
    """Where ``save_failure`` keeps the latest failing case of one check: while
    Hypothesis shrinks, each smaller failing case replaces the last, and its final
    replay of the minimal case writes it last."""
    # a file name without ':' (MODULE:NAME specs, "tokamax:..."), which some file
    # systems and archives refuse and shells read as host:path; fuzz's corpus does the same
    return os.path.join(directory, re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{kernel}-{dtype}-{check}") + ".npz")
