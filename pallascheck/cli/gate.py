"""``pallascheck gate TASK CANDIDATE``: the verdict on a candidate kernel for a task."""

from __future__ import annotations

import argparse

from pallascheck.bench.gate.judge import gate
from pallascheck.bench.gate.task import load_task, shipped_tasks
from pallascheck.cli._common import UsageError, add_backend_option, at_least, available_backend, positive
from pallascheck.fuzz import import_path, scope


def run(args: argparse.Namespace) -> int:
    try:
        task = load_task(args.task)
        if args.dtype:
            unknown = [d for d in args.dtype if d not in task.dtypes]
            if unknown:
                raise ValueError(
                    f"--dtype {unknown[0]!r} is not among task {task.name}'s dtypes: "
                    f"{scope.did_you_mean(unknown[0], list(task.dtypes))}"
                )
    except ValueError as err:
        raise UsageError(f"pallascheck gate: {err}") from None
    import_path.add_paths(args.path or [])
    backend = available_backend(args.backend)
    verdict = gate(
        task,
        args.candidate,
        backend=backend,
        seed=args.seed,
        drawn=args.drawn,
        examples=args.examples,
        stop_at_first=not args.all_checks,
        budget_s=args.budget,
        dtypes=args.dtype,
    )
    print(verdict.summary())
    if args.json:
        with open(args.json, "w") as f:
            f.write(verdict.dumps())
    return 0 if verdict.passed else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``pallascheck gate``."""
    p = sub.add_parser(
        "gate",
        help="judge a candidate kernel for a task: pass, fail or invalid, each reason named (exit 0 on pass)",
    )
    p.add_argument("task", help=f"a shipped task ({', '.join(shipped_tasks())}) or a task file FILE.py")
    p.add_argument("candidate", help="FILE.py:NAME or MODULE:NAME, a function taking the task's inputs")
    add_backend_option(p)
    p.add_argument("--path", action="append", help="a directory to import MODULE:NAME from (repeatable)")
    p.add_argument(
        "--dtype",
        action="append",
        type=scope.canonical_dtype,
        help="only this of the task's dtypes (repeatable; aliases such as bf16 accepted); default: all of them",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn sizes and values")
    p.add_argument("--drawn", type=at_least(0), default=2, help="sizes drawn beyond the shown ones")
    p.add_argument("--examples", type=at_least(1), default=1, help="Hypothesis examples per checked layout")
    p.add_argument("--all-checks", action="store_true", help="run every stage, not only up to the first failure")
    p.add_argument("--budget", type=positive, help="seconds after which no further layout is started (listed)")
    p.add_argument("--json", help="also write the verdict as JSON")
    p.set_defaults(func=run)
