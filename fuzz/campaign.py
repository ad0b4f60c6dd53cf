"""Fuzz campaigns: search for inputs that break kernels, survive the kernels that
hang or crash, keep every finding once, and resume where the last run stopped.

A campaign runs tasks (one Hypothesis run of ``examples`` examples of one arm, each
one compiled layout checking ``runner.layout_cases`` cases, or ``layout_cases``) in
worker processes (``workers``), ``jobs`` at a time. Targeted (the default), each
task reports every check's budget used (error / bound) to ``hypothesis.target``,
and a bandit (``bandit``) over (kernel, dtype), input kind and config slot spends
the next task where budgets climb; untargeted, tasks go to uniformly drawn
(kernel, dtype) pairs with unpinned draws, which is the baseline the targeted
search is measured against.

A value failure is shrunk by Hypothesis to its smallest input, deduplicated by
signature (``corpus``), and its check is retired for that (kernel, dtype): the
others go on. A hang, crash or out-of-memory kills the worker: the case it was
running is kept, the pair is retired, a new worker takes over. Everything is on disk
the moment it is known; ``resume=True`` continues a campaign from its state file,
skipping what it already found.

Results are kept per device kind (JAX's ``device_kind``; a cluster may mix H100, A100
and CPU nodes): every case, task and failure records the kind it ran on. Given a
``probe`` (the face hands in ``bench.probe.device_report``: fuzz does not import
bench), the first worker of each kind runs it before any task, and the corpus keeps the
result (``probes/``); where it finds the tolerance model's assumptions do not hold on
that kind (``oracles.device_arithmetic``), the campaign says so and runs only the checks
that need no bound there (``check_kinds.UNBOUNDED``), so that the model's failure is
never booked as the kernel's.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from pallascheck.fuzz import bandit, import_path, plan, targets
from pallascheck.fuzz.cluster import Cluster, RemoteWorker
from pallascheck.fuzz.corpus import (
    CASES,
    EVENTS,
    FAILURES,
    Corpus,
    crash_pattern,
    signature,
)
from pallascheck.fuzz.workers import Death, Probe, Task, Worker, failed_dir
from pallascheck.kernels.backends import Backend
from pallascheck.oracles import device_arithmetic
from pallascheck.oracles.device_arithmetic import DeviceArithmetic
from pallascheck.properties import check_kinds, watchdog
from pallascheck.properties.spec import Case

STATE_VERSION = 1
EXPLORE_EVERY = 2  # in a targeted campaign, one task in this many draws without climbing
# How long past its time a campaign waits for the tasks in flight. A task that found a
# failure shrinks it, and on a GPU one shrink ran past five minutes (`fuzz --minutes
# 8` went on to 541 s); a task still running then is stopped and its failures booked
# from the cases it saved, unminimised (``Campaign.salvage``). A minute covers a
# production case's first compile (about 15 s on an H100) and its checks.
OVERRUN_S = 60.0


@dataclasses.dataclass
class DeviceTally:
    """What a run did on one device kind."""

    tasks: int = 0
    cases: int = 0
    new_failures: int = 0
    best_budget: float = 0.0  # the largest budget used by a case's worst check


@dataclasses.dataclass
class CampaignResult:
    tasks: int = 0
    cases: int = 0
    seconds: float = 0.0
    new_failures: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    repeats: int = 0  # findings whose signature the corpus already had
    first_failure_seconds: float | None = None  # from this run's start
    interrupted: bool = False
    stopped_in_flight: int = 0  # tasks still running OVERRUN_S after the time given, stopped
    requeued: int = 0  # tasks whose cluster node left while they ran, run again elsewhere
    never_tried: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (kernel, dtype) with no task
    devices: dict[str, DeviceTally] = dataclasses.field(default_factory=dict)  # by device kind
    probed: list[str] = dataclasses.field(default_factory=list)  # device kinds probed in this run
    # each device kind's arithmetic (from its probe, this run's or the corpus's), for the
    # kinds this run's workers ran on
    arithmetic: dict[str, DeviceArithmetic] = dataclasses.field(default_factory=dict)

    def device(self, kind: str | None) -> DeviceTally:
        return self.devices.setdefault(kind or "unknown", DeviceTally())

    def count(self, found: list[dict[str, Any]], seconds: float) -> None:
        """Count the failures a task booked, ``seconds`` into this run."""
        for failure in found:
            if failure["new"]:
                self.device(failure.get("device_kind")).new_failures += 1
                self.new_failures.append(failure)
                if self.first_failure_seconds is None:
                    self.first_failure_seconds = seconds
            else:
                self.repeats += 1


@dataclasses.dataclass
class Limits:
    """Per-case limits: seconds without progress (a hang) and resident bytes (out of memory)."""

    case_timeout: float = watchdog.CASE_TIMEOUT_S
    memory_bytes: int = 8 * 2**30


class Campaign:
    def __init__(
        self,
        targets_: Sequence[str],
        backend: Backend,
        corpus: str,
        *,
        examples: int,
        targeted: bool,
        dtypes: Sequence[str] | None,
        paths: Sequence[str],
        first_seed: int,
        resume: bool,
        shapes: str = "small",
        layout_cases: int | None = None,
    ):
        import_path.add_paths(paths)
        targets.check_names(targets_)  # before the corpus directory is created
        self.corpus = Corpus(corpus)
        saved = self.corpus.load_state()
        if saved is not None and not resume:
            raise ValueError(
                f"corpus {corpus!r} already holds a campaign: pass --resume to continue it, or choose another --corpus"
            )
        if saved is not None and saved["backend"] != str(backend):
            raise ValueError(
                f"corpus {corpus!r} was fuzzed on {saved['backend']}, not {backend}: "
                f"resume it there, or choose another --corpus"
            )
        self.backend = backend
        state = saved or {}  # what a resumed campaign had; the arguments given take precedence
        self.paths = list(paths) or state.get("paths", [])
        import_path.add_paths(self.paths)
        names = list(targets_) or state.get("targets", [])
        if not names:
            raise ValueError("no kernel to fuzz: name one with --kernel")
        self.targets = names
        wanted = list(dtypes or ()) or state.get("dtypes", [])
        self.dtypes = wanted
        self.pairs = [
            (name, d) for name in names for d in targets.resolve(name).dtypes_for(backend) if not wanted or d in wanted
        ]
        if not self.pairs:
            raise ValueError("no (kernel, dtype) pair to fuzz: check --kernel and --dtype")
        self.examples = examples
        self.shapes = state.get("shapes", shapes)
        untiered = [n for n in names if targets.resolve(n).production is None] if self.shapes == "production" else []
        if untiered:
            raise ValueError(
                f"no production shape tier: {', '.join(untiered)} (leave them out, or fuzz them at --shapes small)"
            )
        # cases per compiled layout: the one given, else the saved campaign's, else the tier's
        self.layout_cases = layout_cases if layout_cases is not None else state.get("layout_cases")
        self.targeted = targeted
        self.rng = random.Random(first_seed)
        self.bandit = bandit.Bandit(self.pairs, self.rng)
        self.retired_checks: dict[tuple[str, str], list[str]] = {}
        self.retired: set[tuple[str, str]] = set()
        self.seed = first_seed
        self.tasks_started: collections.Counter[tuple[str, str]] = collections.Counter()
        self.seconds_before = 0.0
        self.started = time.time()
        self.requeued: list[Task] = []  # tasks whose node left: the next to start, as they were
        if saved is not None:
            self.bandit.restore(saved["bandit"])
            self.retired_checks = {tuple(p): c for p, c in saved["retired_checks"]}
            self.retired = {tuple(p) for p in saved["retired"]}
            self.seed = saved["next_seed"]
            self.seconds_before = saved["seconds"]
            self.started = saved["started"]
        self.cases = state.get("cases", 0)
        # Distinct failures by kind, kept here for the progress line (read once, on resume).
        self.failure_kinds = collections.Counter(f["kind"] for f in self.corpus.failures().values())
        # each device kind's arithmetic, from the probes the corpus kept (earlier runs')
        self.devices = {
            kind: device_arithmetic.from_probe(backend, kind, report) for kind, report in self.corpus.probes().items()
        }
        self.run_start = time.monotonic()

    # -- state -------------------------------------------------------------------
    def elapsed(self) -> float:
        """Campaign seconds, over every run of it."""
        return self.seconds_before + time.monotonic() - self.run_start

    def save(self) -> None:
        import jax

        arms = [dict(row, retired=(row["kernel"], row["dtype"]) in self.retired) for row in self.bandit.arms()]
        self.corpus.save_state(
            {
                "version": STATE_VERSION,
                "backend": str(self.backend),
                "jax": jax.__version__,
                "started": self.started,
                "seconds": self.elapsed(),
                "targeted": self.targeted,
                "targets": self.targets,
                "dtypes": self.dtypes,
                "paths": self.paths,
                "examples": self.examples,
                "shapes": self.shapes,
                "layout_cases": self.layout_cases,
                "next_seed": self.seed,
                "cases": self.cases,
                "arms": arms,
                "bandit": self.bandit.state(),
                "retired": [list(p) for p in sorted(self.retired)],
                "retired_checks": [[list(p), c] for p, c in sorted(self.retired_checks.items())],
            }
        )

    def open_pairs(self) -> list[tuple[str, str]]:
        return [p for p in self.pairs if p not in self.retired]

    # -- device kinds --------------------------------------------------------------
    def probed(self, device_kind: str, report: dict[str, Any]) -> DeviceArithmetic:
        """Keep the probe of ``device_kind`` and take its arithmetic from it."""
        self.corpus.save_probe(device_kind, report)
        self.devices[device_kind] = device_arithmetic.from_probe(self.backend, device_kind, report)
        return self.devices[device_kind]

    def probe_failed(self, device_kind: str, why: str) -> DeviceArithmetic:
        """The probe of ``device_kind`` died (``why``): its arithmetic is unknown for this
        run, and is not kept, so that the next campaign probes again."""
        self.devices[device_kind] = device_arithmetic.from_probe(self.backend, device_kind, {"failed": why})
        return self.devices[device_kind]

    def checks_on(self, device_kind: str | None) -> tuple[str, ...]:
        """The checks a task may run on ``device_kind``: all, or where its probe found the
        tolerance model does not hold, those that need no bound."""
        known = self.devices.get(device_kind) if device_kind is not None else None
        return check_kinds.CHECKS if known is None or known.modelled else check_kinds.UNBOUNDED

    # -- tasks -------------------------------------------------------------------
    def next_task(self, device_kind: str | None = None) -> Task | None:
        """The next task for a worker on ``device_kind`` (None: any), None if none is left for it."""
        allowed = self.checks_on(device_kind)

        def unretired(pair: tuple[str, str]) -> tuple[str, ...]:
            return tuple(c for c in allowed if c not in self.retired_checks.get(pair, ()))

        pairs = [p for p in self.open_pairs() if unretired(p)]
        if not pairs:
            return None
        for task in list(self.requeued):
            checks = tuple(c for c in task.checks if c in allowed)
            if (task.target, task.dtype) not in self.open_pairs():  # retired while it waited
                self.requeued.remove(task)
            elif checks:
                self.requeued.remove(task)
                return dataclasses.replace(task, checks=checks)
        # Every EXPLORE_EVERY-th task of a targeted campaign draws plainly (the pair is
        # still the bandit's): climbing narrows Hypothesis' draws toward what scored
        # well, and a bug that needs a rare draw (an empty group) rather than a high
        # budget is found by diversity.
        climb = self.targeted and self.seed % EXPLORE_EVERY != 0
        if self.targeted:
            pair, kind, slot = self.bandit.choose(pairs)
            kind, slot = (kind, slot) if climb else ("any", None)
        else:
            # Untargeted runs serve the pairs in turn (the least-served first, ties drawn), so a
            # soak's cases per kernel x dtype come out even instead of as a uniform draw's spread.
            fewest = min(self.tasks_started[p] for p in pairs)
            pair, kind, slot = self.rng.choice([p for p in pairs if self.tasks_started[p] == fewest]), "any", None
        self.tasks_started[pair] += 1
        checks = unretired(pair)
        self.seed += 1
        return Task(
            pair[0], pair[1], kind, slot, self.seed, self.examples, checks, climb, self.shapes, self.layout_cases
        )

    def finish(self, task: Task, result: dict[str, Any]) -> list[dict[str, Any]]:
        """Book a finished task; returns the records of the failures it found, each
        under its own check."""
        pair = (task.target, task.dtype)
        self.bandit.learn(pair, result["kinds"], result["configs"])
        self.bandit.update(pair, task.kind, task.slot, bandit.reward(result["budgets"]))
        found = []
        device = result.get("device_kind")
        for failure in result["failures"]:
            check = failure["check"]
            self.retire(pair, check)
            if check == "crash":
                pattern = crash_pattern(failure["message"].split("\n", 1)[-1])
            else:
                pattern = failure["pattern"] or "-"
            found.append(
                self.record(
                    task,
                    "value" if check != "crash" else "crash",
                    check,
                    pattern,
                    failure["message"],
                    failure["case"],
                    minimised=True,
                    worst=failure["worst"],
                    budget=failure["budget"],
                    device_kind=device,
                )
            )
        self.log_task(
            task,
            result["cases"],
            result["budgets"],
            found,
            node=result.get("node"),
            device_kind=device,
            stopped=result.get("stopped", ""),
        )
        return found

    def retire(self, pair: tuple[str, str], check: str) -> None:
        """A failure found by ``check`` is not hunted again for ``pair``: a crash
        retires the pair, a failing check retires that check (and the pair once every
        check has failed)."""
        if check == "crash":
            self.retired.add(pair)
            return
        retired = self.retired_checks.setdefault(pair, [])
        retired += [check] if check not in retired else []
        if not set(check_kinds.CHECKS) - set(retired):
            self.retired.add(pair)

    def requeue(self, task: Task) -> None:
        """Run ``task`` again: the machine it ran on left, which says nothing about the
        kernel. What its cases reported before is kept (cases.jsonl)."""
        self.requeued.append(task)

    def died(self, task: Task, death: Death, device_kind: str | None = None) -> dict[str, Any]:
        """Book a task whose worker (on ``device_kind``) was lost: its in-flight case is the reproducer."""
        self.retired.add((task.target, task.dtype))
        case_path = None
        if death.inflight is not None:
            case = Case.load(death.inflight)
            meta = dict(case.params["__failure__"], check=death.kind, message=death.message)
            case_path = death.inflight + f".{death.kind}.npz"
            Case(case.arrays, {**case.params, "__failure__": meta}).save(case_path)
        found = self.record(
            task, death.kind, death.kind, "-", death.message, case_path, minimised=False, device_kind=device_kind
        )
        self.log_task(task, 0, {}, [found], node=death.node, device_kind=device_kind)
        return found

    def salvage(self, task: Task, failed_dir: str, device_kind: str | None = None) -> list[dict[str, Any]]:
        """Book the failures a task stopped in flight had saved under ``failed_dir``
        (runner.save_failure: while Hypothesis shrinks, the smallest failing case so
        far), unminimised; the task's other cases are booked already."""
        found = []
        for name in sorted(os.listdir(failed_dir)) if os.path.isdir(failed_dir) else []:
            path = os.path.join(failed_dir, name)
            try:
                meta = Case.load(path).params["__failure__"]
            except Exception:  # noqa: BLE001 - a case cut off mid-write by the kill: nothing to replay
                continue
            kind = "crash" if meta["check"] == "crash" else "value"
            self.retire((task.target, task.dtype), meta["check"])
            found.append(
                self.record(
                    task, kind, meta["check"], "-", meta["message"], path, minimised=False, device_kind=device_kind
                )
            )
        if found:
            self.log_task(task, 0, {}, found, device_kind=device_kind)
        return found

    def record(
        self,
        task: Task,
        kind: str,
        check: str,
        pattern: str,
        message: str,
        case_path: str | None,
        *,
        minimised: bool,
        worst: dict[str, Any] | None = None,
        budget: float | None = None,
        device_kind: str | None = None,
    ) -> dict[str, Any]:
        """Keep one failure in the corpus. ``worst``: where the failing check's budget
        was used most (output, index, shape, error, bound); ``budget``: error / bound
        there (None: infinite); ``device_kind``: the kind of device it was found on (the
        first finding's; events.jsonl has every one's)."""
        sig = signature(task.target, task.dtype, check, kind, pattern)
        case_file = self.corpus.file(FAILURES, sig, "case.npz")
        paths = "".join(f" --path {p}" for p in self.paths)
        record = {
            "signature": sig,
            "kernel": task.target,
            "dtype": task.dtype,
            "check": check,
            "kind": kind,
            "pattern": pattern,
            "message": message,
            "backend": str(self.backend),
            "device_kind": device_kind,
            "seed": task.seed,
            "input_kind": task.kind,
            "config_slot": task.slot,
            "first_seen_t": round(self.elapsed(), 2),
            "minimised": minimised,
            "worst": worst,
            "budget": budget,
            "replay": f"pallascheck replay {case_file}{paths}"
            if case_path
            else f"pallascheck fuzz --kernel {task.target} --dtype {task.dtype} --seed {task.seed - 1}{paths} "
            f"(no case was in flight: the task died while drawing or compiling)",
        }
        if case_path:
            case = Case.load(case_path)
            record["shapes"] = {k: list(v.shape) for k, v in case.arrays.items()}
            record["config"] = case.params["__failure__"]["config"]
        stored, new = self.corpus.record_failure(record, case_path)
        stored["new"] = new
        self.failure_kinds[kind] += new
        return stored

    def log_task(
        self,
        task: Task,
        cases: int,
        budgets: dict[str, Any],
        found: list[dict[str, Any]],
        node: str | None = None,
        device_kind: str | None = None,
        stopped: str = "",
    ) -> None:
        """One line of events.jsonl; ``node``: the Ray node that ran the task (None on
        one machine); ``device_kind``: the kind of device it ran on; ``stopped``: why a
        task with no finding ended short (its outcome "stopped")."""
        self.corpus.append(
            EVENTS,
            {
                "t": round(self.elapsed(), 2),
                "kernel": task.target,
                "dtype": task.dtype,
                "kind": task.kind,
                "config_slot": task.slot,
                "seed": task.seed,
                "cases": cases,
                "best_budget": budgets,
                "outcome": found[0]["kind"] if found else "stopped" if stopped else "pass",
                "stopped": stopped,
                "signature": found[0]["signature"] if found else None,
                "signatures": [f["signature"] for f in found],
                "targeted": task.targeted,
                "checks": list(task.checks),
                "node": node,
                "device_kind": device_kind,
            },
        )
        self.save()


