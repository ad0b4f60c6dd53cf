"""Worker processes for fuzz campaigns: a kernel that hangs, crashes the process or
eats memory costs a worker, not the campaign.

Each worker is a fresh interpreter (multiprocessing "spawn": no inherited JAX
state) that runs tasks, one Hypothesis run of one arm each, and reports over a pipe:

    ("ready", {"device_kind": kind})   imports done, waiting for a task; the kind of
                                       device it checks on (JAX's device_kind)
    ("case", None)                     a case was saved to the worker's in-flight
                                       file and is about to run
    ("checked", record)                that case's shapes, config and budgets
    ("done", result)                   the task finished (passed or a check failed)
    ("probed", report)                 the arithmetic probe asked for with ``Probe``
                                       finished (``setup["probe"]``'s JSON report)

The parent (``Pool``) watches each worker: no message for ``case_timeout`` seconds
while a case runs is a hang; a resident set above ``memory_bytes`` is out of memory;
a process that dies is a crash. In each of those the worker is killed, its in-flight
case becomes the reproducer, and a new worker takes its place.
"""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase, MultiplexedDatabase

from pallascheck.fuzz.corpus import worst_pattern

SHARED_KEY_PREFIX = b"pallascheck-examples:"  # beside other users of the same Redis


@dataclasses.dataclass(frozen=True)
class Task:
    """One worker run: ``examples`` Hypothesis examples of ``target`` in ``dtype``,
    aimed at input ``kind`` ("any": unpinned) and config ``slot`` (None: drawn)."""

    target: str
    dtype: str
    kind: str
    slot: int | None
    seed: int
    examples: int
    checks: tuple[str, ...]
    targeted: bool
    shapes: str = "small"  # the shape tier (runner.SHAPE_TIERS)
    cases: int | None = None  # cases per example (per compiled layout); None: the backend's and tier's


@dataclasses.dataclass(frozen=True)
class Probe:
    """Ask a worker to run the arithmetic probe (``setup["probe"]``, a module-level
    function of the backend) on its device, of kind ``device_kind``: a campaign does
    once per device kind (``oracles.device_arithmetic``)."""

    device_kind: str


# The messages after which a worker has no task in flight.
FINISHED = ("done", "probed")


@dataclasses.dataclass
class Death:
    """How a worker was lost: "hang", "oom" or "crash", with what is known; or "lost":
    the machine it ran on left (a cluster's node), and its task is run again."""

    kind: str
    message: str
    inflight: str | None  # the case it was running, saved as a replayable .npz
    node: str | None = None  # the Ray node it ran on (None on one machine)


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0


# What a worker does with a task: (task, pipe, in-flight file, setup) -> the "done"
# payload. The task is whatever its command sends (a campaign's ``Task``, a verify
# ``Unit``): a picklable value that ``run`` understands.
TaskRunner = Callable[[Any, Connection, str, dict[str, Any]], dict[str, Any]]


