"""The estimate verify and mutate print (fuzz/durations.py), and fuzz's status line:
what is left and how many kernel x dtype pairs were reached."""

from __future__ import annotations

import time

from pallascheck.fuzz import campaign, durations
from pallascheck.kernels.backends import Backend


def test_the_time_left_takes_earlier_durations_where_known_and_the_typical_finished_task_elsewhere() -> None:
    known = {"a": 10.0, "b": 30.0}
    # before anything finished: the unknown task counts at the mean of the known ones
    assert durations.seconds_left(["a", "b", "c"], known, [], jobs=2) == (10 + 30 + 20) / 2
    # then at the mean of the tasks finished in this run
    assert durations.seconds_left(["b", "c"], known, [4.0, 6.0], jobs=1) == 30 + 5
    assert durations.seconds_left([], known, [4.0], jobs=3) == 0.0
    assert durations.seconds_left(["c"], {}, [], jobs=0) == 0.0  # nothing known at all: no guess


def test_the_plan_line_gives_an_estimate_only_when_every_task_is_known() -> None:
    assert durations.plan_line("verify", "12 units", 2, 12, 12, 95.4) == (
        "verify: 12 units on 2 jobs; about 95 s from this machine's earlier runs"
    )
    assert durations.plan_line("mutate", "the baseline and 5 mutants", 1, 2, 6, 3.0) == (
        "mutate: the baseline and 5 mutants on 1 job; earlier durations known for 2 of 6: "
        "the estimate follows the first results"
    )


def test_durations_are_merged_into_the_commands_file(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert durations.load("mutate") == {}
    durations.save("mutate", {"x": 1.5})
    durations.save("mutate", {"y": 2.0})
    assert durations.load("mutate") == {"x": 1.5, "y": 2.0} and durations.load("verify") == {}
    (tmp_path / durations.path("verify")).write_text("[1, 2]")  # a file from elsewhere: nothing known
    assert durations.load("verify") == {}


def test_the_fuzz_status_line_says_the_time_left_and_the_pairs_reached(tmp_path) -> None:
    run = campaign.Campaign(
        ["rms_norm"],
        Backend("interpret"),
        str(tmp_path),
        examples=1,
        targeted=False,
        dtypes=["float32", "bfloat16"],
        paths=(),
        first_seed=0,
        resume=False,
    )
    run.next_task()
    line = campaign._progress_line(run, campaign.CampaignResult(), (0.25, "rms_norm"), time.monotonic() + 60)
    assert " s left]" in line and "1/2 kernel x dtype pairs tried" in line, line
    assert 55 <= float(line.split(",")[1].split()[0]) <= 60, line
