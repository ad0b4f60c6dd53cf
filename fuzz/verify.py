"""``pallascheck verify``: every registered kernel's checks, as a table.

The work is split into units (one kernel x dtype property, one kernel's bad-input
checks, the distributed kernels on N CPU devices) that run in ``--jobs`` worker
processes, like pytest-xdist: interpret mode spends its time compiling, one core per
compilation. Units start longest first, by the durations the previous run recorded
(``fuzz/durations.py``), so the last unit does not start late.
Every case has a time limit (``--case-timeout``, properties/watchdog.py): a worker
whose case passes it reports the case and exits, its unit becomes a failed "hang"
row, and the units that shared its pool run on in a new one.

With ``--cluster`` the units run on the workers of a Ray cluster instead, one a slot
(``plan.cluster_slots``; the actors are fuzz/cluster.py's): each unit's rows, failure
messages and saved cases come back to this process, and the table is the same.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import math
import multiprocessing
import os
import re
import shlex
import shutil
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from pallascheck.fuzz import durations, journal
from pallascheck.fuzz import plan as planning
from pallascheck.fuzz.cluster import Cluster, RemoteWorker
from pallascheck.fuzz.scope import NotChecked
from pallascheck.fuzz.workers import failed_dir, saved_files
from pallascheck.kernels.backends import Backend
from pallascheck.properties import check_kinds, checks, production, runner, watchdog
from pallascheck.properties.device import compilation, multidevice
from pallascheck.properties.families.collectives import PROPERTIES
from pallascheck.properties.registry import get_spec, selected

# where a worker's watchdog leaves the report of a hung case, one file per unit
HANGS_DIR = os.path.join(".pallascheck", "verify-hangs")


@dataclasses.dataclass
class Row:
    kernel: str
    dtype: str
    check: str
    passed: bool
    examples: int
    budget_used: float
    probabilistic_budget: float | None
    seconds: float
    # the same outputs' budget used under the accuracy contract (values, gradients,
    # reference); None where the spec states no contract or the check has none
    contract_budget: float | None = None
    note: str = ""  # why a row of no cases was not checked
    # on a property's first row: its declared code paths and the cases that reached each
    paths_declared: tuple[str, ...] = ()
    paths: dict[str, int] = dataclasses.field(default_factory=dict)
    # ... and the pairs of its declared parameters and the cases that met each
    pairs_declared: tuple[str, ...] = ()
    pairs: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def pairs_not_met(self) -> list[str]:
        """The declared pairs no case met."""
        return [p for p in self.pairs_declared if not self.pairs.get(p)]

    @property
    def checked(self) -> bool:
        """A row of no cases that did not fail was not checked: never a pass."""
        return self.examples > 0 or not self.passed

    @property
    def verdict(self) -> str:
        return "FAIL" if not self.passed else "pass" if self.checked else "not checked"


@dataclasses.dataclass(frozen=True)
class Unit:
    """One piece of verify work: ``kind`` is "property", "errors" or "distributed".
    A property on hardware is split into ``parts`` (``property_parts``); this unit
    is part ``part`` of them. At the production tier a property is one unit per
    production layout (``layout``, its name): every named layout is checked in every
    dtype, each unit needs its own layout's memory, and a replay names the layout."""

    kind: str
    kernel: str
    dtype: str = "-"
    part: int = 0
    parts: int = 1
    layout: str = ""

    @property
    def key(self) -> str:
        key = f"{self.kind}:{self.kernel}:{self.dtype}"
        key = key if self.parts == 1 else f"{key}:{self.part + 1}/{self.parts}"
        return f"{key}:{self.layout}" if self.layout else key

    @property
    def hang_report(self) -> str:
        """Where this unit's watchdog writes the report of a hung case."""
        return os.path.join(HANGS_DIR, hashlib.sha1(self.key.encode()).hexdigest()[:16] + ".txt")


@dataclasses.dataclass(frozen=True)
class Options:
    backend: Backend
    examples: int
    seed: int
    failures: str | None
    dtypes: tuple[str, ...]
    shapes: str = "small"  # the shape tier (runner.SHAPE_TIERS)
    paths: tuple[str, ...] = ()  # where MODULE:NAME specs are imported from (--path)
    case_timeout: float = watchdog.CASE_TIMEOUT_S
    # draw for the declared parameter pairs the budget missed (--cover-pairs): every
    # pair checked, at about 3x a CPU run's time (docs/results.md), so asked for
    cover_pairs: bool = False


def not_on(backend: Backend, kernels: Sequence[str] | None) -> list[str]:
    """The selected kernels that have no implementation for ``backend``."""
    return [n for n, s in selected(kernels).items() if not s.runs_on(backend)]


def _selected_distributed(kernels: Sequence[str] | None) -> list[str]:
    return [n for n in PROPERTIES if not kernels or n in kernels]


def distributed_elsewhere(backend: Backend, kernels: Sequence[str] | None) -> list[str]:
    """The selected distributed kernels a run on ``backend`` does not check
    (planning.distributed_devices: a GPU backend other than mosaic_gpu, or one GPU)."""
    return [] if planning.distributed_devices(backend) else _selected_distributed(kernels)


def without_production(kernels: Sequence[str] | None) -> list[str]:
    """The selected kernels with no production shape tier."""
    return [n for n, s in selected(kernels).items() if s.production is None]