def run(
    targets_: Sequence[str],
    backend: Backend,
    corpus: str,
    *,
    seconds: float,
    examples: int = 8,
    jobs: int = 1,
    targeted: bool = True,
    dtypes: Sequence[str] | None = None,
    paths: Sequence[str] = (),
    first_seed: int = 0,
    resume: bool = False,
    limits: Limits = Limits(),
    stop_on_first: bool = False,
    progress: Callable[[str], None] | None = None,
    shapes: str = "small",
    layout_cases: int | None = None,
    tasks: int | None = None,
    cluster: Cluster | None = None,
    shared_database: str | None = None,
    probe: Callable[[Backend], dict[str, Any]] | None = None,
    notify: Callable[[str], None] | None = None,
) -> CampaignResult:
    """Fuzz ``targets_`` (see ``targets``) on ``backend`` for about ``seconds`` with
    ``jobs`` worker processes; ``examples`` Hypothesis examples per task, drawn from
    the ``shapes`` tier, each checking ``layout_cases`` cases of one compiled layout
    (None: ``runner.layout_cases``). ``stop_on_first``: stop at the first failure
    (time-to-first-failure measurements). ``tasks``: start no more than this many tasks
    (a run bounded by work, not by the clock; ``seconds`` still ends it). ``cluster``:
    run the workers on that Ray cluster (``cluster.connect``) instead of as processes of
    this machine; ``shared_database``: a Redis URL, Hypothesis' example database shared
    by every worker (``workers.example_database``). ``probe``: a module-level function
    (it reaches the workers by name) that measures the backend's arithmetic where it runs
    (``bench.probe.device_report``), run once per device kind the corpus has no probe
    of, before that kind's first task (None: none is run; the kinds the corpus has probes
    of still use them); ``notify``: told, in one line, what each new probe found."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    if examples < 1:
        raise ValueError(f"examples must be >= 1, got {examples!r}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs!r}")
    if layout_cases is not None and layout_cases < 1:
        raise ValueError(f"cases per layout (--cases) must be >= 1, got {layout_cases!r}")
    if tasks is not None and tasks < 1:
        raise ValueError(f"tasks (--tasks) must be >= 1, got {tasks!r}")
    campaign = Campaign(
        targets_,
        backend,
        corpus,
        examples=examples,
        targeted=targeted,
        dtypes=dtypes,
        paths=paths,
        first_seed=first_seed,
        resume=resume,
        shapes=shapes,
        layout_cases=layout_cases,
    )
    result = CampaignResult()
    # absolute: a cluster's workers start in other directories
    setup = {
        "backend": str(backend),
        "paths": [os.path.abspath(p) for p in campaign.paths],
        "database": os.path.abspath(campaign.corpus.database),
        "shared_database": shared_database,
        "probe": probe,
    }
    gpus = plan.worker_gpus(backend) if cluster is None else []

    def new_worker(i: int) -> Worker | RemoteWorker:
        if cluster is not None:
            return RemoteWorker(i, campaign.corpus.worker_dir(i), setup, cluster)
        return Worker(i, campaign.corpus.worker_dir(i), dict(setup, device=gpus[i % len(gpus)] if gpus else None))

    workers = [new_worker(i) for i in range(jobs)]
    deadline = time.monotonic() + seconds
    best = (0.0, "")
    last_progress = 0.0
    started = 0
    device_kinds: dict[int, str] = {}  # each worker slot's, from its "ready"
    probing: set[str] = set()  # device kinds whose probe is running
    campaign.save()

    def probed(found: DeviceArithmetic) -> None:
        if notify is not None:
            notify(f"probe of {found.line()}")

    try:
        while True:
            busy = False
            for i, worker in enumerate(workers):
                task = worker.task
                messages, death = worker.poll(limits.case_timeout, limits.memory_bytes)
                found = []
                for kind, payload in messages:
                    if kind == "ready":
                        device_kinds[i] = payload["device_kind"]
                    elif kind == "checked":
                        campaign.corpus.append(CASES, dict(payload, t=round(campaign.elapsed(), 2)))
                        campaign.cases += 1
                        result.cases += 1
                        used = max(
                            (
                                c["budget"] if c["budget"] is not None else float("inf")
                                for c in payload["checks"].values()
                            ),
                            default=0.0,
                        )
                        best = max(best, (used, f"{payload['kernel']} {payload['dtype']}"))
                        tally = result.device(payload["device_kind"])
                        tally.cases += 1
                        tally.best_budget = max(tally.best_budget, used)
                    elif kind == "done":
                        if not isinstance(task, Task):
                            raise RuntimeError(f"worker {i} reported a task done while it had none")
                        result.tasks += 1
                        result.device(payload["device_kind"]).tasks += 1
                        found = campaign.finish(task, payload)
                    elif kind == "probed":
                        if not isinstance(task, Probe):
                            raise RuntimeError(f"worker {i} reported a probe while it ran none")
                        probing.discard(task.device_kind)
                        result.probed.append(task.device_kind)
                        probed(campaign.probed(task.device_kind, payload))
                if death is not None:
                    if isinstance(task, Probe):
                        probing.discard(task.device_kind)  # lost with its node: the next worker of its kind probes
                        if death.kind != "lost":
                            probed(campaign.probe_failed(task.device_kind, death.message))
                    elif task is not None and death.kind == "lost":
                        campaign.requeue(task)
                        result.requeued += 1
                        started -= 1  # it starts again, and counts once against ``tasks``
                    elif task is not None:
                        result.tasks += 1
                        result.device(device_kinds.get(i)).tasks += 1
                        found = [campaign.died(task, death, device_kinds.get(i))]
                    workers[i] = worker = new_worker(i)
                    device_kinds.pop(i, None)
                result.count(found, time.monotonic() - campaign.run_start)
                # At least one task runs, however short the time given.
                stop = (
                    (stop_on_first and result.new_failures)
                    or (time.monotonic() >= deadline and started)
                    or (tasks is not None and started >= tasks)
                )
                device = device_kinds.get(i)
                if worker.task is None and worker.ready and not stop and device is not None:
                    if probe is not None and device not in campaign.devices:
                        if device not in probing:  # one worker of a kind probes; the others wait for it
                            probing.add(device)
                            worker.start(Probe(device))
                    elif (task := campaign.next_task(device)) is not None:
                        worker.start(task)
                        started += 1
                busy |= worker.task is not None
            if progress is not None and time.monotonic() - last_progress >= 1.0:
                last_progress = time.monotonic()
                progress(_progress_line(campaign, result, best, deadline))
            if (stop_on_first and result.new_failures) or (
                not busy
                and (
                    (time.monotonic() >= deadline and started)
                    or not campaign.open_pairs()
                    or (tasks is not None and started >= tasks)
                )
            ):
                break
            if busy and time.monotonic() >= deadline + OVERRUN_S:
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        # Every idle worker is asked first and all get one 5 s wait together: one at a
        # time, the waits add up (12 workers, up to a minute past OVERRUN_S; a GPU soak
        # was still ending 15 s past it when its outer timeout stopped it).
        idle = [worker for worker in workers if worker.task is None]
        for worker in idle:
            worker.request_stop()
        for worker in [worker for worker in workers if worker.task is not None]:
            in_flight = worker.task
            if in_flight is None:  # the list holds the workers with a task
                raise RuntimeError(f"worker {worker.index} has no task in flight")
            worker.kill()  # a task in flight is stopped, not what it found
            if isinstance(in_flight, Probe):  # nothing kept: the next campaign probes that kind
                continue
            result.stopped_in_flight += 1
            result.count(
                campaign.salvage(in_flight, failed_dir(worker.inflight), device_kinds.get(worker.index)),
                time.monotonic() - campaign.run_start,
            )
        deadline = time.monotonic() + 5.0
        for worker in idle:
            worker.wait(deadline)
        result.seconds = time.monotonic() - campaign.run_start
        result.never_tried = [p for p in campaign.pairs if not campaign.tasks_started[p]]
        result.arithmetic = {
            k: a for k, a in campaign.devices.items() if k in set(device_kinds.values()) | set(result.devices)
        }
        campaign.save()
        campaign.corpus.close()
    return result


def _progress_line(campaign: Campaign, result: CampaignResult, best: tuple[float, str], deadline: float) -> str:
    elapsed = time.monotonic() - campaign.run_start
    found = ", ".join(f"{k} {n}" for k, n in sorted(campaign.failure_kinds.items()) if n)
    # a case over its budget is a failure its task books once it has shrunk it, which can
    # outlast the campaign's minutes at a GPU's 64 cases a layout: never "none" beside it
    found = found or ("none booked yet, one being shrunk" if best[0] > 1 else "none")
    reached = sum(1 for p in campaign.pairs if campaign.tasks_started[p])
    return (
        f"[{elapsed:6.0f} s, {max(0.0, deadline - time.monotonic()):.0f} s left] {result.cases} cases "
        f"({result.cases / max(elapsed, 1e-9):.2f}/s), {result.tasks} tasks, best budget used {best[0]:.3g} "
        f"({best[1] or '-'}), failures: {found}, {reached}/{len(campaign.pairs)} kernel x dtype pairs tried, "
        f"{len(campaign.open_pairs())} open"
    )
