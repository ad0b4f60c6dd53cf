"""``pallascheck probe``: the backend's dot arithmetic against the tolerance model's assumptions."""

from __future__ import annotations

import argparse
import os

from pallascheck.bench import probe
from pallascheck.cli._common import add_backend_option, available_backend


def run(args: argparse.Namespace) -> int:
    report = probe.run(available_backend(args.backend))
    probe.print_table(report)
    path = args.json or os.path.join(".pallascheck", f"probe-{report.backend.replace(':', '-')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(report.as_json())
    print(f"written to {path}")
    return 1 if any(report.violations.values()) else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``pallascheck probe``."""
    probe = sub.add_parser(
        "probe", help="measure the backend's dot arithmetic and check the tolerance model's assumptions"
    )
    add_backend_option(probe)
    probe.add_argument("--json", help="where the measurements go (default .pallascheck/probe-BACKEND.json)")
    probe.set_defaults(func=run)
