"""verify --resume: an interrupted run keeps the units it finished (fuzz/journal.py),
and resuming runs only the rest, with the same table as an uninterrupted run."""

from __future__ import annotations

import json

import pytest

from pallascheck import cli
from pallascheck.fuzz import verify
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
    with pytest.raises(KeyboardInterrupt):
        cli.main(_argv(tmp_path))
    finished = list(ran)
    assert len(finished) == 2

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
