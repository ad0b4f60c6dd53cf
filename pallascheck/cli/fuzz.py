"""``pallascheck fuzz``: a campaign that searches for inputs that break kernels."""

from __future__ import annotations

import argparse

from pallascheck.bench import probe
from pallascheck.cli._common import (
    UsageError,
    add_backend_option,
    add_cluster_option,
    add_target_options,
    at_least,
    available_backend,
    chosen_backend,
    examples_help,
    fitting,
    join_cluster,
    positive,
    progress_printer,
    terminate_as_interrupt,
    workers_phrase,
)
from pallascheck.fuzz import campaign, cluster, corpus, findings, import_path, plan, scope, targets, verify
from pallascheck.properties import check_kinds, runner, watchdog
from pallascheck.properties.registry import bundled_names, registry


def run(args: argparse.Namespace) -> int:
    import_path.add_paths(args.path or ())
    try:  # a typo creates nothing: no corpus directory, no compilation cache, no workers
        targets.check_names(args.kernel or ())
    except ValueError as err:
        raise UsageError(str(err)) from None
    # On a cluster Ray places each worker on a node with its resource (a GPU): the
    # driver needs the backend only where it plans production layouts with its own GPU.
    needs_backend_here = not args.cluster or args.shapes == "production"
    backend = available_backend(args.backend) if needs_backend_here else chosen_backend(args.backend)
    # a resumed campaign keeps its tier and kernels: the memory rule below must see them
    saved = corpus.read_state(args.corpus) if args.resume else None
    shapes = saved.get("shapes", args.shapes) if saved else args.shapes
    if args.kernel:
        named = list(args.kernel)
    elif args.resume:
        named = list((saved or {}).get("targets", []))
    else:
        named = list(registry())
    missing = verify.not_on(backend, [n for n in named if n in registry() or n in bundled_names()])
    if missing:
        print(f"not on {backend} (no implementation): {', '.join(missing)}")
    named = [n for n in named if n not in missing]
    not_checked = [scope.NotChecked(k, "-", f"no implementation on {backend}") for k in missing]
    if shapes == "production" and not args.kernel and not saved and named:  # every kernel: those with a production tier
        untiered = verify.without_production(named)
        print(f"no production shape tier: {', '.join(untiered) or 'none'}")
        named = [n for n in named if n not in untiered]
        not_checked += [scope.NotChecked(k, "-", "no production shape tier") for k in untiered]
    ray_cluster = join_cluster(args.cluster, backend)
    jobs = args.jobs or (ray_cluster.slots if ray_cluster else plan.default_jobs("fuzz", backend, shapes))
    if backend.platform != "cpu":  # workers round-robin the GPUs; on a cluster, Ray gives each its own
        plan.share_devices(backend, jobs, on_cluster=ray_cluster is not None)
        if shapes == "production":
            named, skipped_layouts = fitting(named, backend)
            not_checked += skipped_layouts
    memory = int(args.memory_gb * 2**30) if args.memory_gb else plan.default_memory_bytes(jobs)
    mode = "random draws" if args.random else "targeted search"
    print(
        f"fuzzing {', '.join(named) or 'the saved targets'} on {backend} for {args.minutes:g} min "
        f"({mode}, {workers_phrase(jobs, ray_cluster)}); corpus {args.corpus}/",
        flush=True,
    )
    progress = progress_printer()
    try:
        with terminate_as_interrupt():
            result = campaign.run(
                named,
                backend,
                args.corpus,
                seconds=60.0 * args.minutes,
                tasks=args.tasks,
                examples=args.examples,
                jobs=jobs,
                targeted=not args.random,
                dtypes=args.dtype,
                paths=args.path or (),
                first_seed=args.seed,
                resume=args.resume,
                limits=campaign.Limits(args.case_timeout or watchdog.case_timeout(shapes), memory),
                progress=progress,
                shapes=shapes,
                layout_cases=args.cases,
                cluster=ray_cluster,
                shared_database=args.redis,
                probe=probe.device_report,
                notify=lambda line: print(line, flush=True),
            )
    except ValueError as err:
        raise SystemExit(f"pallascheck: {err}") from None
    finally:
        if ray_cluster is not None:
            cluster.disconnect()
    status = "interrupted" if result.interrupted else "done"
    grouped = findings.group(result.new_failures)
    print(
        f"\n{status}: {result.tasks} tasks, {result.cases} cases in {result.seconds:.0f} s; "
        f"{len(grouped)} new findings ({len(result.new_failures)} new failures), "
        f"{result.repeats} repeats of known ones"
    )
    for kind, tally in sorted(result.devices.items()):
        print(
            f"  on {kind}: {tally.tasks} tasks, {tally.cases} cases, {tally.new_failures} new failures, "
            f"best budget used {tally.best_budget:.3g}"
        )
    if result.requeued:
        print(f"{result.requeued} tasks in flight on nodes that left the cluster were run again on others")
    if result.stopped_in_flight:
        when = "at the interrupt" if result.interrupted else f"{campaign.OVERRUN_S:.0f} s after the time given"
        print(
            f"{result.stopped_in_flight} tasks still running {when} were stopped; the failures they had saved are "
            "booked unminimised"
        )
    for finding in grouped:
        print(f"\n{findings.title(finding)}: {corpus.headline(finding['members'][0]['message'])}")
        for found in finding["members"]:
            print(f"  {found['dtype']} [{found['check']}] replay: {found['replay']}")
    not_checked += [
        scope.NotChecked(k, d, "no task in this run (give it more --minutes or --tasks, or fewer --kernel)")
        for k, d in result.never_tried
    ]
    not_checked += [
        scope.NotChecked(
            f"every kernel on {kind}",
            "-",
            f"{', '.join(c for c in check_kinds.CHECKS if c not in check_kinds.UNBOUNDED)} not run: the probe found "
            f"the tolerance model does not hold there ({'; '.join(arith.violations)})",
        )
        for kind, arith in sorted(result.arithmetic.items())
        if not arith.modelled
    ]
    scope.print_not_checked(not_checked, "task")
    print(f"\nreport: pallascheck report {args.corpus}")
    if result.interrupted:
        return 130
    return 1 if result.new_failures else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``pallascheck fuzz``."""
    fuzz = sub.add_parser(
        "fuzz",
        help="search for inputs that break kernels, keeping every failure once",
        description="Run tasks (one Hypothesis run of --examples cases of one kernel, dtype, input kind and config "
        "slot) in worker processes until the time is up. Targeted (default): Hypothesis climbs toward the inputs "
        "that use the most of their error bound and a bandit spends the next task where that budget climbs. A hang "
        "(no progress for --case-timeout s), a crash or a worker above --memory-gb becomes a saved reproducer and "
        "the worker is restarted. Failures are shrunk, deduplicated by signature and saved under CORPUS/failures/ "
        "with a replay command; --resume continues a campaign where it stopped.",
    )
    add_backend_option(fuzz)
    fuzz.add_argument(
        "--minutes", type=positive, default=10.0, help="how long the campaign runs (tasks in flight finish)"
    )
    fuzz.add_argument(
        "--tasks",
        type=at_least(1),
        default=None,
        help="start at most this many tasks (a run bounded by work; --minutes still ends it)",
    )
    fuzz.add_argument(
        "--jobs",
        type=at_least(1, " (leave --jobs out for the default)"),
        default=None,
        help="worker processes (default: every core; on a GPU backend at --shapes production one "
        "per GPU; the workers take the GPUs in turn, each seeing its own)",
    )
    fuzz.add_argument(
        "--examples", type=at_least(1), default=8, help=examples_help("task", runner.CAMPAIGN_HARDWARE_CASES_PER_LAYOUT)
    )
    fuzz.add_argument(
        "--cases",
        type=at_least(1),
        default=None,
        help="cases per Hypothesis example, all of its one compiled layout (default: as --examples "
        "says). A layout's first case pays its compiles (about 15 s at --shapes production on "
        "an H100) and each later one about a second there: more cases per layout is a soak's "
        "volume, fewer is more layouts and configs per minute (a search). A resumed campaign "
        "keeps its own unless given",
    )
    fuzz.add_argument("--seed", type=int, default=1000, help="the first task's Hypothesis seed (then +1 per task)")
    add_target_options(
        fuzz,
        "a registered name, or MODULE:NAME for a KernelSpec (or a VARIANTS entry) of an importable module (see --path)",
    )
    fuzz.add_argument("--corpus", default=".pallascheck/corpus", help="where reproducers, logs and state go")
    fuzz.add_argument("--resume", action="store_true", help="continue the campaign saved in --corpus")
    fuzz.add_argument(
        "--random", action="store_true", help="untargeted: the pairs in turn, unpinned draws (the baseline, and a soak)"
    )
    fuzz.add_argument(
        "--case-timeout",
        type=positive,
        default=None,
        help="seconds a worker may go without progress (a case, or a task's first compile) before it counts as hung "
        f"(default {watchdog.CASE_TIMEOUT_S:g}, at --shapes production {watchdog.PRODUCTION_CASE_TIMEOUT_S:g})",
    )
    fuzz.add_argument(
        "--memory-gb",
        type=float,
        default=0.0,
        help="resident memory per worker before it counts as out of memory (default: 3/4 of the "
        "machine's, shared among the jobs)",
    )
    add_cluster_option(fuzz, "the corpus")
    fuzz.add_argument(
        "--redis",
        metavar="URL",
        type=redis_url,
        default=None,
        help="Hypothesis' example database shared by every worker (redis://HOST:PORT[/DB]), so that a "
        "failure shrunk on one node is replayed first on the others",
    )
    fuzz.set_defaults(func=run)


def redis_url(value: str) -> str:
    """``--redis``: a redis:// URL (what redis.Redis.from_url reads)."""
    if not value.startswith(("redis://", "rediss://", "unix://")):
        raise argparse.ArgumentTypeError(f"must be a redis://HOST:PORT URL, got {value!r}")
    return value
