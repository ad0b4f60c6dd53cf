"""Campaigns, verify and mutate on a Ray cluster (docs/cluster.md): a real cluster of
three nodes on this machine (``ray.cluster_utils.Cluster``, one CPU each) and a real
Redis server on a free loopback port. Findings of hangs, crashes and wrong values come
back from the nodes with their cases; a node removed mid-campaign costs no task and no
finding; a driver killed mid-campaign resumes losing at most its tasks in flight; a
failure shrunk on one node reaches every other through the shared example database.
verify and mutate on the nodes give what they give on this machine; a node removed
while a verify unit runs costs no row and duplicates none.

Needs the ``cluster`` extra (Ray, redis-py) and Debian's redis-server, which `.ci/run`
installs; without them the tests skip, saying which is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pallascheck import cli
from pallascheck.bench import probe
from pallascheck.fuzz import campaign, cluster, corpus, verify, workers
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


# How soon the head counts a node that stopped answering as dead: Ray's default, five
# failed health checks 3 s apart, left every test that removes a node waiting 15 s for
# the actors there to be reported dead. Three failures 1 s apart still need a node
# silent through three checks of up to 10 s each (Ray's health_check_timeout_ms) before
# a loaded but live one is counted dead.
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def three_nodes() -> Iterator[Cluster]:
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "_system_config": HEALTH_CHECKS},
    )
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


def _nodes_named(err: str) -> set[str]:
    """The nodes (the start of Ray's node id) a verify run's progress lines name."""
    return set(re.findall(r" on node \S+ \((\w+)\)", err))


def test_verify_on_the_nodes_gives_the_rows_of_a_verify_here(tmp_path, three_nodes, monkeypatch, capsys) -> None:
    """Two plain jnp relus, one wrong at its first element: the same rows (checks,
    verdicts, cases), failure and saved case as the same verify run here, the units
    run on more than one node."""
    monkeypatch.chdir(tmp_path)  # verify's durations file
    argv = ["verify", "--path", TESTS, "--kernel", "fuzz_targets:SOUND", "--kernel", "fuzz_targets:WRONG_FIRST_ELEMENT"]
    argv += ["--examples", "1", "--seed", "5", "--full"]
    runs = {}
    for name, where in (("here", ["--jobs", "1"]), ("cluster", ["--cluster", three_nodes.address])):
        code = cli.main([*argv, *where, "--json", f"{name}.json", "--failures", f"{name}-failures"])
        out, err = capsys.readouterr()
        assert code == 1, out[-3000:]  # the wrong relu fails
        runs[name] = (json.loads((tmp_path / f"{name}.json").read_text()), err)
    (here, _), (there, err) = runs["here"], runs["cluster"]
    keys = ("kernel", "dtype", "check", "verdict", "examples", "passed", "note")
    # the same rows and not-checked items; their order is each run's plan order, which the
    # durations the first run recorded can change for the second (fuzz/verify.py: longest
    # units first)
    assert sorted([r[k] for k in keys] for r in there["rows"]) == sorted([r[k] for k in keys] for r in here["rows"])
    assert any(r["verdict"] == "FAIL" for r in there["rows"])
    assert len(there["failures"]) == len(here["failures"]) == 1
    assert sorted(there["not_checked"], key=str) == sorted(here["not_checked"], key=str)
    saved = sorted(os.listdir(tmp_path / "cluster-failures"))
    assert saved == sorted(os.listdir(tmp_path / "here-failures")) and saved, saved
    assert len(_nodes_named(err)) > 1, err


def test_verify_on_the_nodes_books_a_hung_case_and_a_dead_worker_as_their_units_failures(
    tmp_path, three_nodes, monkeypatch, capsys
) -> None:
    """A relu that sleeps past --case-timeout and one that aborts its process: each is
    its own unit's failed row, as on one machine (the hang with the watchdog's report
    and case, brought back here from the node), and nothing else fails."""
    monkeypatch.chdir(tmp_path)
    argv = ["verify", "--cluster", three_nodes.address, "--path", TESTS, "--kernel", "fuzz_targets:HANGS"]
    argv += ["--kernel", "fuzz_targets:ABORTS", "--examples", "1", "--case-timeout", "5", "--failures", "failures"]
    assert cli.main([*argv, "--json", "v.json"]) == 1
    capsys.readouterr()
    report = json.loads((tmp_path / "v.json").read_text())
    failed = {(r["kernel"], r["check"]) for r in report["rows"] if r["verdict"] == "FAIL"}
    assert failed == {("fuzz_targets:HANGS", "hang"), ("fuzz_targets:ABORTS", "crash")}, report["rows"]
    hang = next(m for m in report["failures"] if m.startswith("[hang] kernel=fuzz_targets:HANGS"))
    saved = os.path.join("failures", "fuzz_targets:HANGS-float32-hang.npz")
    assert f"saved: {saved} (pallascheck replay {saved})" in hang, hang
    assert Case.load(str(tmp_path / saved)).params["__failure__"]["check"] == "hang"
    crash = next(m for m in report["failures"] if "(crash)" in m)
    assert "killed by signal 6" in crash and " on node " in crash, crash


def test_mutate_on_the_nodes_gives_the_outcomes_of_a_mutate_here(tmp_path, three_nodes, monkeypatch, capsys) -> None:
    """Two of norms.py's mutants under rms_norm's checks (tests/test_mutate.py has the
    same ones here): the eps constant the spec overrides (equivalent) and the dropped
    rescale of the mean square (killed by values), the same here and on the nodes,
    whose workers get the mutant's source with their setup."""
    monkeypatch.chdir(tmp_path)
    argv = ["mutate", "--kernel", "rms_norm", "--dtype", "float32", "--examples", "1", "--seed", "0"]
    argv += ["--operator", "rescale", "--operator", "constant", "--function", "rms_statistics|<module>"]
    argv += ["--mutant", "0", "--mutant", "2"]
    outcomes, printed = {}, {}
    for name, where in (("here", ["--jobs", "1"]), ("cluster", ["--cluster", three_nodes.address])):
        assert cli.main([*argv, *where, "--out", f"{name}.jsonl"]) == 0
        printed[name] = capsys.readouterr().out
        outcomes[name] = [r for r in _lines(tmp_path / f"{name}.jsonl") if r["kind"] == "mutant"]
    keys = ("id", "status", "check", "kernel", "dtype", "cases")
    # the same outcomes, each appended as it arrives: on the nodes in the order they finish
    assert sorted([r[k] for k in keys] for r in outcomes["cluster"]) == [[r[k] for k in keys] for r in outcomes["here"]]
    assert [(r["id"], r["status"]) for r in outcomes["here"]] == [(0, "equivalent"), (2, "killed")]
    assert all("mutation score 100.0% (1/1)" in text for text in printed.values()), printed
    assert all(r["node"] is None for r in outcomes["here"])
    # two mutants at once on nodes of one CPU each: two nodes
    assert len({r["node"] for r in outcomes["cluster"]}) == 2, outcomes["cluster"]


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
    # examples as the killed driver's (the default, 8, is four times the cases of its sleeping relu)
    resumed = campaign.run(
        [], BACKEND, str(corpus_dir), seconds=CEILING_S, examples=2, resume=True, tasks=1, cluster=joined
    )
    assert resumed.tasks == 1 and resumed.repeats == 0
    after = _lines(corpus_dir / "events.jsonl")
    assert after[: len(booked)] == booked
    assert all(e["seed"] > state["next_seed"] - 1 for e in after[len(booked) :])  # no seed run twice
    # nothing found is lost, and nothing found is found again (workers that hit one bug at
    # once count it under its one signature: ``count``, set before the kill)
    kept = corpus.Corpus(str(corpus_dir)).failures()
    assert {name: f["count"] for name, f in before.items()} == {name: kept[name]["count"] for name in before}