# On hardware a property's time is compiling its layouts, one after the other in one
# process, while the GPU idles: `verify --backend mosaic_gpu --examples 15` on an H100
# spent about 100 s in each of its 8 kernel x dtype properties, which no number of
# jobs shortens. There a property runs as parts of at most this many examples, each
# with its own seed (``part_seed``), in parallel. The parts depend on --examples only,
# never on --jobs, so a printed replay command draws the same cases.
HARDWARE_PART_EXAMPLES = 4


def property_parts(backend: Backend, examples: int) -> int:
    """How many parts a property of ``examples`` Hypothesis examples runs as."""
    if backend.is_interpreted:  # compiling uses the cores already: one part
        return 1
    return max(1, math.ceil(examples / HARDWARE_PART_EXAMPLES))


def part_examples(examples: int, unit: Unit) -> int:
    """The examples of ``unit``'s part: ``examples`` split as evenly as possible."""
    return examples // unit.parts + (unit.part < examples % unit.parts)


def part_seed(seed: int, unit: Unit) -> int:
    """The Hypothesis seed of ``unit``'s part: ``seed`` itself for the first part (a
    one-part property draws what it always drew), a hash of it for the others."""
    return seed if unit.part == 0 else runner.derived_seed(seed, f"part {unit.part}")


def plan(
    backend: Backend,
    kernels: Sequence[str] | None,
    dtypes: Sequence[str] | None,
    shapes: str = "small",
    examples: int = 1,
    layout: str | None = None,
) -> list[Unit]:
    """The units for the selected kernels and dtypes that run on ``backend`` (a
    property of ``examples`` examples in ``property_parts`` parts), longest first.
    The production tier has no bad-input or distributed units: those do not depend on
    sizes, and the small tier runs them. There a property is one unit per production
    layout that fits this process's memory (``layout``: only those whose name contains
    it), ``examples`` examples each; among units of unknown duration the largest
    layouts start first."""
    specs = selected(kernels)
    missing = set(not_on(backend, kernels))
    if shapes == "production":
        missing |= set(without_production(kernels))
    units: list[Unit] = []
    needs: dict[str, int] = {}  # a production unit's layout: the memory its check needs
    for name in [n for n in (kernels or specs) if n in specs and n not in missing]:
        spec_dtypes = [d for d in specs[name].dtypes_for(backend) if not dtypes or d in dtypes]
        if shapes == "production":
            fitting = production.plan(specs[name].production_layouts, backend).fitting
            for l in fitting:
                if layout is None or layout in l.name:
                    needs[l.name] = l.needs
                    units += [Unit("property", name, d, layout=l.name) for d in spec_dtypes]
            continue
        units.append(Unit("errors", name))
        parts = property_parts(backend, examples)
        units += [Unit("property", name, d, part, parts) for d in spec_dtypes for part in range(parts)]
    # The ring collectives run in a child over several devices (planning.distributed_devices).
    where = planning.distributed_devices(backend)
    distributed = _selected_distributed(kernels) if shapes == "small" and where else []
    if distributed:
        units.append(Unit("distributed", ",".join(distributed)))
    previous = durations.load("verify")
    # Unknown units first (assume slow), then by the last run's time on this backend.
    # Among unknown ones (a first run): the distributed unit, one long child process,
    # then the properties, then the bad-input checks of a second or two each.
    first = {"distributed": 0, "property": 1, "errors": 2}
    return sorted(
        units,
        key=lambda u: (-previous.get(f"{backend}:{u.key}", float("inf")), first[u.kind], -needs.get(u.layout, 0)),
    )


def layout_path(layout: str) -> str:
    """The declared path a production unit reaches by checking a case of ``layout``."""
    return f"production layout {layout}"


def run_unit(unit: Unit, options: Options, hang_report: str | None = None) -> tuple[list[Row], list[str], float]:
    """Run one unit here; returns its rows, failure messages and wall time.
    ``hang_report``: where a hung case's report goes (None: ``unit.hang_report``)."""
    start = time.perf_counter()
    if unit.kind == "errors":
        rows, failures = _errors(unit.kernel, options)
    elif unit.kind == "property":
        rows, failures = _property(unit, options, hang_report or unit.hang_report)
    else:
        rows, failures = _distributed(unit.kernel.split(","), options)
    return rows, failures, time.perf_counter() - start


def _errors(name: str, options: Options) -> tuple[list[Row], list[str]]:
    start = time.perf_counter()
    err = runner.run_errors(get_spec(name), context=checks.Context(kernel=name, backend=str(options.backend)))
    row = Row(name, "-", "errors", err.passed, err.examples, err.budget_used, None, time.perf_counter() - start)
    if not err.examples:
        row.note = "the spec declares no bad input"
    return [row], ([] if err.passed else [f"[errors] kernel={name}: {err.detail}"])


