"""The ``pallascheck`` command: one module a subcommand.

    pallascheck verify [--backend B] [--examples N] [--kernel K ...] [--dtype D ...] [--jobs N] [--json PATH]
    pallascheck fuzz [--backend B] [--minutes M] [--jobs N] [--kernel K ...] [--corpus DIR] [--resume]
    pallascheck mutate --kernel K [--path DIR] [--backend B] [--examples N] [--budget S] [--jobs N]
    pallascheck replay FILE.npz [--backend B] [--path DIR] [--repeat N]
    pallascheck report CORPUS [--out DIR]
    pallascheck bench [--backend B] [--op FAMILY] [--check-time K | --dispatch-stress K] [--json PATH]
    pallascheck probe [--backend B] [--json PATH]
    pallascheck autotune --workload W [--size small|bench|production] [--dtype D] [--backend B ...] [--out PATH]

The command sits at the top of the dependency chain (kernels -> oracles -> properties
-> bench, fuzz -> the face); each subcommand's module declares its options
(``add_parser``) and runs it (``run``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from pallascheck.cli import autotune, bench, fuzz, probe, replay, report, verify
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


if __name__ == "__main__":
    sys.exit(main())
