"""``pallascheck mutate``: what a kernel's checks cannot see.

pallascheck mutate --kernel K [--kernel K2 ...] [--module MOD] [--path DIR] [--backend B] [--examples N] [--dtype D]
                   [--budget S] [--seed N] [--jobs N] [--operator OP] [--function REGEX]
                   [--max-mutants N] [--mutant ID] [--out PATH] [--resume] [--list] [--fail-under PCT]
                   [--cluster ADDRESS]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

from pallascheck.cli._common import (
    add_backend_option,
    add_cluster_option,
    at_least,
    available_backend,
    chosen_backend,
    join_cluster,
    terminate_as_interrupt,
    workers_phrase,
)
from pallascheck.fuzz import cluster, import_path, plan, targets
from pallascheck.fuzz.mutation import operators, run

STATUSES = (run.KILLED, run.EQUIVALENT, run.SURVIVED, run.UNREACHED, run.NOT_RUN)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "mutate",
        help="mutation testing: plant kernel-aware bugs in a kernel and see which its checks catch",
        description="Parse the kernel's module, write single-point mutants of it with kernel-aware operators "
        "(" + ", ".join(operators.OPERATORS) + "), and run the spec's checks on each mutant in its own worker "
        "process, on the same draws as the unmutated kernel (which must pass). Reports the mutation score "
        "(killed / non-equivalent), each killed mutant's check and cases to kill, and each survivor as a diff. "
        "A mutant whose outputs are bitwise equal to the unmutated kernel's on every case drawn is equivalent "
        "and left out of the score; one on a line no case runs is 'unreached' and counts as a survivor.",
    )
    p.add_argument(
        "--kernel",
        required=True,
        action="append",
        help="the spec: a registered name, or MODULE:NAME for a KernelSpec of an importable module "
        "(see --path); repeatable, for specs of one module (e.g. layer_norm and rms_norm): a mutant "
        "dies when any of them kills it",
    )
    p.add_argument(
        "--module", help="the kernel module to mutate (default: the module of the function the spec's kernel calls)"
    )
    p.add_argument("--path", action="append", help="a directory to import MODULE:NAME specs from (repeatable)")
    add_backend_option(p)
    p.add_argument(
        "--examples",
        type=at_least(1),
        default=3,
        help="Hypothesis examples per spec and dtype, as verify counts them (verify's default)",
    )
    p.add_argument("--dtype", action="append", help="only this dtype (repeatable; default the spec's)")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the whole run; mutants not started by then are reported as not run",
    )
    p.add_argument("--seed", type=int, default=0, help="the Hypothesis seed of every run (verify's default)")
    p.add_argument(
        "--jobs", type=int, default=0, help="worker processes (default: every core on the CPU; a cluster's slots)"
    )
    p.add_argument(
        "--operator", action="append", choices=sorted(operators.OPERATORS), help="only this operator (repeatable)"
    )
    p.add_argument(
        "--function",
        help="only mutants in functions whose dotted name matches this regex (e.g. '_backward_kernel|store_output')",
    )
    p.add_argument("--max-mutants", type=int, default=None, help="a sample of this many mutants (drawn with --seed)")
    p.add_argument(
        "--mutant",
        type=int,
        action="append",
        help="only the mutant with this number, as --list numbers them (repeatable; e.g. a run's survivors "
        "again at a larger --examples)",
    )
    p.add_argument(
        "--case-timeout",
        type=float,
        default=None,
        help="seconds a mutant may go without progress before it counts as hung (default: "
        f"{run.CASE_TIMEOUT_FACTOR:g}x the baseline's slowest step, at least {run.MIN_CASE_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--memory-gb",
        type=float,
        default=0.0,
        help="resident memory per worker before it counts as out of memory (default: 3/4 of the "
        "machine's, shared among the jobs)",
    )
    p.add_argument(
        "--out", help="the JSON-lines results, written as they arrive (default .pallascheck/mutate/KERNEL.jsonl)"
    )
    p.add_argument("--resume", action="store_true", help="reuse the results already in --out for the same settings")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    add_cluster_option(p, "the results file")
    p.add_argument(
        "--fail-under", type=float, default=None, help="exit 1 if the mutation score (percent) is below this"
    )
    p.set_defaults(func=run_command)


def _display(path: str) -> str:
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def run_command(args: argparse.Namespace) -> int:
    # on a cluster the workers run where Ray places them, each with its device
    backend = chosen_backend(args.backend) if args.cluster else available_backend(args.backend)
    import_path.add_paths(args.path or ())
    try:
        specs = [targets.resolve(name) for name in args.kernel]
        modules = sorted({args.module or run.kernel_module(spec) for spec in specs})
        if len(modules) > 1:
            raise ValueError(
                f"the specs call kernels of different modules {modules}: name the one to mutate with --module"
            )
        module = modules[0]
        origin = run.module_origin(module)
        if args.function:
            re.compile(args.function)
    except (KeyError, ValueError, ImportError, re.error) as err:
        raise SystemExit(f"pallascheck: {err}") from None
    units: list[tuple[str, str]] = []
    for name, spec in zip(args.kernel, specs):
        if not spec.runs_on(backend):
            raise SystemExit(
                f"pallascheck: {name} has no implementation on {backend} (it runs on {list(spec.backends)})"
            )
        dtypes = list(spec.dtypes_for(backend))
        unknown = sorted(set(args.dtype or ()) - set(dtypes))
        if unknown:
            raise SystemExit(f"pallascheck: --dtype must be among {dtypes} for {name} on {backend}, got {unknown}")
        units += [(name, d) for d in dtypes if not args.dtype or d in args.dtype]
    with open(origin) as f:
        original = f.read()
    shown = _display(origin)
    try:
        mutants = operators.generate(
            original,
            path=origin,
            operators=args.operator,
            function=args.function,
            max_mutants=args.max_mutants,
            seed=args.seed,
        )
    except ValueError as err:
        raise SystemExit(f"pallascheck: {err}") from None
    if args.mutant:
        missing = sorted(set(args.mutant) - {m.id for m in mutants})
        if missing:
            raise SystemExit(f"pallascheck: --mutant {missing}: no such mutant (see --list)")
        mutants = [m for m in mutants if m.id in args.mutant]
    if args.list:
        for m in mutants:
            print(m.label)
        print(f"{len(mutants)} mutants of {module} ({shown})")
        return 0
    if not mutants:
        raise SystemExit(f"pallascheck: no mutants of {shown} with these --operator / --function choices")
    if args.jobs < 0 or (args.budget is not None and args.budget <= 0):
        raise SystemExit("pallascheck: --jobs must be >= 0 and --budget > 0")
    ray_cluster = join_cluster(args.cluster, backend)
    jobs = args.jobs or (ray_cluster.slots if ray_cluster else plan.default_jobs("mutate", backend))
    out = args.out or os.path.join(".pallascheck", "mutate", re.sub(r"[^\w.-]+", "_", "+".join(args.kernel)) + ".jsonl")
    settings = run.Settings(
        units=tuple(units),
        module=module,
        origin=origin,
        backend=str(backend),
        examples=args.examples,
        seed=args.seed,
        jobs=jobs,
        memory_bytes=int(args.memory_gb * 2**30) if args.memory_gb else plan.default_memory_bytes(jobs),
        out=out,
        paths=tuple(args.path or ()),
        budget_s=args.budget,
        case_timeout_s=args.case_timeout,
    )
    print(
        f"mutating {module} ({shown}): {len(mutants)} mutants, checked on {backend} by "
        f"{', '.join(' '.join(u) for u in units)} ({args.examples} Hypothesis examples each), seed {args.seed}, {workers_phrase(jobs, ray_cluster)}; "
        f"results in {out}",
        flush=True,
    )
    try:
        with terminate_as_interrupt():
            result = run.run(
                settings,
                mutants,
                original,
                shown,
                resume=args.resume,
                progress=lambda line: print(line, file=sys.stderr, flush=True),
                cluster=ray_cluster,
            )
    except run.BaselineFailure as err:
        print(f"\nFAIL: {err}\nNo score: fix the false alarm (or the kernel) first.")
        return 1
    finally:
        if ray_cluster is not None:
            cluster.disconnect()
    print_report(result, original, shown, settings)
    if result.interrupted:
        return 130
    score = result.score
    if args.fail_under is not None and (score is None or 100.0 * score < args.fail_under):
        print(f"\nFAIL: mutation score below {args.fail_under:g}%")
        return 1
    return 0


def summary_line(result: run.Result) -> str:
    counts = ", ".join(f"{result.count(s)} {s}" for s in STATUSES)
    score = result.score
    judged = result.count(run.KILLED) + result.count(run.SURVIVED) + result.count(run.UNREACHED)
    shown = (
        f"{100.0 * score:.1f}% ({result.count(run.KILLED)}/{judged})" if score is not None else "none (nothing judged)"
    )
    return f"{len(result.outcomes)} mutants: {counts}; mutation score {shown}"


def print_report(result: run.Result, original: str, path: str, settings: run.Settings) -> None:
    import jax

    by_operator: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for o in result.outcomes:
        by_operator[o.mutant.operator][o.status] += 1
    print(f"\n{summary_line(result)}")
    print("(equivalent and not-run mutants are left out of the score; unreached ones count as survivors)")
    print(
        f"time {result.seconds:.0f} s (baseline {result.baseline_seconds:.0f} s) on {settings.jobs} jobs, "
        f"{os.cpu_count()} CPU cores, jax {jax.__version__}, backend {settings.backend}"
        + (" - interrupted" if result.interrupted else "")
    )
    header = ("operator", "mutants", *STATUSES)
    rows = [(op, str(sum(c.values())), *(str(c[s]) for s in STATUSES)) for op, c in sorted(by_operator.items())]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print()
    for line in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))
    killed = [o for o in result.outcomes if o.status == run.KILLED]
    if killed:
        print("\nkilled (check, spec and dtype, cases it took, time):")
        for o in killed:
            print(
                f"  {o.mutant.label}\n      {o.check} ({' '.join(o.unit or ())}) after {o.cases} case{'s' * (o.cases != 1)}, "
                f"{o.seconds:.1f} s"
            )
    for status, why in (
        (run.SURVIVED, "passed every check with different outputs"),
        (run.UNREACHED, "no case drawn runs its line"),
    ):
        survivors = [o for o in result.outcomes if o.status == status]
        if survivors:
            print(f"\n{status} ({why}):")
            for o in survivors:
                print(
                    f"  {o.mutant.label}"
                    + (f"\n      ({o.message})" if o.message else "")
                    + "\n"
                    + "".join(f"      {line}\n" for line in o.mutant.diff(original, path).splitlines())
                )
    equivalent = [o for o in result.outcomes if o.status == run.EQUIVALENT]
    if equivalent:
        print(
            "\nequivalent (bitwise the unmutated kernel's outputs on every case drawn; a real bug among them is "
            "one the draws never exercise):"
        )
        for o in equivalent:
            print(f"  {o.mutant.label}")
    not_run = [o for o in result.outcomes if o.status == run.NOT_RUN]
    if not_run:
        print(
            f"\nnot run ({'interrupted' if result.interrupted else 'over --budget'}): "
            + ", ".join(f"#{o.mutant.id}" for o in not_run)
        )