def _property(unit: Unit, options: Options, hang_report: str) -> tuple[list[Row], list[str]]:
    name, dtype = unit.kernel, unit.dtype
    backend = options.backend
    replay = (
        f"pallascheck verify --backend {backend} --kernel {name} --dtype {dtype} "
        f"--examples {options.examples} --seed {options.seed}"
        + (f" --shapes {options.shapes}" if options.shapes != "small" else "")
        + (f" --layout {shlex.quote(unit.layout)}" if unit.layout else "")
        + path_arguments(options.paths)
        + (" --cover-pairs" if options.cover_pairs else "")
    )
    dog = watchdog.CaseWatchdog(
        options.case_timeout,
        kernel=name,
        dtype=dtype,
        backend=str(backend),
        replay=replay,
        failure_dir=options.failures,
        report_path=hang_report,
    )
    with watchdog.watching(dog):
        tally = runner.run_property(
            get_spec(name),
            dtype,
            backend,
            examples=part_examples(options.examples, unit),
            seed=part_seed(options.seed, unit),
            failure_dir=options.failures,
            replay_hint=replay,
            search=dog.search(),
            shapes=options.shapes,
            cover_pairs=options.cover_pairs,
            layout=unit.layout or None,
        )
    if unit.layout:  # the layout is this unit's path: reached once a case of it was checked
        path = layout_path(unit.layout)
        tally.paths_declared = (path, *tally.paths_declared)
        if checked := max((o.examples for o in tally.outcomes.values()), default=0):
            tally.paths[path] = checked
    rows = []
    for check in check_kinds.REPORTED:
        if check in tally.outcomes:
            o = tally.outcomes[check]
            prob = tally.probabilistic_budget if check == "values" else None
            rows.append(
                Row(
                    name,
                    dtype,
                    check,
                    o.passed,
                    o.examples,
                    o.budget_used,
                    prob,
                    tally.seconds.get(check, 0.0),
                    tally.contract_budgets.get(check),
                )
            )
    # A check the spec has that no case ran is reported as not checked: the property
    # stopped at its first failing case (Hypothesis then shrinks that case), or no case
    # reached the check. Its row keeps the kernel x dtype's count honest.
    why = tally.stopped or ("the property stopped at its first failing case" if tally.failure else "no case reached it")
    for check in check_kinds.expected(get_spec(name), runner.tier_checks(check_kinds.CHECKS, options.shapes)):
        if check not in tally.outcomes:
            rows.append(Row(name, dtype, check, True, 0, 0.0, None, 0.0, note=tally.left_out.get(check, why)))
    if rows:  # a row of no case too: a unit stopped before its first case still declares its layout
        rows[0].paths_declared, rows[0].paths = tally.paths_declared, dict(tally.paths)
        rows[0].pairs_declared, rows[0].pairs = tally.pairs_declared, dict(tally.pairs)
    return rows, [tally.failure] if tally.failure else []


def _distributed(names: list[str], options: Options) -> tuple[list[Row], list[str]]:
    start = time.perf_counter()
    where = planning.distributed_devices(options.backend)
    assert where is not None, "planned only where planning.distributed_devices says"
    platform, devices = where
    family_backend = "tpu_interpret" if platform == "cpu" else "mosaic_gpu"
    on = f"{devices} CPU devices" if platform == "cpu" else f"{devices} GPUs"
    try:
        result = multidevice.run_with_devices(
            "pallascheck.properties.families.collectives:run_checks",
            devices,
            {"examples": options.examples, "seed": options.seed, "kernels": names, "backend": family_backend},
            platform=platform,
            timeout_s=600,
        )
    except multidevice.ChildTimeout as err:  # a deadlocked ring: reported with the example it was in
        return [Row(",".join(names), "-", "hang", False, 0, float("inf"), None, time.perf_counter() - start)], [
            str(err)
        ]
    seconds = (time.perf_counter() - start) / len(names)
    rows, failures = [], []
    errors = result.pop("errors")
    rows.append(Row("collectives", "-", "errors", not errors, len(PROPERTIES), 0.0, None, 0.0))
    failures += [f"[errors] {case}: {message}" for case, message in errors.items()]
    for name, tally in result.items():
        check = f"values ({family_backend}, {on})"
        for dtype in [d for d in sorted(tally["examples"]) if not options.dtypes or d in options.dtypes]:
            rows.append(
                Row(
                    name,
                    dtype,
                    check,
                    not tally["failures"],
                    tally["examples"][dtype],
                    tally["budget"][dtype],
                    None,
                    seconds,
                )
            )
        if tally["failures"]:
            rows.append(Row(name, "-", check, False, 0, float("inf"), None, seconds))
            failures += [f"[{name} on {on}] {f}" for f in tally["failures"]]
    return rows, failures


def path_arguments(paths: Sequence[str]) -> str:
    """`` --path P`` for each path: what a printed command needs to import MODULE:NAME specs."""
    return "".join(f" --path {p}" for p in paths)


def next_gpu(gpus: Sequence[str], started: Any) -> str | None:
    """The GPU of a pool's next worker: ``gpus`` in turn, ``started`` (a shared
    counter) counting the pool's workers, so that a pool of n x len(gpus) workers puts
    n on each GPU, as their shares of it (``production.share_devices``) assume; None
    without GPUs."""
    if not gpus:
        return None
    with started.get_lock():
        n, started.value = started.value, started.value + 1
    return gpus[n % len(gpus)]


def _worker_init(backend: Backend, gpus: Sequence[str], started: Any) -> None:
    gpu = next_gpu(gpus, started)
    if gpu is not None:  # before JAX creates its client
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    compilation.configure(backend, worker=True)


