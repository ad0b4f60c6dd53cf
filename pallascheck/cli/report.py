"""``pallascheck report``: an HTML page and JSON summarising a fuzz campaign's corpus."""

from __future__ import annotations

import argparse
import os

from pallascheck.fuzz import report


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.corpus):
        raise SystemExit(f"pallascheck report: CORPUS {args.corpus!r} is not a directory")
    for path in report.write(args.corpus, args.out):
        print(path)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``pallascheck report CORPUS [--out DIR]`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "report",
        help="write an HTML page and JSON summarising a fuzz campaign's corpus",
        description="Read a fuzz corpus (campaign.json, events.jsonl, cases.jsonl, failures/) and write "
        "report.html (self-contained: failures with replay commands, budget used per kernel and dtype, "
        "error vs bound, coverage, throughput) and report.json (the same numbers). Safe on a corpus that "
        "is empty or still being written.",
    )
    parser.add_argument("corpus", metavar="CORPUS", help="the campaign's corpus directory (pallascheck fuzz --corpus)")
    parser.add_argument(
        "--out", metavar="DIR", default=None, help="where report.html and report.json go (default: CORPUS)"
    )
    parser.set_defaults(func=run)
