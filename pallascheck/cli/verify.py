"""``pallascheck verify``: every registered kernel's checks, a verdict per kernel."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from pallascheck.cli._common import (
    DEFAULT_FAILURE_DIR,
    UsageError,
    add_backend_option,
    add_cluster_option,
    add_target_options,
    at_least,
    chosen_backend,
    examples_help,
    fitting,
    join_cluster,
    positive,
    set_up,
    terminate_as_interrupt,
    workers_phrase,
)
from pallascheck.fuzz import cluster, import_path, plan, scope, targets, verify
from pallascheck.properties import runner, watchdog
from pallascheck.properties.families.collectives import PROPERTIES
from pallascheck.properties.outside import tokamax as tokamax_client
from pallascheck.properties.registry import (
    bundled_names,
    is_module_target,
    registry,
    selected,
)

# --strict, when everything checked passed and something asked for was not checked
STRICT_EXIT = 3
# a run interrupted (Ctrl-C, SIGTERM) with every check that finished passed: 128 + SIGINT,
# the shell's code for a command Ctrl-C stopped
INTERRUPTED_EXIT = 130


def run(args: argparse.Namespace) -> int:
    import_path.add_paths(args.path or ())
    known = set(registry()) | set(PROPERTIES) | set(bundled_names())
    unknown = sorted(n for n in set(args.kernel or ()) - known if not is_module_target(n))
    if set(unknown) & set(tokamax_client.TOKAMAX):
        raise SystemExit(
            f"pallascheck: the tokamax:* kernels check Tokamax, which is not installed: {tokamax_client.PIP}"
        )
    if unknown:
        raise UsageError("; ".join(f"--kernel: {targets.unknown_name(name, known)}" for name in unknown))
    try:  # a MODULE:NAME that does not import, or names no spec: one line saying what to change
        targets.check_names([n for n in args.kernel or () if is_module_target(n)])
    except ValueError as err:
        raise UsageError(str(err)) from None
    backend = chosen_backend(args.backend)
    specs = selected(args.kernel)
    try:
        not_checked = scope.dtypes(args.dtype or (), specs, backend)
    except ValueError as err:
        raise UsageError(str(err)) from None
    # The compilation cache and flags: only once every argument is checked. On a cluster
    # the units run where Ray places them: this machine needs the backend only to plan
    # production layouts with its own device.
    if not args.cluster or args.shapes == "production":
        set_up(backend)
    ray_cluster = join_cluster(args.cluster, backend)
    layouts = [l for spec in specs.values() for l in spec.production_layouts] if args.shapes == "production" else []
    unnamed: list[str] = []  # the selected kernels none of whose production layouts --layout names
    if args.layout is not None:
        if args.shapes != "production":
            raise UsageError("--layout names production layouts: add --shapes production")
        unnamed = [k for k, spec in specs.items() if not any(args.layout in l.name for l in spec.production_layouts)]
        if len(unnamed) == len(specs):
            raise UsageError(
                f"--layout: no production layout of the selected kernels is named {args.layout!r}; "
                f"they are: {'; '.join(l.name for l in layouts)}"
            )
    # at the production tier --examples counts per layout (every layout is checked)
    examples = args.examples or runner.default_examples(args.shapes)
    named = [l for l in layouts if args.layout is None or args.layout in l.name]
    # at the production tier on a GPU, without --jobs: workers by memory, per layout
    by_layout = (
        plan.jobs_by_layout(backend, named)
        if named and not args.jobs and not ray_cluster and backend.platform != "cpu"
        else None
    )
    jobs = (
        max(by_layout.values()) * max(1, len(plan.worker_gpus(backend)))  # a count a GPU, on each
        if by_layout
        else args.jobs or (ray_cluster.slots if ray_cluster else plan.default_jobs("verify", backend, args.shapes))
    )
    start = time.perf_counter()
    options = verify.Options(
        backend,
        examples,
        args.seed,
        args.failures,
        tuple(args.dtype or ()),
        args.shapes,
        tuple(args.path or ()),
        args.case_timeout or watchdog.case_timeout(args.shapes),
        args.cover_pairs,
    )
    missing = verify.not_on(backend, args.kernel)
    if missing:
        print(f"not on {backend} (no implementation; see docs/backends.md): {', '.join(missing)}")
    not_checked += [scope.NotChecked(k, "-", f"no implementation on {backend}") for k in missing]
    elsewhere = verify.distributed_elsewhere(backend, args.kernel)
    if elsewhere:
        where = (
            "they need 2 or more GPUs on one host"
            if backend.name == "mosaic_gpu"
            else "their GPU kernels are Mosaic GPU's (--backend mosaic_gpu); a CPU run checks them in the TPU interpreter"
        )
        print(f"distributed kernels not checked here ({where}): {', '.join(elsewhere)}")
    not_checked += [
        scope.NotChecked(k, "-", "distributed: needs --backend mosaic_gpu on 2+ GPUs, or a CPU run") for k in elsewhere
    ]
    if args.shapes == "production":  # on a cluster each worker has a device of its own
        # planned with the device whole where each group of units gets its own share
        plan.share_devices(backend, 1 if by_layout else jobs, on_cluster=ray_cluster is not None)
        if backend.is_interpreted:
            raise SystemExit(
                f"pallascheck: --shapes production needs a GPU backend ({backend} interprets the "
                "kernel: hours per case at these sizes); use --backend mosaic_gpu or triton"
            )
        untiered = verify.without_production(args.kernel)
        print(f"no production shape tier: {', '.join(untiered) or 'none'}")
        not_checked += [scope.NotChecked(k, "-", "no production shape tier") for k in untiered if k not in missing]
        kernels, skipped = fitting([n for n in specs if n not in missing], backend)
        not_checked += skipped
        not_checked += [
            scope.NotChecked(k, "-", "no production layout fits the device's memory")
            for k in specs
            if k not in kernels and k not in missing and k not in untiered
        ]
    else:
        kernels = args.kernel
    units = verify.plan(backend, kernels, args.dtype, args.shapes, examples, args.layout)
    if args.layout is not None:  # a kernel none of whose layouts --layout names: said, never silent
        not_checked += [
            scope.NotChecked(k, "-", f"--layout {args.layout!r} names none of its production layouts")
            for k in kernels or ()
            if k in unnamed
        ]
    jobs_of = {u: by_layout[u.layout] for u in units} if by_layout else None
    if jobs_of:
        print(plan.jobs_line(backend, {u.layout: jobs_of[u] for u in units}, list(jobs_of.values())))
    unfinished: list[verify.Unit] = []
    try:
        with terminate_as_interrupt():
            rows, failures = verify.run(units, options, jobs, ray_cluster, resume=args.resume, jobs_of=jobs_of)
    except verify.Interrupted as stop:  # what finished is printed and kept for --resume
        rows, failures, unfinished = stop.rows, stop.failures, stop.unfinished
        not_checked += verify.unfinished_not_checked(unfinished)
    finally:
        if ray_cluster is not None:
            cluster.disconnect()
    elapsed = time.perf_counter() - start
    not_checked += [scope.NotChecked(r.kernel, r.dtype, f"{r.check}: {r.note}") for r in rows if not r.checked]
    not_checked += [scope.NotChecked(k, d, f"code path not reached: {p}") for k, d, p in verify.unreached(rows)]
    not_checked += verify.pairs_not_checked(rows, args.cover_pairs)
    ok = all(r.passed for r in rows)
    checked = [r for r in rows if r.checked]
    examples = sum(r.examples for r in rows)
    print("\n" + verify.legend(args.full))
    if failures:
        print(
            f"\nFAILURES ({len(failures)}; each case saved under {args.failures}/ for pallascheck replay FILE"
            f"{verify.path_arguments(options.paths)}):"
            if args.failures
            else f"\nFAILURES ({len(failures)}):"
        )
        for message in failures:
            print("\n" + message)
    print(f"\n{'Every row' if args.full else 'Per kernel (--full: every kernel x dtype x check row)'}, failures first:")
    (verify.print_table if args.full else verify.print_summary)(rows)
    verify.print_coverage(rows)
    if args.durations:
        print(f"\nslowest {args.durations} kernel x dtype x check:")
        for r in verify.slowest(rows, args.durations):
            print(f"  {r.seconds:7.1f}s  {r.kernel} {r.dtype} {r.check}")
    scope.print_not_checked(not_checked, "check")
    verdict = ("PASS" if ok else "FAIL") if checked else "NOTHING CHECKED"
    if unfinished:
        print(
            f"\nINTERRUPTED with {len(unfinished)} of {len(units)} units unfinished (under NOT CHECKED): the same "
            "command with --resume runs only them"
        )
    print(
        f"\n{verdict}: {sum(r.passed for r in checked)}/{len(checked)} checks passed"
        + (f" - NOT CHECKED: {len(not_checked)} (above)" if not_checked else "")
        + f" on backend {backend} in {elapsed:.1f}s ({workers_phrase(jobs, ray_cluster)}; {examples} cases checked, "
        f"{examples / elapsed:.2f}/s)"
    )
    if args.json:
        import jax

        report = {
            "backend": str(backend),
            "jax": jax.__version__,
            "examples": examples,
            "jobs": jobs,
            "cluster": args.cluster,
            "seed": args.seed,
            "seconds": elapsed,
            "passed": ok,
            "complete": not not_checked,
            "interrupted": bool(unfinished),
            "not_checked": [dataclasses.asdict(item) for item in not_checked],
            "failures": failures,
            "rows": [verify.as_json(r) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if not ok:
        return 1
    if unfinished:  # before "nothing checked": stopped before any unit ended is still a stop
        return INTERRUPTED_EXIT
    if not checked:
        return 1
    if args.strict and not_checked:
        print(f"--strict: {len(not_checked)} asked for and not checked (above)")
        return STRICT_EXIT
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``pallascheck verify``."""
    verify = sub.add_parser(
        "verify",
        help="run every registered kernel's checks and print a verdict per kernel",
        description="Check every registered kernel (or those named) on one backend: values, gradients, "
        "determinism, configs agreeing, metamorphic relations and bad inputs, against the float64 oracle under "
        "the derived bound. Prints a legend, failures first, and one line per kernel; --full prints every "
        "kernel x dtype x check row. Exits 1 on any failure and saves each failing case for `pallascheck replay`.",
    )
    add_backend_option(verify)
    verify.add_argument(
        "--examples",
        type=at_least(1),
        default=None,
        help=examples_help("property", runner.HARDWARE_CASES_PER_LAYOUT)
        + f"; default {runner.EXAMPLES}, and at --shapes production {runner.PRODUCTION_EXAMPLES} per layout",
    )
    verify.add_argument(
        "--layout",
        default=None,
        help="with --shapes production: only the production layouts whose name contains this (default: every one)",
    )
    verify.add_argument("--seed", type=int, default=0, help="Hypothesis seed of every property")
    add_target_options(
        verify,
        "a registered name, or MODULE:NAME for a KernelSpec of an importable module (see "
        "--path); default: every registered kernel",
    )
    verify.add_argument(
        "--full", action="store_true", help="print every kernel x dtype x check row, not a line per kernel"
    )
    verify.add_argument("--json", help="also write every row as JSON to this path")
    verify.add_argument("--failures", default=DEFAULT_FAILURE_DIR, help="where failing cases are saved")
    verify.add_argument(
        "--jobs",
        type=at_least(1, " (leave --jobs out for the default)"),
        default=None,
        help="worker processes (default: every core on the CPU, three quarters of them on a GPU)",
    )
    add_cluster_option(verify, "the table")
    verify.add_argument(
        "--case-timeout",
        type=positive,
        default=None,
        help="seconds one case may take (its compiles included) before it is reported as a hang (default "
        f"{watchdog.CASE_TIMEOUT_S:g}, at --shapes production {watchdog.PRODUCTION_CASE_TIMEOUT_S:g})",
    )
    verify.add_argument(
        "--cover-pairs",
        action="store_true",
        help="after the budgeted draws, draw for every pair of each spec's declared parameters they missed "
        "(config x causal, config x input kind, ...): every pair checked, at about 3x the cases and time on "
        "the CPU; without it the pairs missed are counted under NOT CHECKED",
    )
    verify.add_argument(
        "--resume",
        action="store_true",
        help="take the units that an interrupted run of the same command finished as done (each finished unit is "
        "kept under .pallascheck/verify-runs/), and run only the rest",
    )
    verify.add_argument(
        "--strict",
        action="store_true",
        help=f"exit {STRICT_EXIT} when anything asked for was not checked (a kernel, dtype, layout or check; listed "
        "under NOT CHECKED), even if every check that ran passed",
    )
    verify.add_argument(
        "--durations", type=int, default=0, help="also list the N slowest kernel x dtype x check rows (0: none)"
    )
    verify.set_defaults(func=run)
