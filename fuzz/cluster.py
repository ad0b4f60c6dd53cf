"""Workers on a Ray cluster: the same tasks as on one machine (a campaign's, verify's
units, mutate's mutants), each run by a worker process on whichever node Ray places it.

Each worker slot is a Ray actor (``Supervisor``) that asks for one CPU core (the
interpreter backends) or one GPU (Ray then shows it only that GPU), placed by Ray on
any node with that resource free; how many and what each asks for is run planning
(``plan.cluster_slots``). The actor runs a ``workers.Worker`` on its own node, with
the ``run`` function and setup its command gives (a campaign's by default), so
that hang, crash and out-of-memory detection are what they are on one machine and a
kernel that kills its process kills only that worker, not the actor that reports it.
The driver (``RemoteWorker``, the same interface as ``Worker``) polls each actor,
and the actor ships back what the driver must keep: the case in flight, the cases a
finished task failed on, the cases a task stopped in flight had saved. The campaign's
state and corpus stay on the driver's disk, written after every task as on one
machine.

Three ways a slot is lost, told apart by who saw it:
- the worker process died, hung or passed its memory limit: its actor saw it on the
  node and reports it with the case in flight (a crash, hang or oom finding);
- the actor died and its node is alive: Ray killed it (its memory monitor: an oom
  finding; anything else: a crash) with the last case in flight the driver holds;
- the actor died with its node, or stopped answering for ``case_timeout`` seconds:
  the node, not the kernel, is gone, and the task is run again elsewhere ("lost").

Ray is imported inside functions: it is an optional dependency (the ``cluster``
extra), needed only with ``--cluster``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any

from pallascheck.fuzz import plan
from pallascheck.fuzz.workers import FINISHED, Death, TaskRunner, Worker, failed_dir, saved_files
from pallascheck.kernels.backends import Backend

# The case in flight is shipped to the driver with each poll so that it outlives an
# actor Ray kills; a larger one (a production case) only with the actor's own report,
# so that a soak does not copy every production input across the network.
SHIP_INFLIGHT_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A connected Ray cluster: where a campaign's ``slots`` workers run, each asking
    for ``resources`` (Ray actor options)."""

    address: str
    slots: int
    resources: dict[str, float]
    nodes: int


def connect(address: str, backend: Backend) -> Cluster:
    """Join the Ray cluster at ``address`` ("local": start one on this machine) and
    plan the campaign's workers over it."""
    if not address:
        raise ValueError("--cluster needs an address (host:port of the Ray head) or 'local'")
    try:
        import ray
    except ImportError:
        raise ValueError("--cluster needs Ray: pip install 'pallascheck[cluster]' (docs/cluster.md)") from None
    if not ray.is_initialized():
        # The workers' output goes to Ray's log files on each node, not into the
        # campaign's progress line.
        options: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
        if address == "local":
            ray.init(include_dashboard=False, **options)
        else:
            ray.init(address=address, **options)
    slots, resources = plan.cluster_slots(backend, ray.cluster_resources())
    nodes = sum(1 for n in ray.nodes() if n["Alive"])
    return Cluster(address, slots, resources, nodes)


def disconnect() -> None:
    import ray

    ray.shutdown()


def _read(path: str | None) -> bytes | None:
    if path is None or not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return f.read()


WORKER_DIR_PREFIX = "pallascheck-worker-"


