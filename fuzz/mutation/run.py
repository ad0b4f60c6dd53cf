"""Run a kernel's mutants through its spec's checks and classify each one.

First the unmutated kernel (the baseline) runs every check of every spec given, on
every dtype: it must
pass (a failure there is a false alarm, and no score means anything then), and it
records each case's output digest and which lines of the kernel module ran. Then
each mutant gets a fresh worker process (``fuzz.workers``: a hang, a crash or a
runaway allocation kills that worker, and counts as the mutant's death) and runs the
same draws, spec and dtype after the other, until a check fails. A mutant is

- ``killed``: a check failed, or its worker hung, crashed or ran out of memory (a
  worker lost with its cluster node is no verdict: the mutant runs again elsewhere);
- ``equivalent``: it passed, and every case drew the same inputs and every kernel
  output was bitwise equal to the baseline's: it changes nothing the checks draw;
- ``survived``: it passed and changed some output, or (``unreached``) no case ran
  its line, which is not run at all;
- ``not run``: the time budget ran out or the run was interrupted first.

Results go to a JSON-lines file as they arrive, so an interrupted run keeps what it
found and ``resume`` continues it.

With a Ray cluster (``cluster.connect``) each worker is a slot's actor on whichever
node Ray places it (fuzz/cluster.py): the mutant's source travels in the worker's
setup, so a node needs pallascheck and the spec, never the driver's disk.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

from pallascheck.fuzz import durations
from pallascheck.fuzz.cluster import Cluster, RemoteWorker
from pallascheck.fuzz.mutation import worker as mutant_worker
from pallascheck.fuzz.mutation.operators import Mutant
from pallascheck.fuzz.workers import Death, Task, Worker
from pallascheck.properties import check_kinds
from pallascheck.properties.spec import KernelSpec

KILLED, SURVIVED, EQUIVALENT, UNREACHED, NOT_RUN = "killed", "survived", "equivalent", "unreached", "not run"
# A mutant's case may compile what the baseline found in the persistent cache: it
# gets at least this long, and at least this many times the baseline's slowest step.
MIN_CASE_TIMEOUT_S = 120.0
CASE_TIMEOUT_FACTOR = 10.0
# Modules whose functions are the harness, not the kernel under test.
HARNESS_PREFIXES = (
    "pallascheck.properties",
    "pallascheck.oracles",
    "pallascheck.fuzz",
    "jax",
    "numpy",
    "hypothesis",
    "functools",
    "builtins",
)


class BaselineFailure(RuntimeError):
    """The unmutated kernel fails its own checks: a false alarm, so no score."""


@dataclasses.dataclass(frozen=True)
class Settings:
    # (spec, dtype) pairs, run in this order: a spec is a registered name or
    # MODULE:NAME (see fuzz/targets.py); several specs may check one module
    units: tuple[tuple[str, str], ...]
    module: str  # the kernel module mutated
    origin: str  # its source file
    backend: str
    examples: int  # Hypothesis examples per dtype, as verify's --examples counts them
    seed: int
    jobs: int
    memory_bytes: int
    out: str  # the JSON-lines results
    paths: tuple[str, ...] = ()
    budget_s: float | None = None
    case_timeout_s: float | None = None  # None: derived from the baseline
    checks: tuple[str, ...] = check_kinds.CHECKS

    def header(self) -> dict[str, Any]:
        """What must match for a saved result to be reused."""
        return {
            "units": [list(u) for u in self.units],
            "module": self.module,
            "backend": self.backend,
            "examples": self.examples,
            "seed": self.seed,
            "checks": list(self.checks),
        }


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    status: str
    check: str | None = None  # what killed it: a check, or "hang", "crash", "oom"
    unit: tuple[str, str] | None = None  # the (spec, dtype) it died on
    cases: int = 0  # cases checked until the kill (every case drawn, for the others)
    seconds: float = 0.0
    message: str = ""
    node: str | None = None  # the Ray node whose worker ran it (None: this machine)

    def row(self, original: str, path: str) -> dict[str, Any]:
        m = self.mutant
        return {
            "kind": "mutant",
            "key": source_key(m.source),
            "id": m.id,
            "operator": m.operator,
            "function": m.function,
            "line": m.line,
            "before": m.before,
            "after": m.after,
            "status": self.status,
            "check": self.check,
            "kernel": self.unit[0] if self.unit else None,
            "dtype": self.unit[1] if self.unit else None,
            "cases": self.cases,
            "seconds": round(self.seconds, 2),
            "message": self.message,
            "node": self.node,
            "diff": m.diff(original, path),
        }


@dataclasses.dataclass
class Result:
    outcomes: list[Outcome]
    baseline_seconds: float
    seconds: float
    interrupted: bool = False

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def score(self) -> float | None:
        """Killed / (killed + survived + unreached): equivalent and not-run mutants excluded."""
        judged = self.count(KILLED) + self.count(SURVIVED) + self.count(UNREACHED)
        return self.count(KILLED) / judged if judged else None


def source_key(source: str) -> str:
    return hashlib.sha1(source.encode()).hexdigest()


def duration_prefix(settings: Settings) -> str:
    """The key of a run's settings among the earlier durations (``fuzz/durations.py``)."""
    return hashlib.sha1(json.dumps(settings.header(), sort_keys=True).encode()).hexdigest()[:16]


