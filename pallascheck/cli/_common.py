"""What the subcommands share: the usage error and the number rules every command's
options follow, the backend option and its set-up, the target options, ``--cluster``,
the help formatter, progress lines, and the production tier's fitting."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from pallascheck.fuzz import cluster, plan, scope
from pallascheck.kernels import backends
from pallascheck.kernels.backends import NAMES, Backend
from pallascheck.properties import runner
from pallascheck.properties.device import compilation

DEFAULT_FAILURE_DIR = ".pallascheck/failures"


class UsageError(SystemExit):
    """A user's mistake, found before anything is created: one line naming the argument,
    the rule and the fix. ``cli.main`` prints it and exits 2; raised past ``main`` (a
    study calling a subcommand's pieces) it is a SystemExit whose message is the line."""


def at_least(minimum: int, hint: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum`` (argparse names the option in its
    one-line error, before the command runs)."""

    def parse(text: str) -> int:
        value = int(text)  # a ValueError: argparse's "invalid int value"
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}{hint}")
        return value

    parse.__name__ = "int"
    return parse


def positive(text: str) -> float:
    """An argparse ``type``: a number of seconds or minutes, > 0."""
    value = float(text)  # a ValueError: argparse's "invalid float value"
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


positive.__name__ = "float"


def add_backend_option(
    parser: argparse.ArgumentParser, default: str = "$PALLASCHECK_BACKEND or interpret", extra: str = ""
) -> None:
    """``--backend``, declared once for every subcommand."""
    parser.add_argument(
        "--backend",
        default=None,
        help=f"one of {NAMES} (tpu_interpret:SEED; gpu = mosaic_gpu); default {default}{extra}",
    )


def chosen_backend(name: str | None) -> Backend:
    """The backend ``--backend`` names (None: $PALLASCHECK_BACKEND or interpret), set up
    for nothing yet; a UsageError with the close matches where it is no backend."""
    try:
        return scope.backend(name)
    except ValueError as err:
        raise UsageError(str(err)) from None


def set_up(backend: Backend) -> Backend:
    """``backend`` set up for this run (the compilation cache, XLA's flags); exits at
    once, saying what is needed, where it cannot run here."""
    compilation.configure(backend)
    try:
        backend.require_available()
    except RuntimeError as err:
        raise UsageError(str(err)) from None
    return backend


def available_backend(name: str | None) -> Backend:
    """The chosen backend, set up for this run (``chosen_backend``, then ``set_up``)."""
    return set_up(chosen_backend(name))


def add_cluster_option(parser: argparse.ArgumentParser, stays: str) -> None:
    """``--cluster ADDRESS``, declared once for fuzz, verify and mutate; ``stays``: what
    stays with the command on this machine."""
    parser.add_argument(
        "--cluster",
        metavar="ADDRESS",
        default=None,
        help="run the workers on the Ray cluster at ADDRESS (host:port of its head, as `ray start --head` "
        "prints; 'local': start one on this machine): one per CPU core on the interpreter backends, one per "
        f"GPU on a GPU backend; {stays} stays here (docs/cluster.md; needs the cluster extra)",
    )


def join_cluster(address: str | None, backend: Backend) -> cluster.Cluster | None:
    """The Ray cluster ``--cluster`` names, joined (None without ``--cluster``); a
    UsageError saying what is missing where it cannot be."""
    if address is None:
        return None
    try:
        return cluster.connect(address, backend)
    except ValueError as err:
        raise UsageError(str(err)) from None


def workers_phrase(jobs: int, joined: cluster.Cluster | None) -> str:
    """Where the work runs, for a command's opening line."""
    if joined is None:
        return f"{jobs} job{'s' * (jobs != 1)}"
    return f"{jobs} workers on the Ray cluster at {joined.address} ({joined.nodes} node{'s' * (joined.nodes != 1)})"


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


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (``timeout``, a batch system's stop) raises KeyboardInterrupt, as Ctrl-C
    does, while the block runs: a long command then ends as an interrupted one, printing
    and keeping what finished, instead of dying silent. The handler before is restored
    after; off the main thread (where Python takes no handler) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> NoReturn:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


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

    def error(self, message: str) -> NoReturn:
        """One line, exit 2: what is wrong and where the options are listed (argparse
        would print the usage first)."""
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


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
    parser.add_argument(
        "--dtype",
        action="append",
        type=scope.canonical_dtype,
        help="only this dtype (repeatable; aliases such as bf16, e4m3, e5m2 accepted); default: each kernel's dtypes",
    )
