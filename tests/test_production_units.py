"""verify at the production tier: one unit per named layout and dtype, so that every
layout that fits is checked in every dtype, and the summary says which were not."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shlex

import jax
import pytest

from pallascheck.cli import main
from pallascheck.fuzz import plan, verify
from pallascheck.kernels.backends import Backend
from pallascheck.properties import production, registry, runner, watchdog
from pallascheck.properties.device import multidevice
from pallascheck.properties.families import matmul as matmul_family
from pallascheck.properties.registry import get_spec
from pallascheck.properties.spec import Layout


def test_a_production_run_is_one_unit_per_layout_and_dtype_largest_first(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no durations recorded: every unit's time is unknown
    spec = get_spec("ragged_dot")
    fits = [l for l in spec.production_layouts if l.needs <= 8 * 2**30]
    assert 0 < len(fits) < len(spec.production_layouts)  # the rule leaves some out
    monkeypatch.setattr(production, "memory_limit", lambda backend: 8 * 2**30)
    backend = Backend("mosaic_gpu")
    units = verify.plan(backend, ["ragged_dot"], None, "production", examples=1)
    dtypes = spec.dtypes_for(backend)
    assert sorted((u.layout, u.dtype) for u in units) == sorted((l.name, d) for l in fits for d in dtypes)
    assert {u.kind for u in units} == {"property"}  # no bad-input unit at this tier
    assert len({u.key for u in units}) == len(units) and len({u.hang_report for u in units}) == len(units)
    needs = {l.name: l.needs for l in fits}
    assert [needs[u.layout] for u in units] == sorted((needs[u.layout] for u in units), reverse=True)
    (only,) = {u.layout for u in verify.plan(backend, ["ragged_dot"], ["bfloat16"], "production", 1, "1024 rows")}
    assert only.startswith("1024 rows per group:")


def test_a_lost_production_unit_leaves_its_layout_not_reached() -> None:
    unit = verify.Unit("property", "matmul", "bfloat16", layout="square 8192: 8192x8192 @ 8192x8192")
    rows, _, _ = verify._lost(unit, "hang", "a case passed its time limit", 1.0)
    assert verify.unreached(rows) == [("matmul", "bfloat16", verify.layout_path(unit.layout))]


TINY = (
    Layout("tiny square: 64x64 @ 64x64", dict(m=(64,), n=(64,), k=(64,)), 1),
    Layout("tiny unaligned: 40x24 @ 24x48", dict(m=(40,), n=(48,), k=(24,)), 1, cases=1),
)


def test_each_production_unit_checks_its_own_layout_and_its_replay_names_it(tmp_path, monkeypatch) -> None:
    """A real property per layout (the generic interpreter, tiny stand-in layouts):
    each unit checks cases of its layout only, as many as the layout declares, and
    reaches its layout's path; its replay command names the layout; the merged row
    declares every layout."""
    domain = matmul_family.Domain()
    spec = dataclasses.replace(
        get_spec("matmul"),
        production=production.production_cases("matmul", TINY, matmul_family.cases, domain),
        production_layouts=TINY,
    )
    monkeypatch.setattr(verify, "get_spec", lambda name: spec)
    monkeypatch.setattr(verify, "selected", lambda kernels: {"matmul": spec})
    monkeypatch.chdir(tmp_path)
    replays, run_property = [], runner.run_property

    def recording(*args, **kwargs):
        replays.append(kwargs["replay_hint"])
        return run_property(*args, **kwargs)

    monkeypatch.setattr(runner, "run_property", recording)
    backend = Backend("interpret")
    units = verify.plan(backend, ["matmul"], ["float32"], "production", examples=1)
    options = verify.Options(backend, 1, 0, str(tmp_path / "failures"), ("float32",), "production")
    rows = []
    for unit in units:
        unit_rows, failures = verify._property(unit, options, str(tmp_path / "hang.txt"))
        assert not failures, failures
        (values,) = [r for r in unit_rows if r.check == "values"]
        declared = next(l for l in TINY if l.name == unit.layout)
        assert values.examples == (declared.cases or 2)  # the interpreter's 2 a layout, or the layout's own
        assert unit_rows[0].paths == {verify.layout_path(unit.layout): values.examples}
        assert replays[-1].endswith(f"--shapes production --layout {shlex.quote(unit.layout)}"), replays
        rows += unit_rows
    merged = verify.merge_parts(rows)
    assert not verify.unreached(merged)
    assert set(merged[0].paths_declared) >= {verify.layout_path(l.name) for l in TINY}


def test_layout_is_refused_outside_the_production_tier_and_when_it_names_nothing(capsys) -> None:
    with pytest.raises(SystemExit) as small:
        main(["verify", "--kernel", "matmul", "--layout", "square"])
    assert small.value.code == 2 and "add --shapes production" in capsys.readouterr().err
    with pytest.raises(SystemExit) as unknown:
        main(["verify", "--kernel", "matmul", "--shapes", "production", "--layout", "squar 9000"])
    err = capsys.readouterr().err
    assert unknown.value.code == 2 and "no production layout" in err and "square 8192" in err, err


def test_a_production_case_has_a_longer_time_limit() -> None:
    assert watchdog.case_timeout("production") > watchdog.case_timeout("small") == watchdog.CASE_TIMEOUT_S


def test_a_kernel_none_of_whose_layouts_layout_names_is_not_checked(monkeypatch, capsys) -> None:
    """`--layout square` with matmul and attention: matmul's square layout is planned,
    and attention, which has no such layout, is listed as not checked (never silent)."""
    from pallascheck.cli import verify as verify_command

    monkeypatch.setattr(verify_command, "chosen_backend", lambda name: Backend("mosaic_gpu"))
    monkeypatch.setattr(verify_command, "set_up", lambda backend: None)
    monkeypatch.setattr(production, "memory_limit", lambda backend: 80 * 2**30)
    monkeypatch.setattr(production, "device_memory", lambda backend: 80 * 2**30)
    monkeypatch.setattr(plan, "cores", lambda: 16)
    monkeypatch.setattr(plan, "host_budget", lambda: 96 * 2**30)
    monkeypatch.setenv(production.SHARING_ENV_VAR, "1")  # restored after: the CLI sets it
    planned, started = [], []

    def run(units, options, jobs, ray_cluster, resume=False, jobs_of=None):
        planned.extend(units)
        started.append(sorted(set(jobs_of.values())))
        return [], []

    monkeypatch.setattr(verify, "run", run)
    main(["verify", "--kernel", "matmul", "--kernel", "attention", "--shapes", "production", "--layout", "square"])
    assert {(u.kernel, u.layout.split(":")[0]) for u in planned} == {("matmul", "square 8192")}
    out = capsys.readouterr().out
    assert "  attention: --layout 'square' names none of its production layouts" in out, out
    # jobs by memory: the layout --layout names needs 9.75 GiB (13.6 with its results on
    # the device): 8 shares of 80 GiB fit it; 6 to 8 hold its results on the host, and
    # the host's 96 GiB do not hold that many workers; 5 hold them on the device
    assert started == [[5]]
    assert "jobs by memory: 5 workers for 2 units: the most whose shares of the device (80 GiB)" in out, out


def test_a_layout_whose_unit_stopped_before_its_first_case_is_not_reached(tmp_path, monkeypatch) -> None:
    """A unit stopped by the device's memory before any case ran checks nothing: its
    rows are not checked, and its layout is listed as not reached."""

    def refused(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 128.00MiB")

    spec = dataclasses.replace(
        get_spec("matmul"),
        kernel=refused,
        production=production.production_cases("matmul", TINY[:1], matmul_family.cases, matmul_family.Domain()),
        production_layouts=TINY[:1],
    )
    monkeypatch.setattr(verify, "get_spec", lambda name: spec)
    monkeypatch.chdir(tmp_path)
    unit = verify.Unit("property", "matmul", "float32", layout=TINY[0].name)
    options = verify.Options(Backend("interpret"), 1, 0, None, ("float32",), "production")
    rows, failures = verify._property(unit, options, str(tmp_path / "hang.txt"))
    assert not failures and not any(r.checked for r in rows), rows
    assert verify.unreached(verify.merge_parts(rows)) == [("matmul", "float32", verify.layout_path(TINY[0].name))]


@pytest.mark.parametrize("in_turn", [True, False], ids=["in turn", "random"])
def test_a_layout_the_kernel_has_no_config_for_is_not_checked_saying_why(tmp_path, monkeypatch, in_turn) -> None:
    """A layout none of the kernel's configs takes (the Mosaic GPU attention at gemma-2's
    head_dim 256: no tiles fit its SMEM) cannot be run: its rows are not checked, each
    saying so, and nothing is booked as the kernel's crash (it was: "options must not
    be empty", a FAIL of a kernel that was never called)."""
    spec = dataclasses.replace(
        get_spec("matmul"),
        configs=lambda case, backend: [],
        production=production.production_cases("matmul", TINY[:1], matmul_family.cases, matmul_family.Domain()),
        production_layouts=TINY[:1],
    )
    monkeypatch.setattr(verify, "get_spec", lambda name: spec)
    monkeypatch.chdir(tmp_path)
    unit = verify.Unit("property", "matmul", "float32", layout=TINY[0].name)
    # 1 example a layout draws in turn; 3 at random (runner.run_property)
    options = verify.Options(Backend("interpret"), 1 if in_turn else 3, 0, None, ("float32",), "production")
    rows, failures = verify._property(unit, options, str(tmp_path / "hang.txt"))
    assert not failures and rows and not any(r.checked for r in rows), rows
    assert all(r.note.startswith("matmul has no config for these shapes on interpret (x (64, 64)") for r in rows), rows