def kernel_module(spec: KernelSpec) -> str:
    """The module of the kernel function the spec calls: the closest functions its
    ``kernel`` reaches through closures and ``functools.partial`` that are not the
    harness'. Several candidates, or none: pass the module explicitly."""
    frontier: list[Any] = [spec.kernel]
    seen: set[int] = set()
    for _ in range(6):
        found: set[str] = set()
        following: list[Any] = []
        for fn in frontier:
            if id(fn) in seen:
                continue
            seen.add(id(fn))
            if isinstance(fn, functools.partial):
                following += [fn.func, *fn.args, *fn.keywords.values()]
                continue
            module = getattr(fn, "__module__", None)
            if callable(fn) and module and not module.startswith(HARNESS_PREFIXES):
                found.add(module)
                continue
            inner = getattr(fn, "__wrapped__", None)
            if inner is not None:
                following.append(inner)
            if isinstance(fn, types.FunctionType):
                following += [cell.cell_contents for cell in fn.__closure__ or () if _filled(cell)]
        if len(found) == 1:
            return found.pop()
        if found:
            raise ValueError(
                f"spec {spec.name!r} calls kernels of several modules {sorted(found)}: name the one to "
                f"mutate with --module"
            )
        frontier = following
    raise ValueError(f"spec {spec.name!r}: no kernel module found behind its kernel function: name it with --module")


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def module_origin(module: str) -> str:
    """The source file of ``module`` (imported here, in the parent, to find it)."""
    import importlib

    path = inspect.getsourcefile(importlib.import_module(module))
    if path is None:
        raise ValueError(f"module {module} has no Python source to mutate")
    return os.path.realpath(path)


def load_previous(settings: Settings) -> dict[str, dict[str, Any]]:
    """The mutant rows of an earlier run with the same header, by mutant source key."""
    try:
        with open(settings.out) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return {}
    headers = [r for r in rows if r.get("kind") == "header"]
    if not headers or {k: headers[-1].get(k) for k in settings.header()} != settings.header():
        return {}
    return {r["key"]: r for r in rows if r.get("kind") == "mutant"}


@dataclasses.dataclass
class _Job:
    """One process's work: the baseline (mutant None) or one mutant, unit by unit."""

    mutant: Mutant | None
    worker: Worker | RemoteWorker
    units: list[tuple[str, str]]
    started: float = dataclasses.field(default_factory=time.monotonic)
    unit: tuple[str, str] | None = None
    cases: int = 0
    pending: bool = False  # a case started and has not reported yet
    killed_at: int | None = None  # cases until the first failure
    digests: dict[tuple[str, str], list[str]] = dataclasses.field(default_factory=dict)
    lines: set[int] = dataclasses.field(default_factory=set)
    slowest_step: float = 0.0
    last_message: float = dataclasses.field(default_factory=time.monotonic)

    def next_task(self, settings: Settings) -> bool:
        if not self.units:
            return False
        if self.unit is None:  # the first task: the job's time starts now, not at its worker's spawn
            self.started = self.last_message = time.monotonic()
        self.unit = self.units.pop(0)
        self.digests[self.unit] = []
        self.worker.start(Task(*self.unit, "any", None, settings.seed, settings.examples, settings.checks, False))
        return True

    def receive(self, kind: str, payload: Any) -> None:
        now = time.monotonic()
        self.slowest_step = max(self.slowest_step, now - self.last_message)
        self.last_message = now
        if kind == "case":
            if self.pending and self.killed_at is None:  # the last case raised before it reported
                self.killed_at = self.cases
            self.cases += 1
            self.pending = True
        elif kind == "checked":
            self.pending = False
            if self.unit is None:
                raise RuntimeError("a case was checked before the job's first task started")
            self.digests[self.unit].append(payload["digest"])
            if not payload["passed"] and self.killed_at is None:
                self.killed_at = self.cases