def test_a_node_removed_while_verify_runs_its_unit_costs_no_row_and_duplicates_none(
    tmp_path, three_nodes, monkeypatch, capsys
) -> None:
    """A property in three dtypes whose every case sleeps: its units take every slot,
    then a node leaves. The unit it ran is run again on a node left, reported once."""
    monkeypatch.chdir(tmp_path)
    joined = cluster.connect(three_nodes.address, BACKEND)
    alive = [n for n in ray.nodes() if n["Alive"]]
    assert len(alive) >= 2, "the cluster needs a node to remove besides its head"
    kernel = "fuzz_targets:SLOW_IN_THREE_DTYPES"
    options = verify.Options(BACKEND, 1, 0, str(tmp_path / "failures"), (), paths=(TESTS,))
    units = verify.plan(BACKEND, [kernel], None)
    assert [u.kind for u in units[: joined.slots]] == ["property"] * joined.slots  # the slow ones start first
    result: list = []
    run = threading.Thread(target=lambda: result.append(verify.run(units, options, joined.slots, joined)))
    run.start()
    deadline = time.monotonic() + CEILING_S
    while ray.available_resources().get("CPU", 0) > 0:  # every slot placed, each with its unit
        assert run.is_alive() and time.monotonic() < deadline, "the units did not take every slot"
        time.sleep(0.1)
    node = three_nodes.list_all_nodes()[-1]
    three_nodes.remove_node(node, allow_graceful=False)
    run.join(CEILING_S)
    assert not run.is_alive() and result, "verify did not finish"
    rows, failures = result[0]
    err = capsys.readouterr().err
    assert "running it again on another node" in err, err
    assert not failures and all(r.passed for r in rows), (failures, rows)
    keys = [(r.kernel, r.dtype, r.check) for r in rows]
    assert len(keys) == len(set(keys)) and {d for _, d, _ in keys} == {"-", "float32", "float16", "bfloat16"}
    assert len(re.findall(r"^  \[\d+/\d+\]", err, re.M)) == len(units), err  # each unit reported once
    assert node.node_id[:12] not in _nodes_named(err)  # none reported from the node that left


