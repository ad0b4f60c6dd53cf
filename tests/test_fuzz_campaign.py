"""Fuzz campaigns find broken kernels and keep replayable reproducers; survive kernels
that hang, crash or eat memory; keep one record per bug; lose nothing when
interrupted; and resume without redoing what they found."""

from __future__ import annotations

import json
import os
import random

import pytest
from fuzz_targets import WRONG_FIRST_ELEMENT, probe_of_a_short_accumulator

from pallascheck import cli
from pallascheck.fuzz import bandit, campaign, corpus, report
from pallascheck.kernels.backends import Backend
from pallascheck.properties import checks, runner
from pallascheck.properties.families.matmul import SPEC as MATMUL
from pallascheck.properties.spec import Case

TESTS = os.path.dirname(__file__)
DROPPED_TILE = "broken.matmul_variants:dropped_last_k_tile"


def _generic(backend: Backend) -> Backend:
    """The campaigns here fuzz Pallas-generic kernels and plain jnp functions."""
    if backend.is_mosaic_gpu:
        pytest.skip(f"the campaign's test kernels are Pallas-generic or plain jnp; {backend} runs neither")
    return backend


def _lines(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _run(targets, backend, path, **kwargs) -> campaign.CampaignResult:
    kwargs = {"seconds": 600, "examples": 2, "jobs": 1, "paths": [TESTS], "dtypes": ["float32"], **kwargs}
    return campaign.run(targets, backend, str(path), **kwargs)


def test_campaign_finds_a_broken_kernel_and_keeps_a_replayable_reproducer(tmp_path, backend) -> None:
    backend = _generic(backend)
    result = _run([DROPPED_TILE], backend, tmp_path, examples=8, stop_on_first=True)
    (found,) = result.new_failures
    assert found["kind"] == "value" and found["minimised"] and os.path.exists(found["case"])
    assert found["replay"] == f"pallascheck replay {found['case']} --path {TESTS}"
    (event,) = [e for e in _lines(tmp_path / "events.jsonl") if e["outcome"] != "pass"]
    assert event["signature"] == found["signature"]

    assert cli.main(["replay", found["case"], "--path", TESTS]) == 1  # still breaks the broken kernel
    case = Case.load(found["case"])
    meta = case.params["__failure__"]
    case = Case(case.arrays, {k: v for k, v in case.params.items() if k != "__failure__"})
    config = type(MATMUL.default_config)(**meta["config"])
    context = checks.Context(kernel="matmul", dtype="float32", backend=str(backend))
    runner.check_case(MATMUL, case, config, backend, context=context)  # and the real kernel passes it


def test_hang_crash_and_memory_hog_become_reproducers_while_the_campaign_goes_on(tmp_path, backend) -> None:
    backend = _generic(backend)
    targets = ["fuzz_targets:SOUND", "fuzz_targets:HANGS", "fuzz_targets:ABORTS", "fuzz_targets:HOARDS"]

    def sound_fuzzed_after_last_death(events: list[dict]) -> bool:
        deaths = [e["t"] for e in events if e["outcome"] != "pass"]
        return (
            any(e["kernel"] == "fuzz_targets:SOUND" and e["outcome"] == "pass" and e["t"] > max(deaths) for e in events)
            if deaths
            else False
        )

    def stop_once_shown(line: str) -> None:
        # Ctrl-C (the campaign books what it found, then stops) as soon as the three
        # deaths are booked and the sound kernel has been fuzzed after the last: the
        # test ends on these events, never on the clock (600 s is only a ceiling).
        log = tmp_path / "events.jsonl"
        written = log.read_text().splitlines(keepends=True) if log.exists() else []
        events = [json.loads(raw) for raw in written if raw.endswith("\n")]  # a line being written waits
        if len({e["outcome"] for e in events} - {"pass"}) == 3 and sound_fuzzed_after_last_death(events):
            raise KeyboardInterrupt

    # case_timeout 30 s: many times a worker's start plus its first (compiling) case even
    # with the two cores oversubscribed, so only HANGS is a hang (the hoard reaches the
    # 1.5 GiB limit in 24 steps of 64 MiB); the hang costs that long.
    result = _run(
        targets,
        backend,
        tmp_path,
        seconds=600,
        jobs=2,
        progress=stop_once_shown,
        limits=campaign.Limits(case_timeout=30, memory_bytes=int(1.5 * 2**30)),
    )
    found = {f["kernel"].split(":")[1]: f for f in result.new_failures}
    assert {k: f["kind"] for k, f in found.items()} == {"HANGS": "hang", "ABORTS": "crash", "HOARDS": "oom"}
    for f in found.values():  # the input in flight when the worker was lost, replayable
        assert os.path.exists(f["case"]) and Case.load(f["case"]).params["__failure__"]["check"] == f["kind"]
    assert sound_fuzzed_after_last_death(_lines(tmp_path / "events.jsonl")), (
        "the sound kernel was not fuzzed after the last worker was lost"
    )


def test_two_failures_of_one_bug_share_a_signature(tmp_path) -> None:
    store = corpus.Corpus(str(tmp_path / "corpus"))
    stored = []
    for seed in (1, 2):  # two campaigns' runs of one kernel, each finding the bug on its own inputs
        directory = tmp_path / f"run-{seed}"
        tally = runner.run_property(
            WRONG_FIRST_ELEMENT, "float32", Backend("interpret"), examples=4, seed=seed, failure_dir=str(directory)
        )
        (saved,) = directory.iterdir()
        pattern = corpus.worst_pattern(tally.failed_outcome.worst)
        sig = corpus.signature(WRONG_FIRST_ELEMENT.name, "float32", "values", "value", pattern)
        stored.append(store.record_failure({"signature": sig}, str(saved)))
    (first, first_is_new), (second, second_is_new) = stored
    assert first_is_new and not second_is_new and second["count"] == 2
    assert os.listdir(tmp_path / "corpus" / "failures") == [first["signature"]]
    # A bug that is worst at the last element has another pattern, so another signature.
    assert corpus.worst_pattern(checks.Worst("out", (6,), (7,), 1.0, 0.1)) != corpus.worst_pattern(
        checks.Worst("out", (0,), (7,), 1.0, 0.1)
    )


def test_interrupted_campaign_keeps_what_it_found(tmp_path, backend) -> None:
    backend = _generic(backend)

    def interrupt_once_found(line: str) -> None:
        if "value" in line:
            raise KeyboardInterrupt  # Ctrl-C once the first failure is booked

    result = _run(
        ["fuzz_targets:WRONG_FIRST_ELEMENT", "fuzz_targets:SOUND"], backend, tmp_path, progress=interrupt_once_found
    )
    assert result.interrupted
    state = json.loads((tmp_path / "campaign.json").read_text())
    found = corpus.Corpus(str(tmp_path)).failures()
    assert found, "the failure booked before the interrupt is gone"
    retired = {tuple(pair): checks_ for pair, checks_ in state["retired_checks"]}
    for name, f in found.items():
        assert os.path.exists(tmp_path / "failures" / name / "case.npz")
        assert f["check"] in retired[(f["kernel"], f["dtype"])]


def test_a_task_shrinking_past_the_time_is_stopped_and_its_failure_kept(tmp_path, backend, monkeypatch) -> None:
    """A campaign waits OVERRUN_S past its time for the tasks in flight, then stops
    them and books the failures they saved, unminimised (a GPU campaign's shrink ran
    minutes past its --minutes). The check that found it is retired in the saved state,
    as a finished task's is, so that a resumed campaign does not hunt it again."""
    backend = _generic(backend)
    # The overrun ends once the task is shrinking: its first failing case is saved whole
    # (each call on another input sleeps 6 s: the shrink never ends). A fixed overrun had to
    # cover a worker's start and first case on a loaded machine; 600 s is only a ceiling.
    monkeypatch.setattr(campaign, "OVERRUN_S", 600.0)

    def end_the_overrun_once_shrinking(line: str) -> None:
        for saved in (tmp_path / corpus.WORKERS).glob("*/failed/*.npz"):
            try:
                Case.load(str(saved))
            except Exception:  # noqa: BLE001 - being written: the next progress line looks again
                continue
            monkeypatch.setattr(campaign, "OVERRUN_S", 0.0)

    result = _run(
        ["fuzz_targets:WRONG_THEN_SLOW"], backend, tmp_path, seconds=1, progress=end_the_overrun_once_shrinking
    )
    assert result.stopped_in_flight == 1, result  # stopped in its shrink, never left to finish it
    (found,) = result.new_failures
    assert found["check"] == "values" and not found["minimised"], found
    assert os.path.exists(tmp_path / "failures" / found["signature"] / "case.npz")
    state = json.loads((tmp_path / "campaign.json").read_text())
    assert [[found["kernel"], found["dtype"]], ["values"]] in state["retired_checks"], state["retired_checks"]


def test_resumed_campaign_does_not_redo_found_failures(tmp_path, backend) -> None:
    backend = _generic(backend)
    targets = ["fuzz_targets:WRONG_FIRST_ELEMENT", "fuzz_targets:SOUND"]
    # The first run finds its failures (values, contract, metamorphic) in its first few
    # tasks; every later task passes. Both runs are bounded by tasks, never by seconds.
    first = _run(targets, backend, tmp_path, tasks=6)
    found_checks = {f["check"] for f in first.new_failures}
    assert "values" in found_checks
    before = json.loads((tmp_path / "campaign.json").read_text())
    with pytest.raises(ValueError, match="--resume"):
        _run(targets, backend, tmp_path, tasks=1)
    second = _run([], backend, tmp_path, tasks=4, resume=True)
    assert second.tasks > 0 and second.repeats == 0
    after = json.loads((tmp_path / "campaign.json").read_text())
    assert after["seconds"] > before["seconds"]
    resumed = _lines(tmp_path / "events.jsonl")[-second.tasks :]
    assert all(e["seed"] >= before["next_seed"] for e in resumed)  # no seed run twice
    assert not any(found_checks & set(e["checks"]) for e in resumed if e["kernel"] == targets[0])
    assert all(f["count"] == 1 for f in corpus.Corpus(str(tmp_path)).failures().values())


def test_a_device_kind_whose_arithmetic_the_model_does_not_describe_books_no_value_failure(tmp_path, backend) -> None:
    """The probe (run once per device kind, kept in the corpus) of a device with a short
    accumulator: the kernel, wrong at its first element, fails its bounded checks on any
    device the model describes, and is not booked for them on this one."""
    backend = _generic(backend)
    said: list[str] = []
    targets = ["fuzz_targets:WRONG_FIRST_ELEMENT"]
    first = _run(targets, backend, tmp_path, tasks=2, probe=probe_of_a_short_accumulator, notify=said.append)
    (line,) = said
    assert line.startswith("probe of cpu: the tolerance model does not hold") and "22 significand bits" in line
    assert first.probed == ["cpu"] and not first.arithmetic["cpu"].modelled
    assert first.tasks == 2 and not first.new_failures and not corpus.Corpus(str(tmp_path)).failures()
    events = _lines(tmp_path / "events.jsonl")
    assert [e["checks"] for e in events] == [["deterministic"]] * 2 and {e["device_kind"] for e in events} == {"cpu"}
    kept = corpus.probes(str(tmp_path))["cpu"]
    assert [f"emulated: {v}" for v in kept["violations"]["emulated"]] == list(first.arithmetic["cpu"].violations)
    # resumed: the kept probe is the kind's arithmetic, not run again
    said.clear()
    second = _run([], backend, tmp_path, tasks=1, resume=True, probe=probe_of_a_short_accumulator, notify=said.append)
    assert second.probed == [] and said == [] and not second.new_failures
    assert _lines(tmp_path / "events.jsonl")[-1]["checks"] == ["deterministic"]


def test_fuzz_command(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["fuzz", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--jobs", "--resume", "--case-timeout", "--memory-gb", "--random", "--cases"):
        assert flag in help_text
    argv = [
        "fuzz",
        "--kernel",
        "rms_norm",
        "--dtype",
        "float32",
        "--minutes",
        "0.001",
        "--examples",
        "1",
        "--jobs",
        "1",
        "--corpus",
        str(tmp_path),
    ]
    assert cli.main(argv) == 0
    (event,) = _lines(tmp_path / "events.jsonl")
    assert event["outcome"] == "pass" and event["cases"] == runner.CASES_PER_LAYOUT
    # the probe ran once on this machine's kind of device, and the summary splits by kind
    out = capsys.readouterr().out
    assert "probe of cpu: the tolerance model's arithmetic holds" in out and "  on cpu: 1 tasks, " in out
    assert corpus.probes(str(tmp_path))["cpu"]["violations"] == {"xla": [], "pallas": []}
    # --cases: that many value draws per layout, kept by a resumed campaign that names none
    assert cli.main(argv + ["--resume", "--cases", "3"]) == 0
    assert "probe of" not in capsys.readouterr().out  # the corpus's probe is reused
    assert cli.main(argv + ["--resume"]) == 0
    assert [e["cases"] for e in _lines(tmp_path / "events.jsonl")[1:]] == [3, 3]
    with pytest.raises(SystemExit) as refused:
        cli.main(["fuzz", "--kernel", "rms_norm", "--cases", "0", "--corpus", str(tmp_path / "other")])
    assert refused.value.code == 2 and "argument --cases: must be >= 1" in capsys.readouterr().err


def test_bandit_opens_kinds_and_slots_then_spends_where_budgets_climb() -> None:
    pairs = [("matmul", "float32"), ("matmul", "bfloat16")]
    arms = bandit.Bandit(pairs, random.Random(0))
    assert {arms.choose(pairs)[1:] for _ in range(5)} == {("any", None)}  # nothing known yet
    arms.learn(pairs[1], ["large", "normal"], configs=3)
    assert arms.kinds[pairs[1]] == ["any", "large", "normal"] and arms.slots[pairs[1]] == [None, 0, 1, 2]
    for _ in range(30):  # one pair's budgets climb toward 1, the other's stay low
        pair, kind, slot = arms.choose(pairs)
        arms.update(pair, kind, slot, 0.9 if pair == pairs[1] and kind == "large" else 0.05)
    picks = [arms.choose(pairs) for _ in range(50)]
    assert sum(p[0] == pairs[1] for p in picks) > 40 and sum(p[1] == "large" for p in picks) > 25


def test_an_untargeted_campaign_serves_every_pair_in_turn(tmp_path) -> None:
    # A soak reports cases per kernel x dtype: a uniform draw of pairs left some with half
    # the tasks of others, so untargeted runs take the least-served pair next.
    run = campaign.Campaign(
        ["matmul", "rms_norm"],
        Backend("interpret"),
        str(tmp_path),
        examples=1,
        targeted=False,
        dtypes=None,
        paths=(),
        first_seed=0,
        resume=False,
    )
    assert len(run.pairs) == 6
    for rounds in (1, 2, 3):
        served = [run.next_task() for _ in run.pairs]
        assert {(t.target, t.dtype) for t in served} == set(run.pairs), f"round {rounds}"


def test_two_distinct_failures_are_booked_each_under_its_check(tmp_path, capsys) -> None:
    # Hypothesis shrinks the crash's input into the wrong-value bug and reports both at
    # once ("Hypothesis found 2 distinct failures"): two records, two replays.
    result = _run(["fuzz_targets:CRASH_OR_WRONG"], Backend("interpret"), tmp_path, examples=4, stop_on_first=True)
    found = {f["check"]: f for f in result.new_failures}
    assert set(found) == {"crash", "values"}, [f["message"] for f in result.new_failures]
    assert found["crash"]["kind"] == "crash" and found["values"]["kind"] == "value"
    (event,) = [e for e in _lines(tmp_path / "events.jsonl") if e["outcome"] != "pass"]
    assert sorted(event["signatures"]) == sorted(f["signature"] for f in found.values())
    capsys.readouterr()
    for check, failure in found.items():
        assert cli.main(["replay", failure["case"], "--path", TESTS]) == 1
        header, *lines = capsys.readouterr().out.splitlines()
        verdict = next(line for line in lines if line.startswith("FAIL"))
        assert f"[{check}]" in header and verdict.startswith(f"FAIL [{check}]"), (header, verdict)


def test_time_to_find_on_a_gpu_backend_takes_the_variants_written_for_it_there() -> None:
    from studies import time_to_find

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    on_gpu = time_to_find.variants(tests_dir, Backend("mosaic_gpu"))
    on_cpu = {r["variant"]: r["backend"] for r in time_to_find.variants(tests_dir)}
    assert on_gpu and all(r["backend"] == "mosaic_gpu" for r in on_gpu)
    # every variant the CPU run checks in the Mosaic GPU interpreter (the GPU may run more:
    # NOT_ON), none of the generic ones
    gpu = {r["variant"] for r in on_gpu}
    assert {v for v, b in on_cpu.items() if b == "mosaic_gpu_interpret"} <= gpu
    assert all(on_cpu.get(v, "mosaic_gpu_interpret") == "mosaic_gpu_interpret" for v in gpu)


def test_a_production_campaign_refuses_a_kernel_without_that_tier(tmp_path) -> None:
    """A task of a kernel with no production tier would die in its worker, booked as
    a crash of the kernel (a Triton production soak lost 7 of its 12 tasks so)."""
    with pytest.raises(ValueError, match="no production shape tier: top_k, rms_norm"):
        _run(["matmul", "top_k", "rms_norm"], Backend("interpret"), tmp_path, seconds=1, shapes="production")


def test_replay_repeat_tells_an_intermittent_failure_from_a_steady_one(tmp_path, backend, capsys) -> None:
    """``replay --repeat N`` checks a saved case N times in one process and says whether
    it failed every time, never, or now and then."""
    from pallascheck.properties import strategies

    backend = _generic(backend)
    case = Case({"x": strategies.elements(0, (4, 8), "float32", "normal")}, {"activation": "relu"})
    meta = {"dtype": "float32", "backend": str(backend), "check": "values", "config": None, "message": "-"}
    verdicts = {}
    for target in ("fuzz_targets:WRONG_FIRST_ELEMENT", "fuzz_targets:WRONG_ON_ITS_FIRST_CALL", "fuzz_targets:SOUND"):
        path = str(tmp_path / f"{target.split(':')[1]}.npz")
        Case(case.arrays, {**case.params, "__failure__": {**meta, "kernel": target}}).save(path)
        rc = cli.main(["replay", path, "--path", TESTS, "--repeat", "4"])
        verdicts[target] = (rc, capsys.readouterr().out.strip().splitlines()[-1])
    assert verdicts["fuzz_targets:WRONG_FIRST_ELEMENT"] == (
        1,
        "failed 4 of 4 runs in this process: it fails every time",
    )
    rc, line = verdicts["fuzz_targets:WRONG_ON_ITS_FIRST_CALL"]
    assert rc == 1 and line.startswith("failed 1 of 4 runs in this process: intermittent")
    assert verdicts["fuzz_targets:SOUND"] == (0, "failed 0 of 4 runs in this process: it never fails")
    with pytest.raises(SystemExit) as refused:
        cli.main(["replay", path, "--repeat", "0"])
    assert refused.value.code == 2 and "argument --repeat: must be >= 1" in capsys.readouterr().err


PLANTED_GELU = """
import jax.numpy as jnp
from pallascheck.specs import elementwise_like

def gelu_tanh(x, interpret=None):  # the bug: 0.44715 for 0.044715
    xf = x.astype(jnp.float32)
    return (0.5 * xf * (1 + jnp.tanh(0.7978845608 * (xf + 0.44715 * xf**3)))).astype(x.dtype)

SPEC = elementwise_like(gelu_tanh, name="my_gelu", activation="gelu_tanh", dtypes=("float32", "bfloat16"),
                        differentiable=False, interpret="interpret")
"""


def test_one_planted_bug_in_a_users_kernel_is_one_finding_listing_its_failures(tmp_path, capsys) -> None:
    # A wrong GELU constant fails values and contract, in float32 and bfloat16: four
    # records in the corpus (nothing lost), one finding in fuzz's summary and the report.
    (tmp_path / "my_gelu.py").write_text(PLANTED_GELU)
    out = tmp_path / "corpus"
    argv = ["fuzz", "--kernel", "my_gelu:SPEC", "--path", str(tmp_path), "--tasks", "40", "--jobs", "1"]
    assert cli.main(argv + ["--examples", "4", "--minutes", "10", "--corpus", str(out)]) == 1
    printed = capsys.readouterr().out
    stored = corpus.Corpus(str(out)).failures()
    assert sorted((f["dtype"], f["check"]) for f in stored.values()) == [
        ("bfloat16", "contract"),
        ("bfloat16", "values"),
        ("float32", "contract"),
        ("float32", "values"),
    ]
    assert "1 new findings (4 new failures)" in printed
    assert "[value] my_gelu:SPEC bfloat16, float32 [contract, values] (4 failures)" in printed
    for failure in stored.values():  # each member listed with its own replay command
        assert f"{failure['dtype']} [{failure['check']}] replay: {failure['replay']}" in printed
    summary = report.summarise(str(out))
    assert summary["totals"]["findings"] == 1 and summary["totals"]["failures"] == 4
    assert sorted(summary["findings"][0]["members"]) == sorted(stored)