def _setup(settings: Settings, mutant: Mutant | None) -> dict[str, Any]:
    setup: dict[str, Any] = {"backend": settings.backend, "paths": list(settings.paths), "database": None}
    if mutant is None:  # by name: a node finds the module's file where it is installed there
        setup["coverage"] = settings.module
    else:
        setup["mutant"] = {"module": settings.module, "source": mutant.source, "origin": settings.origin}
    return setup


def _spawn(
    settings: Settings, mutant: Mutant | None, slot: int, directory: str, cluster: Cluster | None = None
) -> _Job:
    """A job whose worker process starts (interpreter, JAX import) now, here or (with
    ``cluster``) once Ray has placed its actor; its first task goes when ``next_task``
    is called."""
    folder = os.path.join(directory, f"worker-{slot}-{'baseline' if mutant is None else mutant.id}")
    os.makedirs(folder, exist_ok=True)
    setup = _setup(settings, mutant)
    worker = (
        Worker(slot, folder, setup, run=mutant_worker.run_task)
        if cluster is None
        else RemoteWorker(slot, folder, setup, cluster, run=mutant_worker.run_task)
    )
    return _Job(mutant, worker, list(settings.units))


def _start(settings: Settings, mutant: Mutant | None, slot: int, directory: str, cluster: Cluster | None) -> _Job:
    job = _spawn(settings, mutant, slot, directory, cluster)
    job.next_task(settings)
    return job


class _Retired:
    """Workers told to exit, reaped when they have (a worker's exit takes a moment
    that the next mutant need not wait for); ``close`` kills what is left."""

    def __init__(self) -> None:
        self.workers: list[Worker | RemoteWorker] = []

    def add(self, worker: Worker | RemoteWorker) -> None:
        worker.request_stop()
        self.workers.append(worker)

    def reap(self) -> None:
        for worker in [w for w in self.workers if w.exited()]:
            worker.kill()  # joins it and closes its pipe; on a cluster, ends its actor
            self.workers.remove(worker)

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers.clear()


def _step(
    job: _Job,
    settings: Settings,
    timeout: float,
) -> tuple[tuple[str, str] | None, dict[str, Any] | None, Death | None]:
    """Poll the job's worker; returns (the unit finished or None, its result, death)."""
    messages, death = job.worker.poll(timeout, settings.memory_bytes)
    for kind, payload in messages:
        job.receive(kind, payload)
        if kind == "done":
            return job.unit, payload, death
    return None, None, death


def run_baseline(
    settings: Settings, directory: str, progress: Callable[[str], None], cluster: Cluster | None = None
) -> _Job:
    """Run the unmutated kernel; raises BaselineFailure if any check fails."""
    job = _start(settings, None, 0, directory, cluster)
    timeout = settings.case_timeout_s or 600.0
    try:
        while True:
            unit, result, death = _step(job, settings, timeout)
            if death is not None and death.kind == "lost":  # its node left, not the kernel: again, elsewhere
                progress(f"baseline: {death.message}; running it again on another node")
                job = _start(settings, None, 0, directory, cluster)
                continue
            if death is not None:
                raise BaselineFailure(f"the unmutated kernel's worker was lost ({death.kind}): {death.message}")
            if result is not None:
                if unit is None:
                    raise RuntimeError("the unmutated kernel's worker finished a task before its first started")
                if result["failure"]:
                    raise BaselineFailure(
                        f"the unmutated kernel fails its checks ({' '.join(unit)}):\n{result['failure']}"
                    )
                job.lines = set(result["lines"])
                progress(f"baseline {' '.join(unit)}: {len(job.digests[unit])} cases passed")
                if not job.next_task(settings):
                    break
            time.sleep(0.05)
    finally:
        job.worker.stop()
    return job