class Worker:
    """One worker process and the task it runs; ``run`` (a module-level function, so
    that it reaches the spawned process by name) runs each task, by default a fuzz
    campaign's Hypothesis run."""

    def __init__(self, index: int, directory: str, setup: dict[str, Any], run: TaskRunner | None = None):
        self.index = index
        self.inflight = os.path.join(directory, "inflight.npz")
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_main, args=(child, self.inflight, setup, run or _run), daemon=True)
        self.process.start()
        child.close()
        self.task: Any = None  # what ``run`` is running (see ``TaskRunner``)
        self.node: tuple[str, str] | None = None  # a cluster worker's (Ray node id, address); None: here
        self.last_message = time.monotonic()
        self.ready = False
        self.in_case = False

    def start(self, task: Any) -> None:
        if os.path.exists(self.inflight):
            os.remove(self.inflight)
        self.task = task
        self.last_message = time.monotonic()
        self.in_case = False
        self.conn.send(task)

    def poll(self, case_timeout: float, memory_bytes: int) -> tuple[list[tuple[str, Any]], Death | None]:
        """Messages received since the last poll, and a Death if the worker was lost
        (it is killed by then)."""
        messages: list[tuple[str, Any]] = []
        try:
            while self.conn.poll():
                kind, payload = self.conn.recv()
                self.last_message = time.monotonic()
                self.ready |= kind == "ready"
                self.in_case = kind == "case"
                if kind in FINISHED:
                    self.task = None
                messages.append((kind, payload))
        except (EOFError, OSError):
            pass
        death = self._death(case_timeout, memory_bytes)
        if death is not None:
            self.kill()
        return messages, death

    def _death(self, case_timeout: float, memory_bytes: int) -> Death | None:
        inflight = self.inflight if self.in_case and os.path.exists(self.inflight) else None
        if not self.process.is_alive():
            code = self.process.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
            return Death("crash", f"worker process {how} while running {self.task}", inflight)
        if self.process.pid is None:  # alive, so started
            raise RuntimeError("a live worker process has no pid")
        rss = _rss_bytes(self.process.pid)
        if rss > memory_bytes:
            return Death(
                "oom",
                f"worker resident memory {rss / 2**30:.2f} GiB passed the limit of "
                f"{memory_bytes / 2**30:.2f} GiB while running {self.task}",
                inflight,
            )
        # Before the first case of a task (imports, first draw) the worker gets the same time.
        silent = time.monotonic() - self.last_message
        if (self.task is not None or not self.ready) and silent > case_timeout:
            where = "a case" if self.in_case else "a task's start (drawing, compiling)"
            return Death(
                "hang",
                f"no progress for {silent:.0f} s (timeout {case_timeout:g} s) on {where} of {self.task}",
                inflight,
            )
        return None

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()

    def request_stop(self) -> None:
        """Ask an idle worker to exit (``stop`` waits for it)."""
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass

    def exited(self) -> bool:
        """Whether the process has ended (a worker asked to stop: ``wait`` then ends at once)."""
        return not self.process.is_alive()

    def wait(self, deadline: float) -> None:
        """Wait until ``deadline`` (``time.monotonic()``) for a worker asked to stop;
        kill it if it has not exited."""
        self.process.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def stop(self) -> None:
        """Ask an idle worker to exit; kill it if it has not within 5 s."""
        self.request_stop()
        self.wait(time.monotonic() + 5.0)


def failed_dir(inflight: str) -> str:
    """Where a worker's task saves its failing cases (runner.save_failure), beside the
    worker's in-flight case ``inflight``; emptied when a task starts."""
    return os.path.join(os.path.dirname(inflight), "failed")


def saved_files(inflight: str) -> dict[str, bytes]:
    """What the task beside ``inflight`` saved under ``failed_dir``, each file's bytes by
    name (what a cluster worker ships to the driver). A task still running may replace a
    file as it is listed: one gone by its read is left out."""
    directory = failed_dir(inflight)
    files = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        try:
            with open(os.path.join(directory, name), "rb") as f:
                files[name] = f.read()
        except FileNotFoundError:
            continue
    return files


def _main(conn: Connection, inflight: str, setup: dict[str, Any], run: TaskRunner) -> None:
    """The worker: import once, then run tasks until told to stop (None)."""
    import signal

    if sys.platform == "linux":
        # Die with the parent: a cluster node's actor killed with its node (or by Ray)
        # must not leave its worker running on, orphaned. PR_SET_PDEATHSIG is 1.
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)

    if setup.get("device") is not None:  # one GPU per worker, before JAX creates its client
        os.environ["CUDA_VISIBLE_DEVICES"] = setup["device"]

    from pallascheck.properties.device import compilation

    # Ctrl-C reaches the whole process group: the campaign stops its workers itself,
    # after it has booked what they found.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    from pallascheck.fuzz import import_path

    import_path.add_paths(setup["paths"])
    from pallascheck.kernels.backends import get_backend
    from pallascheck.properties.device import identity

    backend = get_backend(setup["backend"])
    compilation.configure(backend, worker=True)
    setup = dict(setup, device_kind=identity.device_kind(backend))
    conn.send(("ready", {"device_kind": setup["device_kind"]}))
    while (task := conn.recv()) is not None:
        if isinstance(task, Probe):
            conn.send(("probed", setup["probe"](backend)))
        else:
            conn.send(("done", run(task, conn, inflight, setup)))


