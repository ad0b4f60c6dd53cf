"""What a verify run has finished, unit by unit, so that an interrupted run resumes.

A production run of every kernel is an hour or more on one GPU; stopped near its end
(Ctrl-C, a lost machine), it would otherwise begin again from nothing. Each finished
unit's rows, failure messages and seconds are appended to a journal, one JSON line a
unit, under ``.pallascheck/verify-runs/``, named by a digest of everything that decides
what the units draw and check (backend, examples, seed, tier, paths, the units
themselves). ``verify --resume`` takes the units found there as done and runs the
rest; a run without it starts its journal afresh. The failing cases of journaled
units stay where they were saved (``--failures``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

RUNS_DIR = os.path.join(".pallascheck", "verify-runs")

# one unit's result: its rows, failure messages and seconds
Result = tuple[list[Any], list[str], float]


def path(signature: Sequence[Any]) -> str:
    """The journal of the run that ``signature`` (its settings and unit keys) describes."""
    digest = hashlib.sha1(json.dumps([str(s) for s in signature]).encode()).hexdigest()[:16]
    return os.path.join(RUNS_DIR, f"{digest}.jsonl")


def start(journal: str) -> None:
    """Begin ``journal`` afresh (a run that does not resume)."""
    os.makedirs(os.path.dirname(journal), exist_ok=True)
    with open(journal, "w"):
        pass


def append(journal: str, key: str, result: Result) -> None:
    """Record a finished unit (one line, flushed: a run killed after it keeps it)."""
    rows, failures, seconds = result
    line = json.dumps(
        {"unit": key, "rows": [dataclasses.asdict(r) for r in rows], "failures": failures, "seconds": seconds}
    )
    os.makedirs(os.path.dirname(journal), exist_ok=True)
    with open(journal, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def load(journal: str, row: Callable[..., Any]) -> dict[str, Result]:
    """The units ``journal`` holds, by key, their rows rebuilt with ``row(**fields)``; a
    line cut short by the interruption is left out (that unit runs again)."""
    done: dict[str, Result] = {}
    try:
        with open(journal) as f:
            lines = f.read().splitlines()
    except OSError:  # no earlier run of these settings
        return done
    for line in lines:
        try:
            entry = json.loads(line)
            rows = [row(**fields) for fields in entry["rows"]]
            done[entry["unit"]] = (rows, list(entry["failures"]), float(entry["seconds"]))
        except (ValueError, KeyError, TypeError):
            continue
    return done