def run(
    units: Sequence[Unit],
    options: Options,
    jobs: int,
    cluster: Cluster | None = None,
    resume: bool = False,
    jobs_of: Mapping[Unit, int] | None = None,
) -> tuple[list[Row], list[str]]:
    """Run ``units`` on ``jobs`` processes (1: in this process), or ``jobs`` workers of
    the Ray ``cluster`` (``cluster.connect``); rows and failures in one order whatever
    the plan's (which follows earlier runs' durations): by kernel, dtype, kind, layout
    and part, so that two runs of the same settings list them alike. Each finished unit is
    journaled (fuzz/journal.py); ``resume``: the units an earlier run of the same
    settings journaled are taken as done, not run again. ``jobs_of``: per unit, the
    workers that may run it at once on each GPU (the production tier's jobs by memory,
    ``plan.jobs_by_layout``): the units of one count run together in a pool of that
    many workers a GPU, each with its share of its GPU (``production.share_devices``),
    the largest count first; ``jobs`` is then the largest pool, for the time estimate.
    Pool workers take the host's GPUs in turn (``plan.worker_gpus``)."""
    results: dict[Unit, tuple[list[Row], list[str], float]] = {}
    settings = (options.backend, options.examples, options.seed, options.shapes, options.paths, options.cover_pairs)
    log = journal.path([*settings, *sorted(u.key for u in units)])
    if not resume:
        journal.start(log)
    earlier = journal.load(log, _row) if resume else {}
    previous = durations.load("verify")
    known = {u: previous[f"{options.backend}:{u.key}"] for u in units if f"{options.backend}:{u.key}" in previous}
    start = time.perf_counter()
    gpus = planning.worker_gpus(options.backend) if cluster is None else []  # pool workers take them in turn
    per_count = max(1, len(gpus))

    def seconds_left(pending: Sequence[Unit], samples: Sequence[float]) -> float:
        pools = {u: jobs_of[u] * per_count for u in pending} if jobs_of else {u: jobs for u in pending}
        return pooled_seconds_left(pools, known, samples)

    estimate = seconds_left(units, [])
    print(
        durations.plan_line("verify", f"{len(units)} units", jobs, len(known), len(units), estimate),
        file=sys.stderr,
        flush=True,
    )

    def done(unit: Unit, result: tuple[list[Row], list[str], float], where: str = "") -> None:
        results[unit] = result
        if unit.key not in earlier:
            journal.append(log, unit.key, result)
        part = f" (part {unit.part + 1} of {unit.parts})" if unit.parts > 1 else ""
        part += f" at {unit.layout}" if unit.layout else ""
        left = seconds_left([u for u in units if u not in results], [r[2] for r in results.values()])
        print(
            f"  [{len(results)}/{len(units)}] {unit.kernel} {unit.dtype} {unit.kind}{part}: {unit_verdict(result[0])}"
            f" in {result[2]:.1f}s{where} " + durations.progress_suffix(time.perf_counter() - start, left),
            file=sys.stderr,
            flush=True,
        )

    for unit in [u for u in units if u.key in earlier]:
        done(unit, earlier[unit.key], " (an earlier run's, --resume)")
    todo = [u for u in units if u not in results]
    for unit in todo:  # reports left by an earlier run
        if os.path.exists(unit.hang_report):
            os.remove(unit.hang_report)
    # On a GPU the distributed unit's child drives every GPU of the host: it runs once
    # the workers, which share those GPUs, are gone.
    after = [u for u in todo if u.kind == "distributed" and options.backend.platform == "gpu"]
    pooled = [u for u in todo if u not in after]
    try:
        if cluster is not None:
            _run_cluster(pooled, options, cluster, jobs, done)
        elif jobs_of is not None:
            for count in sorted({jobs_of[u] for u in pooled}, reverse=True):
                production.share_devices(count)  # the pool's workers inherit it
                remaining, pool_jobs = [u for u in pooled if jobs_of[u] == count], count * per_count
                while remaining:
                    remaining, pool_jobs = _run_pool(remaining, options, pool_jobs, done, gpus)
        elif jobs <= 1:  # in this process: a hung case ends it, with the watchdog's report
            for unit in pooled:
                done(unit, run_unit(unit, options))
        else:
            remaining, pool_jobs = list(pooled), jobs
            while remaining:
                remaining, pool_jobs = _run_pool(remaining, options, pool_jobs, done, gpus)
        for unit in after:
            done(unit, run_unit(unit, options))
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (the command's handler): what finished is kept
        rows, failures = _in_order(units, results)
        raise Interrupted(rows, failures, [u for u in units if u not in results]) from None
    finally:  # the finished units' times, for the next run's estimate
        durations.save("verify", {f"{options.backend}:{u.key}": r[2] for u, r in results.items()})
    return _in_order(units, results)


def pooled_seconds_left(pool_of: Mapping[Unit, int], known: Mapping[Unit, float], samples: Sequence[float]) -> float:
    """Seconds left for the pending units ``pool_of`` maps to the size of the pool that
    runs them: pools run one after another, so each pool's work over its workers, added
    (one count for the whole run said "9 s left" with attention's 128k pool of 2
    workers, 12 minutes of it, still ahead)."""
    pools: dict[int, list[Unit]] = {}
    for unit, size in pool_of.items():
        pools.setdefault(size, []).append(unit)
    return sum(durations.seconds_left(them, known, samples, size) for size, them in pools.items())


class Interrupted(Exception):
    """A verify run stopped before its end (Ctrl-C, SIGTERM): the rows and failures of
    the units that finished (journaled, so ``--resume`` runs only the rest) and the
    units that did not."""

    def __init__(self, rows: list[Row], failures: list[str], unfinished: list[Unit]) -> None:
        super().__init__(f"interrupted with {len(unfinished)} units unfinished")
        self.rows, self.failures, self.unfinished = rows, failures, unfinished


def _in_order(units: Sequence[Unit], results: Mapping[Unit, journal.Result]) -> tuple[list[Row], list[str]]:
    """The finished units' rows (parts merged) and failures, by kernel, dtype, kind,
    layout and part."""
    listed = sorted((u for u in units if u in results), key=lambda u: (u.kernel, u.dtype, u.kind, u.layout, u.part))
    rows = merge_parts([row for unit in listed for row in results[unit][0]])
    failures = [message for unit in listed for message in results[unit][1]]
    return rows, failures


def unit_verdict(rows: Sequence[Row]) -> str:
    """A finished unit's verdict for its progress line, so that a long run (or the
    output of one cut short) says which units failed as they end."""
    failed = list(dict.fromkeys(r.check for r in rows if not r.passed))
    return f"FAILED {', '.join(failed)}" if failed else "passed"


def unfinished_not_checked(units: Sequence[Unit]) -> list[NotChecked]:
    """What an interrupted run did not check: a line per unfinished unit."""
    return [
        NotChecked(u.kernel, u.dtype, f"{u.kind}{f' at {u.layout}' if u.layout else ''}: interrupted before it ended")
        for u in units
    ]


def _run_pool(units: Sequence[Unit], options: Options, jobs: int, done, gpus: Sequence[str]) -> tuple[list[Unit], int]:
    """Run ``units`` on a pool of ``jobs`` processes; returns the units to run again in
    a new pool when a worker died, and that pool's jobs. A unit whose watchdog
    reported a hung case is done, as a failed row. A death no report explains (a
    crash, or the host's out-of-memory killer: ten production workers on an H200 took
    121 GiB of its 128) blames no unit of several: they run again one worker at a
    time, where a death is the unit's that was running (a worker runs its units in
    the order given), a crash row, and the rest go on."""
    # spawn, not fork: a forked JAX runtime is not safe to use.
    context = multiprocessing.get_context("spawn")
    broken: list[Unit] = []
    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=jobs,
        mp_context=context,
        initializer=_worker_init,
        initargs=(options.backend, gpus, context.Value("i", 0)),
    )
    try:
        futures = {pool.submit(run_unit, unit, options): unit for unit in units}
        for future in concurrent.futures.as_completed(futures):
            try:
                done(futures[future], future.result())
            except concurrent.futures.process.BrokenProcessPool:
                broken.append(futures[future])
    except BaseException:  # Ctrl-C, SIGTERM, an error here: a pool's usual end would wait for the units in flight
        pool.shutdown(wait=False, cancel_futures=True)
        for worker in multiprocessing.active_children():
            worker.terminate()
        raise
    pool.shutdown()
    broken = [u for u in units if u in broken]  # in the order given
    hung = [u for u in broken if os.path.exists(u.hang_report)]
    for unit in hung:
        with open(unit.hang_report) as f:
            done(unit, _lost(unit, "hang", f.read(), options.case_timeout))
    if hung or not broken:
        return [u for u in broken if u not in hung], jobs
    if jobs > 1:
        print(
            f"a verify worker died with {len(broken)} units unfinished and no report of why (a crash, or the "
            "host's out-of-memory killer): they run again, one worker at a time",
            file=sys.stderr,
            flush=True,
        )
        return broken, 1
    first, *rest = broken
    why = (
        "a verify worker process died while this unit ran alone in it: the kernel or XLA crashed it, or the "
        "host's out-of-memory killer stopped it (the system log says which)"
    )
    done(first, _lost(first, "crash", why, 0.0))
    return rest, 1