def test_bad_cluster_arguments_are_one_line_errors(tmp_path, capsys, monkeypatch) -> None:
    for argv, says in (
        (["--redis", "localhost:6379"], "argument --redis: must be a redis://HOST:PORT URL, got 'localhost:6379'"),
        (["--cluster", ""], "--cluster needs an address (host:port of the Ray head) or 'local'"),
    ):
        with pytest.raises(SystemExit) as refused:
            cli.main(["fuzz", "--kernel", "rms_norm", "--corpus", str(tmp_path / "c"), *argv])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and says in err and len(err.strip().splitlines()) <= 3, err
    assert not (tmp_path / "c").exists()  # refused before anything is created
    monkeypatch.chdir(tmp_path)
    for command in (["verify", "--kernel", "rms_norm"], ["mutate", "--kernel", "rms_norm", "--out", "m.jsonl"]):
        with pytest.raises(SystemExit) as refused:
            cli.main([*command, "--cluster", ""])
        err = capsys.readouterr().err
        says = "--cluster needs an address (host:port of the Ray head) or 'local'"
        assert refused.value.code == 2 and says in err and len(err.strip().splitlines()) <= 3, (command, err)


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


def test_a_worker_directory_left_by_a_killed_worker_is_removed_by_the_next(tmp_path, monkeypatch) -> None:
    # an actor killed with its node or driver never removes its temporary directory
    monkeypatch.setattr(cluster.tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = tmp_path / f"{cluster.WORKER_DIR_PREFIX}{gone.pid}-abc123"
    (left / "failed").mkdir(parents=True)
    running = tmp_path / f"{cluster.WORKER_DIR_PREFIX}{os.getppid()}-def456"  # a live process's: kept
    running.mkdir()
    made = cluster.worker_directory()
    assert not left.exists() and running.exists()
    assert os.path.basename(made).startswith(f"{cluster.WORKER_DIR_PREFIX}{os.getpid()}-") and os.path.isdir(made)