def worker_directory() -> str:
    """A new temporary directory for this process's worker slot, named by its pid, after
    removing those of worker processes on this machine that are gone: an actor killed
    with its node, its driver or by Ray's memory monitor never reaches ``stop``, which
    removes its own."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        owner = re.fullmatch(rf"{WORKER_DIR_PREFIX}(\d+)-\w+", name)
        if owner and not _alive(int(owner.group(1))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{WORKER_DIR_PREFIX}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Supervisor:
    """The Ray actor of one worker slot: runs one ``Worker`` (its tasks run by ``run``,
    None: a campaign's) on its node and reports what the worker says, with the files
    the driver keeps as bytes."""

    def __init__(self, setup: dict[str, Any], run: TaskRunner | None = None):
        import ray

        self.directory = worker_directory()
        # A campaign's example database: the corpus's where this node sees it (the
        # driver's machine, a shared filesystem), else one on the node; the shared
        # database (Redis) joins them all.
        database = setup.get("database")
        if database is not None and not os.path.isdir(os.path.dirname(database)):
            database = os.path.join(self.directory, "hypothesis")
        self.worker = Worker(0, self.directory, dict(setup, database=database, device=None), run=run)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.shipped: float | None = None  # mtime of the in-flight case last shipped

    def where(self) -> tuple[str, str]:
        """(node id, node address): answers once the actor has started."""
        return self.node_id, self.node_ip

    def start(self, task: Any) -> None:
        self.shipped = None
        self.worker.start(task)

    def poll(self, case_timeout: float, memory_bytes: int) -> dict[str, Any]:
        messages, death = self.worker.poll(case_timeout, memory_bytes)
        for kind, payload in messages:
            if kind == "done":
                payload["node"] = self.node_id  # events.jsonl says where each task ran
                for failure in payload.get("failures", ()):  # a campaign task's, saved on the node
                    failure["case"] = _read(failure["case"])
        inflight = None
        if self.worker.in_case and os.path.exists(self.worker.inflight):
            mtime = os.stat(self.worker.inflight).st_mtime
            if mtime != self.shipped and os.path.getsize(self.worker.inflight) <= SHIP_INFLIGHT_BYTES:
                inflight, self.shipped = _read(self.worker.inflight), mtime
        return {
            "messages": messages,
            "ready": self.worker.ready,
            "inflight": inflight,
            "death": None if death is None else (death.kind, death.message, _read(death.inflight)),
        }

    def saved_failures(self) -> dict[str, bytes]:
        """The cases the running task has saved (``campaign.salvage`` books them)."""
        return saved_files(self.worker.inflight)

    def stop(self) -> None:
        self.worker.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


class RemoteWorker:
    """The driver's side of one worker slot on the cluster, with ``Worker``'s
    interface: ``start``, ``poll``, ``kill``, ``request_stop``, ``wait``, ``stop``,
    ``exited``; ``run`` and ``setup`` are the node's ``Worker``'s. Files the actor
    ships land under ``directory`` on the driver."""

    def __init__(
        self, index: int, directory: str, setup: dict[str, Any], cluster: Cluster, run: TaskRunner | None = None
    ):
        import ray

        self.index = index
        self.inflight = os.path.join(directory, "inflight.npz")
        # Any: Ray's stubs type a remote class's handle as the class itself
        actor_class: Any = ray.remote(Supervisor)
        self.actor = actor_class.options(max_restarts=0, **cluster.resources).remote(setup, run)
        self.placed = self.actor.where.remote()  # resolves once Ray has placed and started the actor
        self.node: tuple[str, str] | None = None
        self.task: Any = None  # what ``run`` is running (a campaign's Task, a verify Unit)
        self.ready = False
        self.in_case = False
        self.asked: Any = None  # the poll in flight
        self.stopping: Any = None  # the stop asked for by ``request_stop``
        self.last_answer = time.monotonic()

    def start(self, task: Any) -> None:
        if os.path.exists(self.inflight):
            os.remove(self.inflight)
        shutil.rmtree(failed_dir(self.inflight), ignore_errors=True)  # what an earlier task's kill fetched
        self.task, self.in_case = task, False
        self.actor.start.remote(task)  # runs before the next poll: one caller's calls keep their order

    def poll(self, case_timeout: float, memory_bytes: int) -> tuple[list[tuple[str, Any]], Death | None]:
        import ray

        # OutOfMemoryError: Ray's memory monitor killed the actor while this poll was in flight
        from ray.exceptions import ActorUnavailableError, OutOfMemoryError, RayActorError

        if self.node is None:
            # An actor Ray has not placed yet waits for a free slot (a node that left
            # takes its slots with it): not a hang.
            if not ray.wait([self.placed], timeout=0)[0]:
                return [], None
            try:
                self.node = ray.get(self.placed)
            except RayActorError as err:
                if err.actor_init_failed:  # a node that cannot start a worker would take every new one
                    raise RuntimeError(f"a worker could not start on a node of the cluster (docs/cluster.md): {err}")
                return [], self._lost(err)
            self.last_answer = time.monotonic()
        if self.asked is None:
            self.asked = self.actor.poll.remote(case_timeout, memory_bytes)
        if not ray.wait([self.asked], timeout=0)[0]:
            silent = time.monotonic() - self.last_answer
            if silent > case_timeout:  # the actor's node stopped answering: it is gone
                self.kill()
                return [], Death("lost", f"node {self.node_label} did not answer for {silent:.0f} s", None)
            return [], None
        try:
            reply = ray.get(self.asked)
        except ActorUnavailableError:  # a node that may come back: ask again
            self.asked = None
            return [], None
        except (RayActorError, OutOfMemoryError) as err:
            return [], self._lost(err)
        self.asked, self.last_answer = None, time.monotonic()
        self.ready = reply["ready"]
        if reply["inflight"] is not None:
            self._write(self.inflight, reply["inflight"])
        messages = []
        for kind, payload in reply["messages"]:
            self.in_case = kind == "case"
            if kind in FINISHED:
                self.task = None
                for n, failure in enumerate(payload.get("failures", ())):
                    failure["case"] = self._keep(f"done-{n}.npz", failure["case"])
            messages.append((kind, payload))
        death = None
        if reply["death"] is not None:
            kind, message, case = reply["death"]
            death = Death(
                kind, f"{message} on node {self.node_label}", self._keep("inflight-lost.npz", case), self._node_id
            )
            self.kill()
        return messages, death

    def _lost(self, err: Exception) -> Death:
        """The actor died: the node's, Ray's memory monitor's or another kill (module docstring)."""
        import ray

        self.kill()
        text = str(err)
        node_alive = self.node is not None and any(n["NodeID"] == self.node[0] and n["Alive"] for n in ray.nodes())
        if not node_alive:
            return Death("lost", f"node {self.node_label} left the cluster while running {self.task}", None)
        inflight = self.inflight if self.in_case and os.path.exists(self.inflight) else None
        if "memory pressure" in text or "low on memory" in text:
            return Death(
                "oom",
                f"Ray's memory monitor killed the worker on node {self.node_label}: {text}",
                inflight,
                self._node_id,
            )
        return Death("crash", f"the worker's actor on node {self.node_label} died: {text}", inflight, self._node_id)

    @property
    def _node_id(self) -> str | None:
        return self.node[0] if self.node else None

    @property
    def node_label(self) -> str:
        """Its node, as the messages name it: address (the start of Ray's node id)."""
        return f"{self.node[1]} ({self.node[0][:12]})" if self.node else "(not placed)"

    def _write(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)

    def _keep(self, name: str, data: bytes | None) -> str | None:
        if data is None:
            return None
        path = os.path.join(os.path.dirname(self.inflight), name)
        self._write(path, data)
        return path

    def kill(self) -> None:
        """Stop the actor (and with it its worker), first fetching the cases a task in
        flight had saved, for ``campaign.salvage``."""
        import ray
        from ray.exceptions import GetTimeoutError, OutOfMemoryError, RayActorError

        if self.task is not None and self.node is not None:
            try:
                saved = ray.get(self.actor.saved_failures.remote(), timeout=10)
            except (RayActorError, OutOfMemoryError, GetTimeoutError):  # a dead actor's calls raise how it died
                saved = {}
            for name, data in saved.items():
                self._write(os.path.join(failed_dir(self.inflight), name), data)
        ray.kill(self.actor, no_restart=True)

    def request_stop(self) -> None:
        self.stopping = self.actor.stop.remote()

    def exited(self) -> bool:
        """Whether the actor asked to stop has stopped its worker (``wait`` then ends it at once)."""
        import ray

        return self.stopping is not None and bool(ray.wait([self.stopping], timeout=0)[0])

    def stop(self) -> None:
        """Ask an idle worker to stop; end its actor once it has, or after 15 s."""
        self.request_stop()
        self.wait(time.monotonic() + 15.0)

    def wait(self, deadline: float) -> None:
        import ray

        if self.stopping is not None:
            ray.wait([self.stopping], timeout=max(0.0, deadline - time.monotonic()))
        ray.kill(self.actor, no_restart=True)
