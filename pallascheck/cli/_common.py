"""What the subcommands share: the backend option and its set-up, the target options,
the help formatter, progress lines, and the production tier's fitting."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from pallascheck.fuzz import plan, scope
from pallascheck.kernels import backends
from pallascheck.kernels.backends import NAMES, Backend
from pallascheck.properties import runner
from pallascheck.properties.device import compilation

DEFAULT_FAILURE_DIR = ".pallascheck/failures"


def add_backend_option(
    parser: argparse.ArgumentParser, default: str = "$PALLASCHECK_BACKEND or interpret", extra: str = ""
) -> None:
    """``--backend``, declared once for every subcommand."""
    parser.add_argument(
        "--backend",
        default=None,
        help=f"one of {NAMES} (tpu_interpret:SEED; gpu = mosaic_gpu); default {default}{extra}",
    )


def available_backend(name: str | None) -> Backend:
    """The chosen backend, set up for this run; exits at once, saying what is needed,
    where it is no backend or cannot run here."""
    try:
        backend = scope.backend(name)
    except ValueError as err:
        raise SystemExit(f"pallascheck: {err}") from None
    compilation.configure(backend)
    try:
        backend.require_available()
    except RuntimeError as err:
        raise SystemExit(f"pallascheck: {err}") from None
    return backend


def fitting(names: list[str], backend: Backend) -> tuple[list[str], list[scope.NotChecked]]:
    """``names`` whose production layouts fit the memory each process may use
    (``plan.fitting``, its lines printed), and the layouts not checked; exits, saying
    why, where none does."""
    kept, lines, skipped = plan.fitting(names, backend)
    for line in lines:
        print(line)
    if names and not kept:
        raise SystemExit(
            "pallascheck: nothing to check: no selected kernel has a production layout that fits "
            f"{backend}'s memory (above)"
        )
    return kept, skipped


def progress_printer() -> Callable[[str], None]:
    """A live line on a terminal; a line every 30 s in a log."""
    if sys.stderr.isatty():
        return lambda line: print("\r" + line, end="", file=sys.stderr, flush=True)
    last = [0.0]

    def to_log(line: str) -> None:
        if time.monotonic() - last[0] >= 30.0:
            last[0] = time.monotonic()
            print(line, file=sys.stderr, flush=True)

    return to_log


def examples_help(unit: str, on_hardware: dict[str, int]) -> str:
    return (
        f"Hypothesis examples per kernel x dtype {unit}, each a layout (shapes, config) checking "
        f"{runner.CASES_PER_LAYOUT} cases in the interpreters ({runner.CALLBACK_CASES_PER_LAYOUT} in "
        f"{' and '.join(backends.CALLBACK_INTERPRETERS)}), {on_hardware['small']} on a GPU "
        f"({on_hardware['production']} at --shapes production) that share one compiled kernel (the meaning "
        "of pytest's --examples too)"
    )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default where it is a value; an option whose default is None
    or off says in its help what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def add_target_options(parser: argparse.ArgumentParser, kernel_help: str) -> None:
    """What verify and fuzz check: the shape tier, the kernels, where MODULE:NAME
    kernels come from, the dtypes."""
    parser.add_argument(
        "--shapes",
        choices=runner.SHAPE_TIERS,
        default="small",
        help="shape tier: small (fast, reaches every code path) or production (real model sizes, "
        "GPU backends; layouts that do not fit the device are skipped, saying so)",
    )
    parser.add_argument("--kernel", action="append", help=f"only this kernel (repeatable): {kernel_help}")
    parser.add_argument("--path", action="append", help="a directory to import MODULE:NAME kernels from (repeatable)")
    parser.add_argument("--dtype", action="append", help="only this dtype (repeatable); default: each kernel's dtypes")
