"""``pallascheck probe``: the backend's dot arithmetic against the tolerance model's assumptions."""

from __future__ import annotations

import argparse
import json
import os

from pallascheck.bench import probe, probe_fp8
from pallascheck.cli._common import add_backend_option, available_backend


def run(args: argparse.Namespace) -> int:
    backend = available_backend(args.backend)
    report = probe.run(backend)
    probe.print_table(report)
    fp8 = probe_fp8.run(backend, emulation_cases=args.emulation_cases)
    print()
    probe_fp8.print_table(fp8)
    path = args.json or os.path.join(".pallascheck", f"probe-{report.backend.replace(':', '-')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(report.as_dict(fp8), indent=1))
    print(f"written to {path}")
    return 1 if any(report.violations.values()) or any(fp8["violations"].values()) else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``pallascheck probe``."""
    probe = sub.add_parser(
        "probe", help="measure the backend's dot arithmetic and check the tolerance model's assumptions"
    )
    add_backend_option(probe)
    probe.add_argument("--json", help="where the measurements go (default .pallascheck/probe-BACKEND.json)")
    probe.add_argument(
        "--emulation-cases",
        type=int,
        default=0,
        help="random FP8 tile pairs on which the wgmma is compared bit for bit with the emulated fused sum "
        "(0: none; 300 on a GPU is 1.2M outputs)",
    )
    probe.set_defaults(func=run)
