"""``pallascheck verify``: every registered kernel's checks, a verdict per kernel."""

from __future__ import annotations

import argparse
import json
import time

from pallascheck.cli._common import (
    DEFAULT_FAILURE_DIR,
    add_backend_option,
    add_target_options,
    available_backend,
    examples_help,
    fitting,
)
from pallascheck.fuzz import plan, targets, verify
from pallascheck.properties import runner, watchdog
from pallascheck.properties.families.collectives import PROPERTIES
from pallascheck.properties.outside import tokamax as tokamax_client
from pallascheck.properties.registry import (
    bundled_names,
    is_module_target,
    registry,
    selected,
)


def run(args: argparse.Namespace) -> int:
    targets.add_paths(args.path or ())
    known = set(registry()) | set(PROPERTIES) | set(bundled_names())
    unknown = sorted(n for n in set(args.kernel or ()) - known if not is_module_target(n))
    if set(unknown) & set(tokamax_client.TOKAMAX):
        raise SystemExit(
            f"pallascheck: the tokamax:* kernels check Tokamax, which is not installed: {tokamax_client.PIP}"
        )
    if unknown:
        raise SystemExit("pallascheck: " + "; ".join(targets.unknown_name(name, known) for name in unknown))
    backend = available_backend(args.backend)
    jobs = args.jobs or plan.default_jobs("verify", backend)
    start = time.perf_counter()
    options = verify.Options(
        backend,
        args.examples,
        args.seed,
        args.failures,
        tuple(args.dtype or ()),
        args.shapes,
        tuple(args.path or ()),
        args.case_timeout,
    )
    missing = verify.not_on(backend, args.kernel)
    if missing:
        print(f"not on {backend} (no implementation; see docs/backends.md): {', '.join(missing)}")
    elsewhere = verify.distributed_elsewhere(backend, args.kernel)
    if elsewhere:
        print(
            f"checked by a CPU run (pallascheck verify), in the TPU interpreter on CPU devices: {', '.join(elsewhere)}"
        )
    if args.shapes == "production":
        plan.share_devices("verify", backend, jobs)
        if backend.is_interpreted:
            raise SystemExit(
                f"pallascheck: --shapes production needs a GPU backend ({backend} interprets the "
                "kernel: hours per case at these sizes); use --backend mosaic_gpu or triton"
            )
        print(f"no production shape tier: {', '.join(verify.without_production(args.kernel)) or 'none'}")
        kernels = fitting([n for n in selected(args.kernel) if n not in missing], backend)
    else:
        kernels = args.kernel
    units = verify.plan(backend, kernels, args.dtype, args.shapes, args.examples)
    rows, failures = verify.run(units, options, jobs)
    elapsed = time.perf_counter() - start
    ok = all(r.passed for r in rows)
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
    if args.durations:
        print(f"\nslowest {args.durations} kernel x dtype x check:")
        for r in verify.slowest(rows, args.durations):
            print(f"  {r.seconds:7.1f}s  {r.kernel} {r.dtype} {r.check}")
    print(
        f"\n{'PASS' if ok else 'FAIL'}: {sum(r.passed for r in rows)}/{len(rows)} checks passed "
        f"on backend {backend} in {elapsed:.1f}s ({jobs} jobs; {examples} cases checked, "
        f"{examples / elapsed:.2f}/s)"
    )
    if args.json:
        import jax

        report = {
            "backend": str(backend),
            "jax": jax.__version__,
            "examples": args.examples,
            "jobs": jobs,
            "seed": args.seed,
            "seconds": elapsed,
            "passed": ok,
            "failures": failures,
            "rows": [verify.as_json(r) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


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
        "--examples", type=int, default=3, help=examples_help("property", runner.HARDWARE_CASES_PER_LAYOUT)
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
        type=int,
        default=0,
        help="worker processes (default: every core on the CPU, three quarters of them on a GPU)",
    )
    verify.add_argument(
        "--case-timeout",
        type=float,
        default=watchdog.CASE_TIMEOUT_S,
        help="seconds one case may take (its compiles included) before it is reported as a hang",
    )
    verify.add_argument(
        "--durations", type=int, default=0, help="also list the N slowest kernel x dtype x check rows (0: none)"
    )
    verify.set_defaults(func=run)
