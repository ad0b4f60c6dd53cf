"""``python -m studies.harness``: the harness's own speed on this machine.

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
from collections.abc import Sequence
from typing import Any


def _timed(command: Sequence[str], env: dict[str, str], cwd: str | None = None) -> tuple[float, int]:
    start = time.perf_counter()
    code = subprocess.run(
        list(command), env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    ).returncode
    return time.perf_counter() - start, code


def run(*, pytest_too: bool, examples: int, tests_dir: str | None) -> list[dict[str, Any]]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pallascheck-harness-") as tmp:
        if pytest_too:
            env = dict(os.environ, PALLASCHECK_CACHE_DIR=os.path.join(tmp, "pytest-cache"))
            cwd = os.path.dirname(os.path.abspath(tests_dir)) if tests_dir else None
            seconds, code = _timed(
                [sys.executable, "-m", "pytest", "-n", "auto", "-q", "-p", "no:cacheprovider"]
                + ([tests_dir] if tests_dir else []),
                env,
                cwd,
            )
            rows.append({"run": "pytest -n auto (cold cache)", "seconds": seconds, "exit": code})
        env = dict(os.environ, PALLASCHECK_CACHE_DIR=os.path.join(tmp, "verify-cache"))
        for label in ("cold", "warm"):
            report = os.path.join(tmp, f"verify-{label}.json")
            seconds, code = _timed(
                [
                    sys.executable,
                    "-m",
                    "pallascheck",
                    "verify",
                    "--examples",
                    str(examples),
                    "--json",
                    report,
                    "--durations",
                    "0",
                ],
                env,
            )
            with open(report) as f:
                checked = sum(r["examples"] for r in json.load(f)["rows"])
            rows.append(
                {
                    "run": f"pallascheck verify --examples {examples} ({label} cache)",
                    "seconds": seconds,
                    "exit": code,
                    "examples": checked,
                    "examples_per_s": checked / seconds,
                    "examples_per_s_per_core": checked / seconds / cores,
                }
            )
    for row in rows:
        rate = (
            f"  {row['examples']} examples, {row['examples_per_s']:.2f}/s ({row['examples_per_s_per_core']:.2f}/s per core)"
            if "examples" in row
            else ""
        )
        print(f"{row['run']:48s} {row['seconds']:7.1f}s  exit {row['exit']}{rate}")
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m studies.harness [--no-pytest] [--examples N] [--tests DIR] [--json PATH]``"""
    import argparse
    import json
    import os

    import jax

    parser = argparse.ArgumentParser(
        prog="python -m studies.harness", description="time the harness itself: pytest, cold and warm verify"
    )
    parser.add_argument("--no-pytest", action="store_true", help="time verify only")
    parser.add_argument("--examples", type=int, default=6, help="verify's --examples")
    parser.add_argument("--tests", default="tests", help="the test directory pytest runs")
    parser.add_argument("--json", help="also write the results as JSON")
    args = parser.parse_args(argv)
    rows = run(pytest_too=not args.no_pytest, examples=args.examples, tests_dir=args.tests)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "cores": os.cpu_count(), "rows": rows}, f, indent=2)
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