def test_production_jobs_by_memory_are_the_most_the_device_and_the_host_hold(monkeypatch) -> None:
    """verify --shapes production on a GPU: per layout, as many workers as the device
    holds shares of it and the host holds what they keep there (the results a share
    too small for them holds on the host), never more than three quarters of the
    cores, never none."""
    gib = 2**30
    small, held_big = Layout("small", {}, 10 * gib, on_device=20 * gib), Layout("big", {}, 30 * gib, on_device=70 * gib)
    assert plan.host_bytes(small, 20 * gib) == plan.WORKER_HOST_BYTES  # its results fit the share
    assert plan.host_bytes(small, 19 * gib) == plan.WORKER_HOST_BYTES + 2 * 10 * gib  # held, joined on the host
    assert plan.jobs_by_memory(100 * gib, 10**6 * gib, small, 12) == 10  # the device's shares
    assert plan.jobs_by_memory(100 * gib, 10**6 * gib, small, 4) == 4  # the cores' cap
    # 5 shares of 20 GiB hold small's results on the device; 6 to 10 hold them on the host
    base = plan.WORKER_HOST_BYTES
    assert plan.jobs_by_memory(100 * gib, 5 * base, small, 12) == 5
    assert plan.jobs_by_memory(100 * gib, 4 * base, small, 12) == 4  # the host holds 4 workers
    assert plan.jobs_by_memory(100 * gib, 96 * gib, held_big, 12) == 1  # 2 shares of 50 GiB: 96 GiB a worker's host
    assert plan.jobs_by_memory(100 * gib, 10**6 * gib, held_big, 12) == 3  # the device's shares of 30 GiB
    assert plan.jobs_by_memory(10 * gib, 96 * gib, held_big, 12) == 1  # nothing fits: one, skipped by the rule
    with pytest.raises(ValueError, match="most and gpus must be positive"):
        plan.jobs_by_memory(100 * gib, 96 * gib, small, 0)

    # the shipped layouts on a host of 16 cores and 128 GiB, with an H200's 133 GiB
    gpu = Backend("mosaic_gpu")
    monkeypatch.setattr(plan, "cores", lambda: 16)
    monkeypatch.setattr(plan, "host_budget", lambda: 96 * gib)
    monkeypatch.setattr(production, "device_memory", lambda backend: 133 * gib)
    every = [l for spec in registry.selected(None).values() for l in spec.production_layouts]
    jobs = plan.jobs_by_layout(gpu, every)
    assert set(jobs) == {l.name for l in every}
    # attention's 128k holds its 42 GiB of results on the host at any share below 70 GiB
    assert jobs["llama-3.1 8B 128k: b1 s131072 h32/8 d128"] == 1
    assert jobs["llama-3.1 8B 64k: b1 s65536 h32/8 d128"] == 3  # 4 would hold its results on the host
    assert jobs["DeepSeek-V3 attention out, 4k tokens: 4096x16384 @ 16384x7168"] == 6  # fp8_matmul 6.7 GiB: the host
    assert jobs["Mixtral 8x7B: m8192 k4096 n14336 g8"] == 4  # 5 would hold its results on the host
    assert max(jobs.values()) == 6  # the host's 96 GiB, 16 a worker
    # one count for the whole run would be the smallest: one worker, for every layout
    assert min(jobs.values()) == 1
    line = plan.jobs_line(gpu, jobs, [jobs[l.name] for l in every])
    assert line.startswith("jobs by memory: 6 workers for "), line
    assert ", then 1 worker for 1 unit (llama-3.1 8B 128k: b1 s131072 h32/8 d128" in line, line
    # a host of 4 GPUs (64 cores, 384 GiB for the workers): the counts are a GPU's, the
    # same on each, held by the host's memory for all of them together (6 x 4 x 16 GiB)
    monkeypatch.setattr(plan, "worker_gpus", lambda backend: ["0", "1", "2", "3"])
    monkeypatch.setattr(plan, "cores", lambda: 64)
    monkeypatch.setattr(plan, "host_budget", lambda: 384 * gib)
    four = plan.jobs_by_layout(gpu, every)
    assert max(four.values()) == 6 and four["llama-3.1 8B 128k: b1 s131072 h32/8 d128"] == 1
    assert plan.jobs_by_memory(100 * gib, 7 * base, small, 12, gpus=4) == 1  # 2 a GPU on 4 would take 8 x base
    assert plan.jobs_line(gpu, four, list(four.values())).startswith("jobs by memory on each of 4 GPUs: 6 workers for ")
    monkeypatch.undo()
    monkeypatch.setattr(plan, "cores", lambda: 16)
    assert plan.default_jobs("verify", gpu, "production") == 1  # no layout known: one
    assert plan.default_jobs("verify", gpu, "small") == 12
    assert plan.default_jobs("verify", Backend("interpret"), "production") == 16