# A cluster worker says it is alive this often while a unit runs (at most: a quarter of
# --case-timeout). A hung case is its own watchdog's to report, as on one machine; a
# worker silent for longer than CLUSTER_SILENCE_S and --case-timeout (one that cannot
# even run a thread), or a node, is lost.
HEARTBEAT_S = 5.0
CLUSTER_SILENCE_S = 120.0  # also the time a worker has to start (imports) on a loaded node
HANG_REPORT = "hang-report.txt"  # a cluster worker's, beside the cases it saved


def cluster_task(unit: Unit, conn: Connection, inflight: str, setup: dict[str, Any]) -> dict[str, Any]:
    """Run ``unit`` in a cluster worker (``workers.Worker(..., run=cluster_task)`` on a
    node; ``setup["options"]``: the run's Options). Its failing cases and a hung case's
    report are saved beside the worker's in-flight file, not in the driver's --failures
    (this node may not see it): the saved cases return as bytes with the rows, and what
    a hung case leaves there the actor ships when its worker is lost."""
    options: Options = setup["options"]
    saved = failed_dir(inflight)
    shutil.rmtree(saved, ignore_errors=True)
    here = dataclasses.replace(options, failures=saved if options.failures else None)  # "": none saved
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(min(HEARTBEAT_S, options.case_timeout / 4)):
            conn.send(("alive", None))

    # the pipe's only sender until the unit is done: joined before the "done" message
    heart = threading.Thread(target=beat, daemon=True)
    heart.start()
    try:
        rows, failures, seconds = run_unit(unit, here, hang_report=os.path.join(saved, HANG_REPORT))
    finally:
        stop.set()
        heart.join()
    return {"rows": rows, "messages": failures, "seconds": seconds, "saved": saved_files(inflight)}