def _gist(failure: str, lines: int = 3, width: int = 400) -> str:
    """The head of a failure message on one line (what failed, where, and why)."""
    text = " / ".join(line.strip() for line in failure.strip().splitlines()[:lines])
    return text if len(text) <= width else text[: width - 3] + "..."


def _finish(job: _Job, status: str, baseline: _Job, **fields: Any) -> Outcome:
    assert job.mutant is not None
    if status == SURVIVED:
        different = _first_difference(job.digests, baseline.digests)
        if different is None:
            status = EQUIVALENT
        else:
            fields["message"] = f"first output that differs from the unmutated kernel's: {different}"
    node = job.worker.node[0] if job.worker.node else None
    return Outcome(job.mutant, status, seconds=time.monotonic() - job.started, node=node, **fields)


def _first_difference(
    digests: dict[tuple[str, str], list[str]], baseline: dict[tuple[str, str], list[str]]
) -> str | None:
    """Where a mutant's inputs or outputs first differ from the baseline's ("SPEC DTYPE case N"), or None."""
    for unit, theirs in baseline.items():
        ours = digests.get(unit, [])
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                return f"{' '.join(unit)} case {i + 1}"
        if len(ours) != len(theirs):
            return f"{' '.join(unit)}: {len(ours)} cases drawn, the unmutated kernel's run drew {len(theirs)}"
    return None


