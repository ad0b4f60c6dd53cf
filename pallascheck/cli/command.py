"""The command's parser and its one error boundary: every subcommand's module,
imported here (``pallascheck.cli`` imports this module on first use)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from pallascheck.cli import autotune, bench, fuzz, gate, probe, replay, report, verify
from pallascheck.cli._common import _Parser

try:  # mutate parses kernels with libcst; without it (a --no-deps install) the rest still runs
    from pallascheck.cli import mutate
except ModuleNotFoundError as _missing:
    if _missing.name != "libcst":
        raise
    mutate = None  # type: ignore[assignment]

DESCRIPTION = (
    "pallascheck: correctness and numerics checks for Pallas (JAX) kernels. Each kernel's output is compared "
    "with a float64 oracle under an error bound derived from its dtype, reduction lengths and accumulation "
    "order; Hypothesis draws the inputs, adversarial ones included. Start with `pallascheck verify`."
)


def _version() -> str:
    try:
        return version("pallascheck")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown (not installed)"


def build_parser() -> _Parser:
    parser = _Parser(prog="pallascheck", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"pallascheck {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    verify.add_parser(sub)
    fuzz.add_parser(sub)
    replay.add_parser(sub)
    report.add_parser(sub)
    if mutate is not None:
        mutate.add_parser(sub)
    else:
        sub.add_parser("mutate", help="needs libcst (pip install libcst)")  # listed; main() says what to do
    bench.add_parser(sub)
    probe.add_parser(sub)
    autotune.add_parser(sub)
    gate.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if mutate is None and argv[:1] == ["mutate"]:
        raise SystemExit("pallascheck mutate parses kernels with libcst, which is not installed: pip install libcst")
    # The one error boundary: a user's mistake (an option's rule, broken by argparse's
    # types in _common; a name, file or path a subcommand refuses with UsageError before
    # it creates anything) ends in one line on stderr and exit 2.
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except SystemExit as stop:
        if isinstance(stop.code, str):  # a message: argparse's own exits carry a number
            message = " ".join(stop.code.split())
            print(message if message.startswith("pallascheck") else f"pallascheck: {message}", file=sys.stderr)
            stop.code = 2
        raise
