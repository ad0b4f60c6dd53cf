"""Campaigns on a Ray cluster (docs/cluster.md): a real cluster of three nodes on this
machine (``ray.cluster_utils.Cluster``, one CPU each) and a real Redis server on a
free loopback port. Findings of hangs, crashes and wrong values come back from the
nodes with their cases; a node removed mid-campaign costs no task and no finding; a
driver killed mid-campaign resumes losing at most its tasks in flight; a failure shrunk
on one node reaches every other through the shared example database.

Needs the ``cluster`` extra (Ray, redis-py) and Debian's redis-server, which `.ci/run`
installs; without them the tests skip, saying which is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pallascheck import cli
from pallascheck.bench import probe
from pallascheck.fuzz import campaign, cluster, corpus, workers
from pallascheck.kernels.backends import Backend
from pallascheck.properties.spec import Case

ray = pytest.importorskip("ray", reason="the cluster extra is not installed: pip install -e '.[cluster]'")
redis = pytest.importorskip("redis", reason="the cluster extra is not installed: pip install -e '.[cluster]'")
import fuzz_targets  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402  - after the skip above

TESTS = os.path.dirname(__file__)
BACKEND = Backend("interpret")
# A generous ceiling on waits for the cluster's own events (a worker's start, the actors
# of a killed driver released): the tests end on the events, never on the clock.
CEILING_S = 300


def _lines(path: Path) -> list[dict]:
    written = path.read_text().splitlines(keepends=True) if path.exists() else []
    return [json.loads(raw) for raw in written if raw.endswith("\n")]  # a line being written waits


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("Debian's redis-server is not installed (apt-get install -y redis-server; .ci/run does)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + CEILING_S
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert process.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.1)
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait(30)


@pytest.fixture(scope="module")
def three_nodes() -> Iterator[Cluster]:
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    yield nodes
    cluster.disconnect()
    nodes.shutdown()


def test_a_campaign_across_three_nodes_books_hangs_crashes_and_values_with_their_cases(
    tmp_path, three_nodes, redis_url
) -> None:
    joined = cluster.connect(three_nodes.address, BACKEND)
    assert (joined.slots, joined.resources, joined.nodes) == (3, {"num_cpus": 1}, 3)
    targets = [
        "fuzz_targets:SOUND",
        "fuzz_targets:HANGS",
        "fuzz_targets:ABORTS",
        "fuzz_targets:WRONG_WHEN_LONG",
    ]

    def stop_once_found(line: str) -> None:
        kinds = {f["kind"] for f in corpus.Corpus(str(tmp_path)).failures().values()}
        if kinds >= {"hang", "crash", "value"}:
            raise KeyboardInterrupt  # the campaign books what it has, then stops

    # 30 s: a worker's start and first compile with three workers on two cores, so only
    # HANGS is a hang; the hang costs that long.
    result = campaign.run(
        targets,
        BACKEND,
        str(tmp_path),
        seconds=CEILING_S,
        examples=2,
        jobs=joined.slots,
        paths=[TESTS],
        dtypes=["float32"],
        limits=campaign.Limits(case_timeout=30),
        progress=stop_once_found,
        cluster=joined,
        shared_database=redis_url,
        probe=probe.device_report,
    )
    stored = corpus.Corpus(str(tmp_path)).failures()
    kinds = {f["kernel"].split(":")[1]: f["kind"] for f in stored.values()}
    assert kinds["HANGS"] == "hang" and kinds["ABORTS"] == "crash" and kinds["WRONG_WHEN_LONG"] == "value", kinds
    # every finding once, under its own signature, its case on the driver's disk
    signatures = [f["signature"] for f in result.new_failures]
    assert sorted(signatures) == sorted(stored), (signatures, sorted(stored))
    for f in stored.values():
        case = Case.load(f["case"])
        assert case.params["__failure__"]["kernel"] == f["kernel"]
        if f["kind"] in ("hang", "crash"):  # the input in flight when the worker was lost, named by its node
            assert case.params["__failure__"]["check"] == f["kind"] and " on node " in f["message"], f
    # the tasks ran on every node, and each is booked once
    events = _lines(tmp_path / "events.jsonl")
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert {e["node"] for e in events if e["node"]} == alive
    assert len({e["seed"] for e in events}) == len(events)
    # one kind of device on the three nodes: probed once, before any task; every task,
    # case and finding says it ran there
    assert result.probed == ["cpu"] and list(corpus.probes(str(tmp_path))) == ["cpu"]
    assert {e["device_kind"] for e in events} == {"cpu"} and {f["device_kind"] for f in stored.values()} == {"cpu"}
    assert result.devices["cpu"].tasks == result.tasks and result.devices["cpu"].cases == result.cases

    # The shrunk failure is in the shared database: a worker on another machine, with a
    # local database of its own and empty, replays it first. Without the shared
    # database, the same seed's first case is another input.
    shared = redis.Redis.from_url(redis_url)
    assert any(k.startswith(workers.SHARED_KEY_PREFIX) for k in shared.scan_iter()), "nothing was shared"
    shrunk = next(f for f in stored.values() if f["kernel"].endswith("WRONG_WHEN_LONG") and f["check"] == "values")
    first_cases = {}
    for name, database in (("shared", redis_url), ("alone", None)):
        fresh = tmp_path / name
        replay = campaign.run(
            ["fuzz_targets:WRONG_WHEN_LONG"],
            BACKEND,
            str(fresh),
            seconds=CEILING_S,
            examples=2,
            jobs=1,
            paths=[TESTS],
            dtypes=["float32"],
            first_seed=shrunk["seed"] - 1,  # the task that found it draws again
            tasks=1,
            cluster=joined,
            shared_database=database,
        )
        assert replay.tasks == 1
        first_cases[name] = _lines(fresh / "cases.jsonl")[0]["shapes"]
    assert first_cases["shared"] == shrunk["shapes"] != first_cases["alone"], (first_cases, shrunk["shapes"])


def test_a_node_removed_and_a_driver_killed_lose_no_finding_and_duplicate_none(tmp_path, three_nodes) -> None:
    joined = cluster.connect(three_nodes.address, BACKEND)
    targets = ["fuzz_targets:SLOW", "fuzz_targets:WRONG_FIRST_ELEMENT"]
    removed: list[str] = []

    def remove_a_node_once_a_task_is_booked(line: str) -> None:
        # Every task of SLOW sleeps through seconds of cases: the removed node has one in flight.
        if not removed and _lines(tmp_path / "events.jsonl"):
            node = three_nodes.list_all_nodes()[-1]
            removed.append(node.node_id)
            three_nodes.remove_node(node, allow_graceful=False)

    result = campaign.run(
        targets,
        BACKEND,
        str(tmp_path),
        seconds=CEILING_S,
        examples=2,
        jobs=joined.slots,
        paths=[TESTS],
        dtypes=["float32"],
        tasks=6,
        progress=remove_a_node_once_a_task_is_booked,
        cluster=joined,
    )
    assert removed and result.requeued >= 1, result
    events = _lines(tmp_path / "events.jsonl")
    # every task started is booked once, the requeued ones by the nodes left
    assert sorted(e["seed"] for e in events) == list(range(1, 7)), [e["seed"] for e in events]
    found = corpus.Corpus(str(tmp_path)).failures()
    assert {f["check"] for f in found.values()} >= {"values"}
    assert sorted(f["signature"] for f in result.new_failures) == sorted(found)

    # The driver, killed mid-campaign: what it booked stays booked, and the resumed
    # campaign starts after it.
    corpus_dir = tmp_path / "killed"
    driver = subprocess.Popen(
        [sys.executable, "-m", "pallascheck", "fuzz", "--cluster", three_nodes.address, "--corpus", str(corpus_dir)]
        + [a for t in targets for a in ("--kernel", t)]
        + ["--path", TESTS, "--dtype", "float32", "--examples", "2", "--tasks", "20", "--minutes", "5"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + CEILING_S
    while len(_lines(corpus_dir / "events.jsonl")) < 2:
        assert driver.poll() is None and time.monotonic() < deadline, "the driver booked no task"
        time.sleep(0.2)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    booked = _lines(corpus_dir / "events.jsonl")
    state = json.loads((corpus_dir / "campaign.json").read_text())
    assert max(e["seed"] for e in booked) <= state["next_seed"]
    # Ray ends the actors of a driver that died, and their workers with them
    while ray.available_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, "the killed driver's workers kept their slots"
        time.sleep(0.5)
    before = corpus.Corpus(str(corpus_dir)).failures()
    resumed = campaign.run([], BACKEND, str(corpus_dir), seconds=CEILING_S, resume=True, tasks=1, cluster=joined)
    assert resumed.tasks == 1 and resumed.repeats == 0
    after = _lines(corpus_dir / "events.jsonl")
    assert after[: len(booked)] == booked
    assert all(e["seed"] > state["next_seed"] - 1 for e in after[len(booked) :])  # no seed run twice
    # nothing found is lost, and nothing found is found again (workers that hit one bug at
    # once count it under its one signature: ``count``, set before the kill)
    kept = corpus.Corpus(str(corpus_dir)).failures()
    assert {name: f["count"] for name, f in before.items()} == {name: kept[name]["count"] for name in before}


def test_bad_cluster_arguments_are_one_line_errors(tmp_path, capsys) -> None:
    for argv, says in (
        (["--redis", "localhost:6379"], "argument --redis: must be a redis://HOST:PORT URL, got 'localhost:6379'"),
        (["--cluster", ""], "--cluster needs an address (host:port of the Ray head) or 'local'"),
    ):
        with pytest.raises(SystemExit) as refused:
            cli.main(["fuzz", "--kernel", "rms_norm", "--corpus", str(tmp_path / "c"), *argv])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and says in err and len(err.strip().splitlines()) <= 3, err
    assert not (tmp_path / "c").exists()  # refused before anything is created


# What another process (the suite's other worker) may take of this machine's memory while
# the memory monitor's test runs without crossing the threshold it sets before its kernel does.
OOM_MARGIN = 4 * 2**30


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def test_rays_memory_monitor_killing_a_worker_is_an_oom_finding_with_its_case(tmp_path, three_nodes) -> None:
    # Ray's monitor compares the machine's memory in use (MemTotal - MemAvailable) with a
    # fraction of MemTotal, and kills a worker of its own node: here the only one on a
    # node started with the fraction just past what is in use now. The kernel's memory is
    # in the worker's child process, which the node counts all the same.
    total, available = fuzz_targets._machine_memory()
    threshold = (total - available + OOM_MARGIN) / total
    with _environment(RAY_memory_usage_threshold=f"{threshold:.4f}", RAY_memory_monitor_refresh_ms="100"):
        node = three_nodes.add_node(num_cpus=1, resources={"memory_monitor": 1})
    try:
        three_nodes.wait_for_nodes()
        joined = cluster.connect(three_nodes.address, BACKEND)
        there = dataclasses.replace(joined, slots=1, resources={"num_cpus": 1, "resources": {"memory_monitor": 1}})
        result = campaign.run(
            ["fuzz_targets:SWELLS"],
            BACKEND,
            str(tmp_path),
            seconds=CEILING_S,
            examples=1,
            jobs=1,
            paths=[TESTS],
            dtypes=["float32"],
            tasks=1,
            # our own limit, the whole machine per worker, never fires first
            limits=campaign.Limits(case_timeout=CEILING_S, memory_bytes=total),
            cluster=there,
        )
    finally:
        three_nodes.remove_node(node)
    (found,) = result.new_failures
    assert found["kind"] == "oom" and found["message"].startswith("Ray's memory monitor killed the worker"), found
    assert node.node_id[:12] in found["message"]
    case = Case.load(found["case"])  # the input in flight when Ray killed the worker
    assert (
        case.params["__failure__"]["kernel"] == "fuzz_targets:SWELLS" and case.params["__failure__"]["check"] == "oom"
    )