def test_a_production_run_by_memory_runs_each_count_of_workers_in_a_pool_of_its_own(monkeypatch, tmp_path) -> None:
    """The units of one count of workers run together, each pool's workers told their
    share of the device, the largest count first; rows as with one pool."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(production.SHARING_ENV_VAR, "1")  # restored after: the run sets it
    units = [verify.Unit("property", "k", d, layout=l) for l in ("big", "small") for d in ("float32", "bfloat16")]
    pools = []

    def pool(units, options, jobs, done, gpus):
        pools.append((jobs, os.environ[production.SHARING_ENV_VAR], sorted(u.key for u in units)))
        for unit in units:
            done(unit, ([verify.Row(unit.kernel, unit.dtype, "values", True, 1, 0.5, None, 0.1)], [], 0.1))
        return [], jobs

    monkeypatch.setattr(verify, "_run_pool", pool)
    options = verify.Options(Backend("mosaic_gpu"), 1, 0, None, (), "production")
    jobs_of = {u: 1 if u.layout == "big" else 3 for u in units}
    rows, failures = verify.run(units, options, 3, jobs_of=jobs_of)
    assert [(j, share) for j, share, _ in pools] == [(3, "3"), (1, "1")]
    assert pools[0][2] == sorted(u.key for u in units if u.layout == "small")
    assert len(rows) == 2 and all(r.passed for r in rows) and failures == []


def test_pool_workers_take_the_visible_gpus_in_turn(monkeypatch) -> None:
    """verify's pool workers spread over the host's GPUs, n on each of them, named as
    this process's CUDA_VISIBLE_DEVICES names them (a child given "0" under
    CUDA_VISIBLE_DEVICES=2,3 would drive GPU 0)."""
    started = multiprocessing.get_context("spawn").Value("i", 0)
    assert [verify.next_gpu(["2", "3"], started) for _ in range(5)] == ["2", "3", "2", "3", "2"]
    assert verify.next_gpu([], started) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert multidevice.visible_gpus(2) == ["2", "3"]
    with pytest.raises(ValueError, match="names only 2 GPUs"):
        multidevice.visible_gpus(3)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert multidevice.visible_gpus(3) == ["0", "1", "2"]
    assert plan.worker_gpus(Backend("interpret")) == []


def test_the_time_left_adds_the_pools_each_over_its_own_workers() -> None:
    """verify at the production tier runs its pools one after another: 20 units of 100 s
    on 20 workers and 2 of 350 s on 2 take 100 + 350 s, not (2,000 + 700) / 20."""
    small = {verify.Unit("property", "matmul", "bfloat16", layout=f"l{i}"): 20 for i in range(20)}
    big = {verify.Unit("property", "attention", d, layout="128k"): 2 for d in ("bfloat16", "float16")}
    known = {**{u: 100.0 for u in small}, **{u: 350.0 for u in big}}
    assert verify.pooled_seconds_left({**small, **big}, known, []) == 450.0
    # units of unknown time take the mean of those finished
    assert verify.pooled_seconds_left(big, {}, [300.0, 400.0]) == 350.0