def example_database(directory: str, shared: str | None) -> ExampleDatabase:
    """Hypothesis' example database of a worker: the directory (the corpus's, or its
    node's), and with ``shared`` (a Redis URL) every node's too, so that a failure
    found and shrunk on one node is replayed first on the others. The workers write
    to both; someone replaying a campaign's findings reads the shared one through
    ``ReadOnlyDatabase`` (docs/cluster.md)."""
    local = DirectoryBasedExampleDatabase(directory)
    if shared is None:
        return local
    import redis
    from hypothesis.extra.redis import RedisExampleDatabase

    return MultiplexedDatabase(local, RedisExampleDatabase(redis.Redis.from_url(shared), key_prefix=SHARED_KEY_PREFIX))


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or x != x or x in (float("inf"), float("-inf")) else float(x)


def _run(task: Task, conn: Connection, inflight: str, setup: dict[str, Any]) -> dict[str, Any]:
    from pallascheck.fuzz import targets
    from pallascheck.kernels.backends import get_backend
    from pallascheck.properties import runner, strategies
    from pallascheck.properties.spec import Case

    spec = targets.resolve(task.target)
    backend = get_backend(setup["backend"])
    config_counts = [0]
    failure_dir = failed_dir(inflight)

    def before(case: Case, config: Any) -> None:
        config_counts[0] = max(config_counts[0], len(list(spec.configs(case, backend))))
        meta = {
            "kernel": task.target,
            "dtype": task.dtype,
            "backend": str(backend),
            "check": "in flight",
            "config": runner.config_to_json(config),
            "message": "",
            "seed": task.seed,
        }
        Case(case.arrays, {**case.params, "__failure__": meta}).save(inflight)
        conn.send(("case", None))

    def after(case: Case, config: Any, tally: runner.Tally) -> None:
        conn.send(
            (
                "checked",
                {
                    "kernel": task.target,
                    "dtype": task.dtype,
                    "device_kind": setup["device_kind"],
                    "kind": task.kind,
                    "config": runner.config_to_json(config),
                    "shapes": {k: list(v.shape) for k, v in case.arrays.items()},
                    "checks": {
                        name: {
                            "budget": _finite_or_none(o.budget_used),
                            "error": _finite_or_none(o.worst.error) if o.worst else None,
                            "bound": _finite_or_none(o.worst.bound) if o.worst else None,
                        }
                        for name, o in tally.outcomes.items()
                    },
                },
            )
        )

    search = runner.Search(
        targeted=task.targeted,
        config_slot=task.slot,
        database=example_database(setup["database"], setup.get("shared_database")),
        database_key=f"{task.kind}/{task.slot}",
        before_case=before,
        after_case=after,
    )
    if os.path.isdir(failure_dir):
        for name in os.listdir(failure_dir):
            os.remove(os.path.join(failure_dir, name))
    with (
        strategies.recording_element_kinds() as kinds,
        strategies.pinned_element_kind(None if task.kind == "any" else task.kind),
    ):
        tally = runner.run_property(
            spec,
            task.dtype,
            backend,
            examples=task.examples,
            seed=task.seed,
            selected=task.checks,
            shrink=True,
            failure_dir=failure_dir,
            search=search,
            shapes=task.shapes,
            cases_per_layout=task.cases or runner.layout_cases(backend, task.shapes, campaign=True),
        )
    # Shrinking saves each failing attempt under its check; the last one written is the
    # minimal case. Each distinct failure (Hypothesis may report several) is its own record.
    failures = []
    for finding in tally.findings:
        case = runner.failure_path(failure_dir, spec.name, task.dtype, finding.check)
        worst = finding.outcome.worst if finding.outcome else None
        failures.append(
            {
                "check": finding.check,
                "message": finding.message,
                "pattern": worst_pattern(worst),
                "case": case if os.path.exists(case) else None,
                "budget": _finite_or_none(finding.outcome.budget_used) if finding.outcome else None,
                "worst": None
                if worst is None
                else {
                    "output": worst.name,
                    "index": list(worst.index),
                    "shape": list(worst.shape),
                    "error": _finite_or_none(worst.error),
                    "bound": _finite_or_none(worst.bound),
                },
            }
        )
    return {
        "failures": failures,
        "budgets": {name: _finite_or_none(o.budget_used) for name, o in tally.outcomes.items()},
        "cases": tally.outcomes["values"].examples if "values" in tally.outcomes else 0,
        "stopped": tally.stopped,  # why the task ended short with no finding ("": it did not)
        "kinds": sorted(kinds),
        "configs": config_counts[0],
        "device_kind": setup["device_kind"],
    }
