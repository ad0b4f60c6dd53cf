"""``pallascheck bench --harness``: the harness's own speed on this machine.

Times, each in a fresh process with its own compilation cache directory:
``pytest -n auto`` (cold cache), ``pallascheck verify`` with a cold cache, and the same
verify again with the cache it just filled (warm). Prints the wall times and the
check examples per second (and per core) that verify reports.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence


def _timed(command: Sequence[str], env: dict[str, str], cwd: str | None = None) -> tuple[float, int]:
    start = time.perf_counter()
    code = subprocess.run(list(command), env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    return time.perf_counter() - start, code


def run(*, pytest_too: bool, examples: int, tests_dir: str | None) -> list[dict[str, Any]]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pallascheck-harness-") as tmp:
        if pytest_too:
            env = dict(os.environ, PALLASCHECK_CACHE_DIR=os.path.join(tmp, "pytest-cache"))
            cwd = os.path.dirname(os.path.abspath(tests_dir)) if tests_dir else None
            seconds, code = _timed([sys.executable, "-m", "pytest", "-n", "auto", "-q", "-p", "no:cacheprovider"] +
                                   ([tests_dir] if tests_dir else []), env, cwd)
            rows.append({"run": "pytest -n auto (cold cache)", "seconds": seconds, "exit": code})
        env = dict(os.environ, PALLASCHECK_CACHE_DIR=os.path.join(tmp, "verify-cache"))
        for label in ("cold", "warm"):
            report = os.path.join(tmp, f"verify-{label}.json")
            seconds, code = _timed([sys.executable, "-m", "pallascheck.fuzz.cli", "verify", "--examples",
                                    str(examples), "--json", report, "--durations", "0"], env)
            with open(report) as f:
                checked = sum(r["examples"] for r in json.load(f)["rows"])
            rows.append({"run": f"pallascheck verify --examples {examples} ({label} cache)", "seconds": seconds,
                         "exit": code, "examples": checked, "examples_per_s": checked / seconds,
                         "examples_per_s_per_core": checked / seconds / cores})
    for row in rows:
        rate = f"  {row['examples']} examples, {row['examples_per_s']:.2f}/s ({row['examples_per_s_per_core']:.2f}/s per core)" if "examples" in row else ""
        print(f"{row['run']:48s} {row['seconds']:7.1f}s  exit {row['exit']}{rate}")
    return rows
