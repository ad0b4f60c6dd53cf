"""verify --resume: an interrupted run keeps the units it finished (fuzz/journal.py),
and resuming runs only the rest, with the same table as an uninterrupted run."""

from __future__ import annotations

import json

from pallascheck import cli
from pallascheck.fuzz import verify
from pallascheck.kernels.backends import Backend
from pallascheck.properties import registry


def _argv(tmp_path, *extra: str) -> list[str]:
    from fuzz_targets import SOUND, WRONG_FIRST_ELEMENT

    return [
        "verify",
        *("--kernel", SOUND.name, "--kernel", WRONG_FIRST_ELEMENT.name),
        *("--examples", "1", "--jobs", "1", "--backend", "interpret"),
        *("--failures", str(tmp_path / "failures"), "--json", str(tmp_path / "rows.json"), *extra),
    ]


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path, monkeypatch, capsys) -> None:
    from fuzz_targets import SOUND, WRONG_FIRST_ELEMENT

    for kernel in (SOUND, WRONG_FIRST_ELEMENT):  # plain jnp relus: no compile to speak of
        monkeypatch.setitem(registry._REGISTRY, kernel.name, kernel)
    monkeypatch.chdir(tmp_path)
    run_unit, ran = verify.run_unit, []

    def interrupted_at_the_third(unit, options, hang_report=None):
        if len(ran) == 2:
            raise KeyboardInterrupt
        ran.append(unit.key)
        return run_unit(unit, options, hang_report)

    monkeypatch.setattr(verify, "run_unit", interrupted_at_the_third)
    # the two finished units' verdict is printed (one of them fails: exit 1 before 130)
    assert cli.main(_argv(tmp_path)) == 1
    finished = list(ran)
    assert len(finished) == 2
    assert "INTERRUPTED with 2 of 4 units unfinished" in capsys.readouterr().out

    def counted(unit, options, hang_report=None):
        ran.append(unit.key)
        return run_unit(unit, options, hang_report)

    monkeypatch.setattr(verify, "run_unit", counted)
    ran.clear()
    assert cli.main(_argv(tmp_path, "--resume")) == 1  # WRONG_FIRST_ELEMENT fails, as it always does
    resumed = capsys.readouterr()
    assert len(ran) == 2 and not set(ran) & set(finished), (ran, finished)  # only the two left
    assert resumed.err.count("(an earlier run's, --resume)") == 2, resumed.err
    resumed_rows = (tmp_path / "rows.json").read_text()

    # the same table as a run from nothing (which starts its journal afresh: every unit runs)
    ran.clear()
    assert cli.main(_argv(tmp_path)) == 1
    assert len(ran) == 4

    def table(text: str) -> list[tuple]:
        return sorted(
            (r["kernel"], r["dtype"], r["check"], r["verdict"], r["examples"]) for r in json.loads(text)["rows"]
        )

    assert table(resumed_rows) == table((tmp_path / "rows.json").read_text())


def test_rows_and_failures_come_in_one_order_whatever_the_plan(tmp_path, monkeypatch) -> None:
    """A run's plan follows earlier runs' durations; its rows and failures do not."""
    monkeypatch.chdir(tmp_path)
    units = [verify.Unit("property", k, d) for k in ("b", "a") for d in ("float32", "bfloat16")]
    units.append(verify.Unit("errors", "a"))

    def fake(unit, options, hang_report=None):
        row = verify.Row(unit.kernel, unit.dtype, unit.kind, False, 1, 2.0, None, 0.1)
        return [row], [f"{unit.kernel} {unit.dtype} {unit.kind} failed"], 0.1

    monkeypatch.setattr(verify, "run_unit", fake)
    options = verify.Options(Backend("interpret"), 1, 0, str(tmp_path / "failures"), ())
    forward = verify.run(units, options, 1)
    backward = verify.run(units[::-1], options, 1)
    assert forward == backward
    assert [(r.kernel, r.dtype, r.check) for r in forward[0]] == [
        ("a", "-", "errors"),
        ("a", "bfloat16", "property"),
        ("a", "float32", "property"),
        ("b", "bfloat16", "property"),
        ("b", "float32", "property"),
    ]