def _bring_back(saved: dict[str, bytes], failures: str | None) -> dict[str, str]:
    """Write the cases a cluster worker ``saved`` under ``failures`` here; returns the
    path here of each, by name."""
    paths: dict[str, str] = {}
    for name, data in saved.items():
        if name == HANG_REPORT or not failures:
            continue
        os.makedirs(failures, exist_ok=True)
        paths[name] = os.path.join(failures, name)
        with open(paths[name], "wb") as f:
            f.write(data)
    return paths


def _here(text: str, paths: dict[str, str]) -> str:
    """``text`` with the node's paths to the saved cases replaced by their ``paths`` here."""
    for name, path in paths.items():
        text = re.sub(r"\S*/" + re.escape(name), path.replace("\\", "\\\\"), text)
    return text


def _run_cluster(
    units: Sequence[Unit],
    options: Options,
    cluster: Cluster,
    jobs: int,
    done: Callable[[Unit, tuple[list[Row], list[str], float], str], None],
) -> None:
    """Run ``units`` on ``jobs`` workers of ``cluster``, each where Ray places it (the
    progress line names the node that ran each unit). A
    unit whose worker was lost is that unit's failed row, as on one machine: "hang"
    where its watchdog's report came back, else what the node's actor saw ("crash",
    "oom", "hang": fuzz/cluster.py). A unit whose node left the cluster is run again
    on another, and reported once."""
    setup = {"backend": str(options.backend), "paths": list(options.paths), "options": options}
    silence = max(options.case_timeout, CLUSTER_SILENCE_S)
    queue = list(units)
    workers: dict[int, RemoteWorker] = {}
    running: dict[int, Unit] = {}
    # Slots whose node left: the node took its share of the cluster with it, so a new
    # worker there would wait for a place while the others stand idle (and the unit given
    # to it with them); the last slot is never retired: its new worker waits for a node.
    retired: set[int] = set()
    started = 0
    with tempfile.TemporaryDirectory(prefix="pallascheck-verify-") as directory:
        try:
            while queue or running:
                for slot in range(jobs):
                    if slot in running or slot in retired or not queue:
                        continue
                    if slot not in workers:
                        started += 1
                        folder = os.path.join(directory, f"worker-{started}")
                        workers[slot] = RemoteWorker(slot, folder, setup, cluster, run=cluster_task)
                    running[slot] = queue.pop(0)
                    workers[slot].start(running[slot])
                for slot, unit in list(running.items()):
                    worker = workers[slot]
                    # verify sets no memory limit of its own, as on one machine (Ray's
                    # memory monitor may still end a worker: an "oom" row)
                    messages, death = worker.poll(silence, sys.maxsize)
                    finished = [payload for kind, payload in messages if kind == "done"]
                    if death is not None:
                        del workers[slot]
                    if finished:
                        del running[slot]
                        result = finished[0]
                        paths = _bring_back(result["saved"], options.failures)
                        said = [_here(m, paths) for m in result["messages"]]
                        done(unit, (result["rows"], said, result["seconds"]), f" on node {worker.node_label}")
                    elif death is not None:
                        del running[slot]
                        if death.kind == "lost":  # the node, not the kernel: run again elsewhere
                            print(
                                f"  {unit.kernel} {unit.dtype} {unit.kind}: {death.message}; running it again on "
                                "another node",
                                file=sys.stderr,
                                flush=True,
                            )
                            queue.insert(0, unit)
                            if len(retired) + 1 < jobs:
                                retired.add(slot)
                        else:
                            lost = _worker_lost(unit, death.kind, death.message, worker, options)
                            done(unit, lost, f" on node {worker.node_label}")
                time.sleep(0.05)
        finally:
            for worker in workers.values():
                worker.request_stop()
            deadline = time.monotonic() + 15.0
            for worker in workers.values():
                worker.wait(deadline)


def _worker_lost(
    unit: Unit, kind: str, message: str, worker: RemoteWorker, options: Options
) -> tuple[list[Row], list[str], float]:
    """The failed row of a unit whose cluster worker died: a hang where the watchdog's
    report came back with the cases the worker had saved, else ``kind``."""
    saved = saved_files(worker.inflight)
    paths = _bring_back(saved, options.failures)
    if HANG_REPORT in saved:
        return _lost(unit, "hang", _here(saved[HANG_REPORT].decode(), paths), options.case_timeout)
    return _lost(unit, kind, f"a verify worker was lost while running this unit ({kind}): {message}", 0.0)


def _lost(unit: Unit, check: str, message: str, seconds: float) -> tuple[list[Row], list[str], float]:
    """The result of a unit whose worker process was lost (a production unit's layout
    declared and not reached)."""
    row = Row(unit.kernel, unit.dtype, check, False, 0, float("inf"), None, seconds)
    row.paths_declared = (layout_path(unit.layout),) if unit.layout else ()
    return [row], [message], seconds


