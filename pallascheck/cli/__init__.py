"""The ``pallascheck`` command: one module a subcommand.

    pallascheck verify [--backend B] [--examples N] [--kernel K ...] [--dtype D ...] [--jobs N] [--json PATH]
    pallascheck fuzz [--backend B] [--minutes M] [--jobs N] [--kernel K ...] [--corpus DIR] [--resume]
    pallascheck mutate --kernel K [--path DIR] [--backend B] [--examples N] [--budget S] [--jobs N]
    pallascheck replay FILE.npz [--backend B] [--path DIR] [--repeat N]
    pallascheck report CORPUS [--out DIR]
    pallascheck bench [--backend B] [--op FAMILY] [--check-time K | --dispatch-stress K] [--json PATH]
    pallascheck probe [--backend B] [--json PATH]
    pallascheck gate TASK CANDIDATE [--backend B] [--seed S] [--drawn N] [--json PATH]
    pallascheck autotune --workload W [--size small|bench|production] [--dtype D] [--backend B ...] [--out PATH]

The command sits at the top of the dependency chain (kernels -> oracles -> properties
-> bench, fuzz -> the face); each subcommand's module declares its options
(``add_parser``) and runs it (``run``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pallascheck.cli._common import _Parser


# The console script's module is imported again by every worker process that
# multiprocessing spawns (verify's, fuzz's, mutate's workers): importing the
# subcommands here would import every kernel there, before a mutation worker installs
# its mutant (and slow each worker's start). They load on first use.


def build_parser() -> _Parser:
    from pallascheck.cli import command

    return command.build_parser()


def main(argv: Sequence[str] | None = None) -> int:
    from pallascheck.cli import command

    return command.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
