"""A fuzz campaign's corpus: everything it found and did, on disk as it happens.

    CORPUS/campaign.json          the campaign's state: arms and their statistics,
                                  retired (kernel, dtype) pairs and checks, the next
                                  seed, seconds spent; rewritten atomically after
                                  every task, read by ``--resume``
    CORPUS/events.jsonl           one line per task (one worker run of one arm)
    CORPUS/cases.jsonl            one line per checked case: shapes, config, each
                                  check's budget used, error and bound
    CORPUS/failures/<signature>/  case.npz (``pallascheck replay`` re-runs it) and
                                  failure.json (kind, check, message, replay command,
                                  how often it was found)
    CORPUS/hypothesis/            Hypothesis' example database, so that a resumed
                                  campaign starts from the failing and best-scoring
                                  examples of the last
    CORPUS/probes/<kind>.json     the arithmetic probe of each device kind the
                                  campaign's workers ran on (``pallascheck probe``'s
                                  JSON and ``device_kind``), run once per kind and
                                  reused by --resume and later campaigns here
    CORPUS/workers/<n>/           the case each worker is running, saved before it
                                  runs: what a hang or a crash leaves behind

Failures are deduplicated by a signature: the kernel, dtype, check, failure kind
(value, crash, hang, oom) and the worst element's pattern (which output, whether
it was non-finite, on which axes it sat at the last index). Two occurrences of one
failure share it; the corpus keeps the first reproducer and counts the rest. The
failures of one bug in several checks and dtypes are grouped into one finding by the
report and fuzz's summary (``findings``), never merged here: each keeps its case.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Any, TextIO

from pallascheck.properties.checks import Worst

STATE = "campaign.json"
EVENTS = "events.jsonl"
CASES = "cases.jsonl"
FAILURES = "failures"
DATABASE = "hypothesis"
WORKERS = "workers"
PROBES = "probes"
FAILURE_KINDS = ("value", "crash", "hang", "oom")


def worst_pattern(worst: Worst | None) -> str:
    """Where a value failure is worst, coarsely enough that one bug keeps one pattern
    across shapes: the output's name, non-finite or not, and per axis whether the
    element sat at the last index (where tail and masking bugs put it)."""
    if worst is None:
        return "-"
    finite = worst.error is not None and worst.error != float("inf")
    axes = "".join("L" if n > 1 and i == n - 1 else "." for i, n in zip(worst.index, worst.shape))
    return f"{worst.name}:{'finite' if finite else 'nonfinite'}:{axes}"


def crash_pattern(message: str) -> str:
    """A crash's exception type and first line with numbers blanked, so that the same
    crash at another shape keeps its signature."""
    first = (message.strip().splitlines() or [""])[0]
    return re.sub(r"\d+", "N", first)[:200]


def headline(message: str) -> str:
    """What went wrong, in one line: a check's message starts with a line that repeats
    the check, kernel, dtype and backend ("[values] kernel=..."); the next line says
    where and by how much."""
    lines = (message or "").strip().splitlines()
    return lines[1].strip() if len(lines) > 1 and lines[0].startswith("[") else (lines or [""])[0]


def signature(kernel: str, dtype: str, check: str, kind: str, pattern: str) -> str:
    """A readable, filesystem-safe name for the failure class."""
    digest = hashlib.sha1("|".join((kernel, dtype, check, kind, pattern)).encode()).hexdigest()[:10]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{kind}-{check}-{kernel}-{dtype}")
    return f"{name}-{digest}"


def read_state(path: str) -> dict[str, Any] | None:
    """The campaign state saved in the corpus directory ``path``, None if there is
    none (the directory is not created)."""
    try:
        with open(os.path.join(path, STATE)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def probes(path: str) -> dict[str, dict[str, Any]]:
    """The probes kept in the corpus directory ``path``, by device kind (none if it has none)."""
    directory = os.path.join(path, PROBES)
    found = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                report = json.load(f)
            found[report["device_kind"]] = report
    return found


class Corpus:
    """The files of one campaign directory (created if missing)."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.join(path, FAILURES), exist_ok=True)
        self._logs: dict[str, TextIO] = {}

    def file(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    @property
    def database(self) -> str:
        return self.file(DATABASE)

    def worker_dir(self, worker: int) -> str:
        path = self.file(WORKERS, str(worker))
        os.makedirs(path, exist_ok=True)
        return path

    def load_state(self) -> dict[str, Any] | None:
        return read_state(self.path)

    def save_state(self, state: dict[str, Any]) -> None:
        """Written to a temporary file and renamed: a kill mid-write keeps the last state."""
        tmp = self.file(STATE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, self.file(STATE))

    def save_probe(self, device_kind: str, report: dict[str, Any]) -> None:
        """Keep the probe of ``device_kind``, written beside and renamed over (a kill
        mid-write keeps none, and the next campaign probes again)."""
        os.makedirs(self.file(PROBES), exist_ok=True)
        path = self.file(PROBES, re.sub(r"[^A-Za-z0-9_.-]+", "_", device_kind) + ".json")
        with open(path + ".tmp", "w") as f:
            json.dump(dict(report, device_kind=device_kind), f, indent=1)
        os.replace(path + ".tmp", path)

    def probes(self) -> dict[str, dict[str, Any]]:
        """The probes kept, by device kind."""
        return probes(self.path)

    def append(self, log: str, record: dict[str, Any]) -> None:
        """One JSON line, flushed at once (an interrupted campaign keeps every line)."""
        if log not in self._logs:
            self._logs[log] = open(self.file(log), "a")
        self._logs[log].write(json.dumps(record, default=str) + "\n")
        self._logs[log].flush()

    def close(self) -> None:
        for f in self._logs.values():
            f.close()
        self._logs.clear()

    def failures(self) -> dict[str, dict[str, Any]]:
        found = {}
        for name in sorted(os.listdir(self.file(FAILURES))):
            try:
                with open(self.file(FAILURES, name, "failure.json")) as f:
                    found[name] = json.load(f)
            except FileNotFoundError:  # a directory whose record was never finished
                continue
        return found

    def record_failure(self, record: dict[str, Any], case_path: str | None) -> tuple[dict[str, Any], bool]:
        """Keep a failure under its signature: the first finding's case (moved from
        ``case_path``) and record; a later finding of the same signature only counts.
        Returns (the stored record, whether it is new)."""
        directory = self.file(FAILURES, record["signature"])
        meta_path = os.path.join(directory, "failure.json")
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                stored = json.load(f)
            stored["count"] += 1
            new = False
        else:
            os.makedirs(directory, exist_ok=True)
            stored = dict(record, count=1)
            if case_path is not None and os.path.exists(case_path):
                shutil.move(case_path, os.path.join(directory, "case.npz"))
                stored["case"] = os.path.join(directory, "case.npz")
            new = True
        tmp = meta_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(stored, f, indent=1, default=str)
        os.replace(tmp, meta_path)
        return stored, new