def _larger(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def merge_parts(rows: Sequence[Row]) -> list[Row]:
    """One row per kernel x dtype x check: the rows of a property's parts combined
    (passed by all, examples and seconds summed, the worst budgets), in first-seen order."""
    merged: dict[tuple[str, str, str], Row] = {}
    for row in rows:
        key = (row.kernel, row.dtype, row.check)
        if key not in merged:
            merged[key] = row
            continue
        m = merged[key]
        merged[key] = Row(
            row.kernel,
            row.dtype,
            row.check,
            m.passed and row.passed,
            m.examples + row.examples,
            max(m.budget_used, row.budget_used),
            _larger(m.probabilistic_budget, row.probabilistic_budget),
            m.seconds + row.seconds,
            _larger(m.contract_budget, row.contract_budget),
            "" if m.examples + row.examples else (m.note or row.note),
            tuple(dict.fromkeys(m.paths_declared + row.paths_declared)),
            {k: m.paths.get(k, 0) + row.paths.get(k, 0) for k in {**m.paths, **row.paths}},
            tuple(dict.fromkeys(m.pairs_declared + row.pairs_declared)),
            {k: m.pairs.get(k, 0) + row.pairs.get(k, 0) for k in {**m.pairs, **row.pairs}},
        )
    return list(merged.values())


def slowest(rows: Sequence[Row], count: int) -> list[Row]:
    """The ``count`` slowest kernel x dtype x check rows."""
    return sorted(rows, key=lambda r: -r.seconds)[:count]


def _row(**fields: Any) -> Row:
    """A row from its fields as a journal keeps them (JSON: lists for tuples)."""
    return Row(
        **{
            **fields,
            "paths_declared": tuple(fields["paths_declared"]),
            "pairs_declared": tuple(fields["pairs_declared"]),
        }
    )


def as_json(row: Row) -> dict[str, Any]:
    budget = row.budget_used
    return {
        **dataclasses.asdict(row),
        "budget_used": None if budget == float("inf") or not row.checked else budget,
        "verdict": row.verdict,
        "pairs_met": [p for p in row.pairs_declared if row.pairs.get(p)],
        "pairs_not_met": row.pairs_not_met,
    }


def fmt_budget(value: float | None) -> str:
    """Three significant figures, more where they would hide which side of 1 (the
    verdict's line) the value is on: 0.9999996 and 1.002 never both print as "1"."""
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    for digits in range(3, 17):
        text = f"{value:.{digits}g}"
        shown = float(text)
        if (shown <= 1.0) == (value <= 1.0) and (shown != 1.0 or value == 1.0):
            return text
    return repr(value)


# A check whose contract budget is reported, never a verdict: xla_reference is the
# baseline a user writes, not the kernel under test.
INFORMATIONAL_CONTRACT = "reference"
INFO_MARK = "*"
NOT_CHECKED = "- not checked"


def marks() -> tuple[str, str]:
    """The verdict marks (pass, fail): check marks where stdout can print them."""
    try:
        "\u2714\u2718".encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "ok", "FAIL !!"
    return "\u2714 pass", "\u2718 FAIL"


def legend(full: bool = False) -> str:
    """What the columns mean (``full``: the every-row table's, else the per-kernel summary's)."""
    lines = [
        "How to read this:",
        "  verdict      pass: every case was within its bound; FAIL: a case was not (details above the table);",
        "               not checked: asked for, and no case checked it (why: the table and the summary)",
        "  budget used  worst |kernel - float64 oracle| / derived bound over the cases; <= 1 passes,",
        "               far below 1 means the bound is loose there",
        "  contract     the same outputs' worst error / the op's accuracy contract (what a backward-stable",
        "               algorithm achieves in that dtype); over 1 fails the contract check",
    ]
    if full:
        lines += [
            f"               {INFO_MARK} on a reference row: xla_reference (the plain jnp baseline) against the "
            "contract,",
            "               reported, never a verdict",
            "  prob. budget the values' error / the probabilistic bound lambda*sqrt(k)*u: how tight the bound is,",
            "               never a verdict",
            "  cases        cases checked (each Hypothesis example checks two)",
        ]
    else:
        lines += ["               (the kernel's own rows; --full also shows xla_reference's, never a verdict)"]
    return "\n".join(
        lines
        + [
            *textwrap.wrap(
                check_kinds.legend_line(), width=100, initial_indent="  checks       ", subsequent_indent=" " * 15
            ),
        ]
    )


def failures_first(rows: Sequence[Row]) -> list[Row]:
    """Failed rows first, each group in its original order."""
    return sorted(rows, key=lambda r: r.passed)


def _contract_cell(row: Row) -> str:
    cell = fmt_budget(row.contract_budget)
    return cell + INFO_MARK if row.check == INFORMATIONAL_CONTRACT and row.contract_budget is not None else cell


def print_table(rows: Sequence[Row]) -> None:
    """Every kernel x dtype x check row, failures first."""
    ok, fail = marks()
    header = ("verdict", "kernel", "dtype", "check", "cases", "budget used", "contract", "prob. budget", "time (s)")
    body = [
        (
            fail if not r.passed else ok if r.checked else NOT_CHECKED,
            r.kernel,
            r.dtype,
            r.check,
            str(r.examples),
            fmt_budget(r.budget_used) if r.checked else f"- ({r.note})" if r.note else "-",
            _contract_cell(r),
            fmt_budget(r.probabilistic_budget),
            f"{r.seconds:.1f}",
        )
        for r in failures_first(rows)
    ]
    _print_columns(header, body)


def _worst(rows: Sequence[Row], value: Any) -> str:
    """The largest ``value(row)`` and where it was (check, dtype)."""
    scored = [(value(r), r) for r in rows if value(r) is not None]
    if not scored:
        return "-"
    top, row = max(scored, key=lambda pair: pair[0])
    where = row.check if row.dtype == "-" else f"{row.check} {row.dtype}"
    return f"{fmt_budget(top)} ({where})"


def print_summary(rows: Sequence[Row]) -> None:
    """One line per kernel, failing kernels first: verdict, checks passed, dtypes,
    the worst budget used and the worst contract budget (the kernel's own, not
    xla_reference's), and time."""
    ok, fail = marks()
    kernels: dict[str, list[Row]] = {}
    for row in rows:
        kernels.setdefault(row.kernel, []).append(row)
    header = ("verdict", "kernel", "checks passed", "dtypes", "worst budget used", "worst contract", "time (s)")
    body = []
    for name, group in sorted(kernels.items(), key=lambda item: all(r.passed for r in item[1])):
        checked = [r for r in group if r.checked]
        passed = all(r.passed for r in group)
        dtypes = sorted({r.dtype for r in checked if r.dtype != "-"})
        own = [r for r in checked if r.check != INFORMATIONAL_CONTRACT]
        unchecked = len(group) - len(checked)
        body.append(
            (
                fail if not passed else ok if checked else NOT_CHECKED,
                name,
                f"{sum(r.passed for r in checked)}/{len(checked)}"
                + (f" ({unchecked} not checked)" if unchecked else ""),
                " ".join(dtypes) or "-",
                _worst(checked, lambda r: r.budget_used),
                _worst(own, lambda r: r.contract_budget),
                f"{sum(r.seconds for r in group):.1f}",
            )
        )
    _print_columns(header, body)


def _print_columns(header: Sequence[str], body: Sequence[Sequence[str]]) -> None:
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    for line in [header, tuple("-" * w for w in widths), *body]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())


