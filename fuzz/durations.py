"""What earlier runs on this machine took, and the time left estimated from it.

One home for the estimate that verify and mutate print: each command keeps the
seconds its tasks took in ``.pallascheck/<command>-durations.json`` (keys are the
command's own: verify's ``BACKEND:UNIT``, mutate's settings digest and mutant source),
opens with a plan line, and ends each progress line with the time elapsed and left.
"""

from __future__ import annotations

import json
import os
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Literal

Command = Literal["verify", "mutate"]


def path(command: Command) -> str:
    return os.path.join(".pallascheck", f"{command}-durations.json")


def load(command: Command) -> dict[str, float]:
    """The seconds each task took when it last ran here, by the command's key."""
    try:
        with open(path(command)) as f:
            data = json.load(f)
        return {str(k): float(v) for k, v in data.items()}
    except (OSError, ValueError, AttributeError, TypeError):  # first run, or a file from elsewhere
        return {}


def save(command: Command, durations: Mapping[str, float]) -> None:
    """Merge ``durations`` into the command's file (written whole, then renamed: a
    concurrent run reads the old file or the new one, never half of one)."""
    merged = {**load(command), **durations}
    target = path(command)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(merged, f, indent=1, sort_keys=True)
    os.replace(tmp, target)


def seconds_left[Task: Hashable](
    pending: Iterable[Task], known: Mapping[Task, float], samples: Sequence[float], jobs: int
) -> float:
    """Seconds of work left over ``jobs`` workers: each pending task at its earlier
    run's duration where this machine has one (``known``), else at the mean of the
    ``samples`` (the tasks finished so far; the known durations before any has)."""
    typical_of = list(samples) or list(known.values())
    typical = sum(typical_of) / len(typical_of) if typical_of else 0.0
    return sum(known.get(task, typical) for task in pending) / max(jobs, 1)


def plan_line(command: Command, tasks: str, jobs: int, known: int, total: int, estimate: float) -> str:
    """The opening line: what runs on how many jobs, and how long it should take when
    every task's earlier duration is known (else how many are, and that the estimate
    follows the first results)."""
    when = (
        f"about {estimate:.0f} s from this machine's earlier runs"
        if known == total
        else f"earlier durations known for {known} of {total}: the estimate follows the first results"
    )
    return f"{command}: {tasks} on {jobs} job{'s' * (jobs != 1)}; {when}"


def progress_suffix(elapsed: float, left: float) -> str:
    """The end of a progress line: the time elapsed and about how much is left."""
    return f"({elapsed:.0f} s elapsed, about {left:.0f} s left)"