def run(
    settings: Settings,
    mutants: Sequence[Mutant],
    original: str,
    display_path: str,
    *,
    resume: bool = False,
    progress: Callable[[str], None] = lambda line: None,
    cluster: Cluster | None = None,
) -> Result:
    """The baseline, then every mutant on ``settings.jobs`` workers, processes here or
    (``cluster``) slots of that Ray cluster; each outcome is appended to
    ``settings.out`` as it arrives (``resume``: outcomes already there for the same
    settings are reused)."""
    start = time.monotonic()
    previous = load_previous(settings) if resume else {}
    os.makedirs(os.path.dirname(os.path.abspath(settings.out)), exist_ok=True)
    out = open(settings.out, "a" if previous else "w")
    outcomes: dict[int, Outcome] = {}
    # Earlier durations count only for the same settings: more examples or another
    # dtype change every mutant's time. The baseline runs alone, the mutants on the jobs.
    earlier = durations.load("mutate")
    prefix = duration_prefix(settings)
    keys = {m.id: source_key(m.source) for m in mutants}
    baseline_known = earlier.get(f"{prefix}:baseline")
    to_run = [keys[m.id] for m in mutants if keys[m.id] not in previous]
    known = {k: earlier[f"{prefix}:{k}"] for k in to_run if f"{prefix}:{k}" in earlier}
    progress(
        durations.plan_line(
            "mutate",
            f"the baseline and {len(to_run)} mutants" + (f" ({len(previous)} reused)" if previous else ""),
            settings.jobs,
            len(known) + (baseline_known is not None),
            len(to_run) + 1,
            (baseline_known or 0.0) + durations.seconds_left(to_run, known, [], settings.jobs),
        )
    )
    # The seconds of the mutants whose workers ran in this run (the typical mutant's
    # time: reused results and unreached lines took none), and what is saved for the
    # next run (unreached ones at 0: their line stays unreached under these settings).
    ran: dict[str, float] = {}
    spent: dict[str, float] = {}

    def record(outcome: Outcome, reused: bool = False) -> None:
        outcomes[outcome.mutant.id] = outcome
        if not reused:
            out.write(json.dumps(outcome.row(original, display_path)) + "\n")
            out.flush()
        o = outcome
        if not reused:
            spent[keys[o.mutant.id]] = o.seconds
            if o.status != UNREACHED:
                ran[keys[o.mutant.id]] = o.seconds
        pending = [keys[m.id] for m in mutants if m.id not in outcomes]
        left = durations.seconds_left(pending, known, list(ran.values()), settings.jobs)
        if settings.budget_s is not None:  # what the budget leaves is not run
            left = min(left, max(0.0, settings.budget_s - (time.monotonic() - start)))
        how = f" by {o.check} ({' '.join(o.unit or ())}) after {o.cases} cases" if o.status == KILLED else ""
        progress(
            f"[{len(outcomes)}/{len(mutants)}] {o.mutant.label}: {o.status}{how} ({o.seconds:.1f} s) "
            + durations.progress_suffix(time.monotonic() - start, left)
        )

    import jax

    out.write(
        json.dumps(
            {
                "kind": "header",
                **settings.header(),
                "origin": display_path,
                "jax": jax.__version__,
                "mutants": len(mutants),
                "jobs": settings.jobs,
            }
        )
        + "\n"
    )
    out.flush()
    interrupted = False
    baseline_seconds = 0.0
    jobs: dict[int, _Job] = {}
    # Per slot, the next mutant's worker, spawned while the slot's current mutant runs:
    # a worker's start (the interpreter, JAX's import) is seconds that then overlap
    # another mutant's checks instead of adding to the run.
    spares: dict[int, _Job] = {}
    retired = _Retired()
    with tempfile.TemporaryDirectory(prefix="pallascheck-mutate-") as directory:
        try:
            progress(
                f"baseline: the unmutated kernel on {settings.backend}, {settings.examples} Hypothesis examples for each of "
                + ", ".join(" ".join(u) for u in settings.units)
            )
            baseline = run_baseline(settings, directory, progress, cluster)
            baseline_seconds = time.monotonic() - start
            durations.save("mutate", {f"{prefix}:baseline": baseline_seconds})
            timeout = settings.case_timeout_s or max(MIN_CASE_TIMEOUT_S, CASE_TIMEOUT_FACTOR * baseline.slowest_step)
            queue: list[Mutant] = []
            for m in mutants:
                if source_key(m.source) in previous:
                    row = previous[source_key(m.source)]
                    unit = (row["kernel"], row["dtype"]) if row["kernel"] else None
                    record(
                        Outcome(
                            m,
                            row["status"],
                            row["check"],
                            unit,
                            row["cases"],
                            row["seconds"],
                            row["message"],
                            row.get("node"),
                        ),
                        reused=True,
                    )
                elif not any(line in baseline.lines for line in range(m.reach[0], m.reach[1] + 1)):
                    record(Outcome(m, UNREACHED, message="no case drawn runs this line"))
                else:
                    queue.append(m)
            while queue or jobs or spares:
                over_budget = settings.budget_s is not None and time.monotonic() - start > settings.budget_s
                if over_budget:
                    break
                for slot in range(settings.jobs):
                    if slot not in jobs and (slot in spares or queue):
                        spare: _Job | None = spares.pop(slot, None)
                        jobs[slot] = spare or _spawn(settings, queue.pop(0), slot, directory, cluster)
                        jobs[slot].next_task(settings)
                    if slot not in spares and queue:
                        spares[slot] = _spawn(settings, queue.pop(0), slot, directory, cluster)
                for slot, job in list(jobs.items()):
                    unit, result, death = _step(job, settings, timeout)
                    if death is not None and death.kind == "lost" and job.mutant is not None:
                        # its node left the cluster, which says nothing of the mutant: it runs again
                        progress(f"{job.mutant.label}: {death.message}; running it again on another node")
                        queue.insert(0, job.mutant)
                        del jobs[slot]
                        continue
                    outcome = None
                    if death is not None:
                        outcome = _finish(
                            job,
                            KILLED,
                            baseline,
                            check=death.kind,
                            unit=job.unit,
                            cases=job.killed_at or job.cases,
                            message=death.message,
                        )
                    elif result is not None and result["failure"]:
                        outcome = _finish(
                            job,
                            KILLED,
                            baseline,
                            check=result["check"] or "crash",
                            unit=unit,
                            cases=job.killed_at or job.cases,
                            message=_gist(result["failure"]),
                        )
                    elif result is not None and not job.next_task(settings):
                        outcome = _finish(job, SURVIVED, baseline, cases=job.cases)
                    if outcome is not None:
                        if death is None:
                            retired.add(job.worker)
                        del jobs[slot]
                        record(outcome)
                retired.reap()
                time.sleep(0.05)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            for job in [*jobs.values(), *spares.values()]:
                job.worker.kill()
            retired.close()
            out.close()
            durations.save("mutate", {f"{prefix}:{k}": seconds for k, seconds in spent.items()})
    for m in mutants:
        if m.id not in outcomes:
            outcomes[m.id] = Outcome(m, NOT_RUN)
    return Result([outcomes[m.id] for m in mutants], baseline_seconds, time.monotonic() - start, interrupted)