def coverage(rows: Sequence[Row]) -> list[tuple[str, str, list[str], dict[str, int]]]:
    """Per kernel x dtype with declared code paths: (kernel, dtype, declared, reached counts)."""
    return [(r.kernel, r.dtype, list(r.paths_declared), r.paths) for r in rows if r.paths_declared]


def pair_coverage(rows: Sequence[Row]) -> list[tuple[str, str, list[str], dict[str, int]]]:
    """Per kernel x dtype with declared parameters: (kernel, dtype, declared pairs, cases meeting each)."""
    return [(r.kernel, r.dtype, list(r.pairs_declared), r.pairs) for r in rows if r.pairs_declared]


def print_coverage(rows: Sequence[Row]) -> None:
    """The declared code paths each kernel x dtype reached (cases reaching each) and
    the pairs of its declared parameters it met."""
    paths = {(k, d): (declared, reached) for k, d, declared, reached in coverage(rows)}
    met = {(k, d): (declared, counts) for k, d, declared, counts in pair_coverage(rows)}
    if not paths and not met:
        return
    print("\nCode paths reached and parameter pairs met (declared by each spec; cases that ran each path):")
    body = []
    for key in dict.fromkeys([*paths, *met]):
        declared, reached = paths.get(key, ([], {}))
        missed = [p for p in declared if not reached.get(p)]
        all_pairs, counts = met.get(key, ([], {}))
        unmet = [p for p in all_pairs if not counts.get(p)]
        body.append(
            (
                *key,
                f"{len(declared) - len(missed)}/{len(declared)}",
                f"{len(all_pairs) - len(unmet)}/{len(all_pairs)}" if all_pairs else "-",
                "; ".join(f"{p} ({reached[p]})" for p in declared if reached.get(p))
                + ("" if not missed else f"; NOT REACHED: {'; '.join(missed)}")
                + ("" if not unmet else f"; PAIRS NOT MET: {'; '.join(unmet)}"),
            )
        )
    _print_columns(("kernel", "dtype", "paths", "pairs covered", "reached (cases)"), body)


def unreached(rows: Sequence[Row]) -> list[tuple[str, str, str]]:
    """(kernel, dtype, path) for each declared path no case reached."""
    return [(k, d, p) for k, d, declared, reached in coverage(rows) for p in declared if not reached.get(p)]


def pairs_not_checked(rows: Sequence[Row], covered: bool) -> list[NotChecked]:
    """The declared parameter pairs no case met, for the verdict: each one where the
    run drew for them (``covered``: the few no draw could meet), else one line per
    kernel x dtype counting them (the budget's draws alone miss most)."""
    if covered:
        return [NotChecked(k, d, f"parameter pair not met: {p}") for k, d, p in unmet_pairs(rows)]
    return [
        NotChecked(
            r.kernel,
            r.dtype,
            f"{len(r.pairs_not_met)} of {len(r.pairs_declared)} parameter pairs not met (--cover-pairs draws for them)",
        )
        for r in rows
        if r.pairs_not_met
    ]


def unmet_pairs(rows: Sequence[Row]) -> list[tuple[str, str, str]]:
    """(kernel, dtype, pair) for each declared parameter pair no case met."""
    return [(r.kernel, r.dtype, p) for r in rows for p in r.pairs_not_met]
