"""The ``pallascheck`` command.

    pallascheck verify [--backend B] [--examples N] [--kernel K ...] [--dtype D ...] [--jobs N] [--json PATH]
                       [--case-timeout S]
    pallascheck fuzz [--backend B] [--minutes M] [--jobs N] [--kernel K ...] [--dtype D ...] [--corpus DIR]
                     [--resume] [--random] [--case-timeout S] [--memory-gb G]
    pallascheck replay FILE.npz [--backend B] [--path DIR] [--repeat N]
    pallascheck report CORPUS [--out DIR]
    pallascheck bench [--backend B] [--op FAMILY] [--json PATH]
    pallascheck bench --harness [--no-pytest]
    pallascheck bench --tolerance-rules [--tests DIR] [--examples N] [--json PATH]
    pallascheck bench --time-to-find [--backend B [--shapes small|production]] [--tests DIR] [--limit S] [--jobs N]
                      [--variant V ...] [--json PATH]
    pallascheck bench --tokamax-autotune [--backend mosaic_gpu] [--op dot_product_attention|ragged_dot] [--json PATH [--resume]]
    pallascheck probe [--backend B] [--json PATH]
    pallascheck autotune --workload W [--size small|bench|production] [--dtype D] [--backend B ...] [--out PATH]

The command lives in ``fuzz`` because it sits at the top of the dependency chain
(kernels -> oracles -> properties -> bench, fuzz).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Sequence

from pallascheck.kernels.backends import NAMES, Backend, get_backend
from pallascheck.properties import checks, compilation, runner, watchdog
from pallascheck.properties.spec import Case, bundled_names, is_module_target, registry, selected

from . import corpus, report, verify

try:  # mutate parses kernels with libcst; without it (a --no-deps install) the rest still runs
    from .mutation import command as mutate
except ModuleNotFoundError as _missing:
    if _missing.name != "libcst":
        raise
    mutate = None

DEFAULT_FAILURE_DIR = ".pallascheck/failures"


def cmd_verify(args: argparse.Namespace) -> int:
    from pallascheck.properties import tokamax_client
    from pallascheck.properties.collectives_checks import PROPERTIES

    from . import targets

    targets.add_paths(args.path or ())
    known = set(registry()) | set(PROPERTIES) | set(bundled_names())
    unknown = sorted(n for n in set(args.kernel or ()) - known if not is_module_target(n))
    if set(unknown) & set(tokamax_client.TOKAMAX):
        raise SystemExit(f"pallascheck: the tokamax:* kernels check Tokamax, which is not installed: {tokamax_client.PIP}")
    if unknown:
        raise SystemExit("pallascheck: " + "; ".join(targets.unknown_name(name, known) for name in unknown))
    backend = _available_backend(args.backend)
    jobs = args.jobs or verify.default_jobs(str(backend))
    start = time.perf_counter()
    options = verify.Options(str(backend), args.examples, args.seed, args.failures, tuple(args.dtype or ()),
                             args.shapes, tuple(args.path or ()), args.case_timeout)
    missing = verify.not_on(str(backend), args.kernel)
    if missing:
        print(f"not on {backend} (no implementation; see docs/backends.md): {', '.join(missing)}")
    elsewhere = verify.distributed_elsewhere(str(backend), args.kernel)
    if elsewhere:
        print(f"checked by a CPU run (pallascheck verify), in the TPU interpreter on CPU devices: "
              f"{', '.join(elsewhere)}")
    if args.shapes == "production":
        from pallascheck.properties import production

        production.share_devices(jobs)  # verify's workers all use the first device
        if backend.is_interpreted:
            raise SystemExit(f"pallascheck: --shapes production needs a GPU backend ({backend} interprets the "
                             "kernel: hours per case at these sizes); use --backend mosaic_gpu or triton")
        print(f"no production shape tier: {', '.join(verify.without_production(args.kernel)) or 'none'}")
        kernels = _fitting([n for n in selected(args.kernel) if n not in missing], backend)
    else:
        kernels = args.kernel
    units = verify.plan(str(backend), kernels, args.dtype, args.shapes, args.examples)
    rows, failures = verify.run(units, options, jobs)
    elapsed = time.perf_counter() - start
    ok = all(r.passed for r in rows)
    examples = sum(r.examples for r in rows)
    print("\n" + verify.legend(args.full))
    if failures:
        print(f"\nFAILURES ({len(failures)}; each case saved under {args.failures}/ for pallascheck replay FILE"
              f"{verify.path_arguments(options.paths)}):"
              if args.failures else f"\nFAILURES ({len(failures)}):")
        for message in failures:
            print("\n" + message)
    print(f"\n{'Every row' if args.full else 'Per kernel (--full: every kernel x dtype x check row)'}, "
          "failures first:")
    (verify.print_table if args.full else verify.print_summary)(rows)
    if args.durations:
        print(f"\nslowest {args.durations} kernel x dtype x check:")
        for r in verify.slowest(rows, args.durations):
            print(f"  {r.seconds:7.1f}s  {r.kernel} {r.dtype} {r.check}")
    print(f"\n{'PASS' if ok else 'FAIL'}: {sum(r.passed for r in rows)}/{len(rows)} checks passed "
          f"on backend {backend} in {elapsed:.1f}s ({jobs} jobs; {examples} cases checked, "
          f"{examples / elapsed:.2f}/s)")
    if args.json:
        import jax

        report = {
            "backend": str(backend), "jax": jax.__version__, "examples": args.examples, "jobs": jobs,
            "seed": args.seed, "seconds": elapsed, "passed": ok, "failures": failures,
            "rows": [verify.as_json(r) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


def _available_backend(name: str | None) -> Backend:
    """The chosen backend, set up for this run; exits at once, saying what is needed,
    where it cannot run here."""
    backend = get_backend(name)
    compilation.configure(str(backend))
    try:
        backend.require_available()
    except RuntimeError as err:
        raise SystemExit(f"pallascheck: {err}") from None
    return backend


def cmd_fuzz(args: argparse.Namespace) -> int:
    from . import campaign, targets

    targets.add_paths(args.path or ())
    try:  # a typo creates nothing: no corpus directory, no compilation cache, no workers
        targets.check_names(args.kernel or ())
    except ValueError as err:
        raise SystemExit(f"pallascheck: {err}") from None
    backend = _available_backend(args.backend)
    # a resumed campaign keeps its tier and kernels: the memory rule below must see them
    saved = corpus.read_state(args.corpus) if args.resume else None
    shapes = saved.get("shapes", args.shapes) if saved else args.shapes
    if args.kernel:
        named = list(args.kernel)
    elif args.resume:
        named = list((saved or {}).get("targets", []))
    else:
        named = list(registry())
    missing = verify.not_on(str(backend), [n for n in named if n in registry() or n in bundled_names()])
    if missing:
        print(f"not on {backend} (no implementation): {', '.join(missing)}")
    named = [n for n in named if n not in missing]
    if shapes == "production" and not args.kernel and not saved and named:  # every kernel: those with a production tier
        untiered = verify.without_production(named)
        print(f"no production shape tier: {', '.join(untiered) or 'none'}")
        named = [n for n in named if n not in untiered]
    jobs = args.jobs or campaign.default_jobs(backend, shapes)
    if backend.platform != "cpu":
        from pallascheck.properties import production

        production.share_devices(-(-jobs // max(campaign.gpu_devices(backend), 1)))  # workers round-robin the GPUs
        if shapes == "production":
            named = _fitting(named, backend)
    memory = int(args.memory_gb * 2**30) if args.memory_gb else campaign.default_memory_bytes(jobs)
    mode = "random draws" if args.random else "targeted search"
    print(f"fuzzing {', '.join(named) or 'the saved targets'} on {backend} for {args.minutes:g} min "
          f"({mode}, {jobs} jobs); corpus {args.corpus}/", flush=True)
    progress = _progress_printer()
    try:
        result = campaign.run(
            named, backend, args.corpus, seconds=60.0 * args.minutes, examples=args.examples, jobs=jobs,
            targeted=not args.random, dtypes=args.dtype, paths=args.path or (), first_seed=args.seed,
            resume=args.resume, limits=campaign.Limits(args.case_timeout, memory), progress=progress,
            shapes=shapes, layout_cases=args.cases,
        )
    except ValueError as err:
        raise SystemExit(f"pallascheck: {err}") from None
    status = "interrupted" if result.interrupted else "done"
    print(f"\n{status}: {result.tasks} tasks, {result.cases} cases in {result.seconds:.0f} s; "
          f"{len(result.new_failures)} new failures, {result.repeats} repeats of known ones")
    if result.stopped_in_flight:
        print(f"{result.stopped_in_flight} tasks still running {campaign.OVERRUN_S:.0f} s after the time given were "
              "stopped; the failures they had saved are booked unminimised")
    for found in result.new_failures:
        print(f"\n[{found['kind']}] {found['kernel']} {found['dtype']} [{found['check']}]: "
              f"{corpus.headline(found['message'])}"
              f"\n  replay: {found['replay']}")
    print(f"\nreport: pallascheck report {args.corpus}")
    if result.interrupted:
        return 130
    return 1 if result.new_failures else 0


def _fitting(names: list[str], backend: Backend) -> list[str]:
    """``names`` whose production layouts fit the memory each process may use
    (``production.planned``, its lines printed); exits, saying why, where none does."""
    from pallascheck.properties import production

    kept, lines = production.planned(names, backend)
    for line in lines:
        print(line)
    if names and not kept:
        raise SystemExit("pallascheck: nothing to check: no selected kernel has a production layout that fits "
                         f"{backend}'s memory (above)")
    return kept


def _progress_printer() -> Callable[[str], None]:
    """A live line on a terminal; a line every 30 s in a log."""
    if sys.stderr.isatty():
        return lambda line: print("\r" + line, end="", file=sys.stderr, flush=True)
    last = [0.0]

    def to_log(line: str) -> None:
        if time.monotonic() - last[0] >= 30.0:
            last[0] = time.monotonic()
            print(line, file=sys.stderr, flush=True)
    return to_log


def cmd_replay(args: argparse.Namespace) -> int:
    from . import targets

    targets.add_paths(args.path or ())
    case = Case.load(args.file)
    meta: dict[str, Any] = dict(case.params).pop("__failure__")
    params = {k: v for k, v in case.params.items() if k != "__failure__"}
    case = Case(case.arrays, params)
    spec = targets.resolve(meta["kernel"])
    backend = _available_backend(args.backend or meta["backend"])
    config_type = type(spec.default_config_for(get_backend(meta["backend"])))
    config = config_type(**meta["config"]) if isinstance(meta["config"], dict) else meta["config"]
    # The check that failed is the one replayed (a crash, hang or oom: every check), so
    # that the header and the verdict speak of the same check.
    selected = (meta["check"],) if meta["check"] in runner.CHECKS else runner.CHECKS
    print(f"replaying {meta['kernel']} {meta['dtype']} [{meta['check']}] on {backend}: {case.describe()}; config={config}")
    if meta["check"] in ("hang", "crash", "oom"):
        print(f"this case was saved when its worker was lost or the kernel raised ({meta['check']}): "
              f"{meta['message']}", flush=True)
    context = checks.Context(kernel=spec.name, dtype=meta["dtype"], backend=str(backend), replay=f"pallascheck replay {args.file}")
    failed = 0
    for run in range(args.repeat):
        if args.repeat > 1:
            print(f"run {run + 1} of {args.repeat}:", flush=True)
        failed += not _replay_once(spec, case, config, backend, context, selected)
    if args.repeat > 1:
        verdict = ("it fails every time" if failed == args.repeat else "it never fails" if not failed else
                   "intermittent: the same case, config and program pass and fail (state kept between calls, "
                   "a race, or the hardware)")
        print(f"failed {failed} of {args.repeat} runs in this process: {verdict}")
    return 1 if failed else 0


def _replay_once(spec: Any, case: Case, config: Any, backend: Any, context: checks.Context,
                 selected: tuple[str, ...]) -> bool:
    """One check of the replayed case, its verdict printed; returns whether it passed."""
    try:
        tally = runner.check_case(spec, case, config, backend, context=context, selected=selected)
    except checks.CheckFailure as failure:
        print(f"FAIL [{runner.failed_check(failure)}]\n{failure}")
        return False
    except Exception as crash:  # noqa: BLE001 - the kernel raised: the finding a crash case records
        print(f"FAIL [crash]\n  {type(crash).__name__}: {crash}")
        return False
    print("PASS: " + ", ".join(f"{k} (budget {verify.fmt_budget(o.budget_used)})" for k, o in tally.outcomes.items()))
    return True


def cmd_bench(args: argparse.Namespace) -> int:
    import jax

    if args.tolerance_rules:
        from pallascheck.bench import tolerance_rules

        results = tolerance_rules.run(args.tests, args.examples)
        tolerance_rules.print_report(results)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"summary": tolerance_rules.summary(results),
                           "results": [vars(r) for r in results]}, f, indent=1)
        return 0
    if args.time_to_find:
        from pallascheck.bench import time_to_find

        backend = _available_backend(args.backend) if args.backend else None
        if args.shapes == "production" and (backend is None or backend.platform == "cpu"):
            raise SystemExit("pallascheck: --time-to-find --shapes production needs a GPU backend: add --backend "
                             "mosaic_gpu (or triton)")
        rows = time_to_find.run(args.tests, limit=args.limit, jobs=args.jobs, only=args.variant,
                                modes=tuple(args.mode or time_to_find.MODES), backend=backend, shapes=args.shapes)
        result = time_to_find.summary(rows, args.limit)
        print("\n" + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"jax": jax.__version__, "cores": os.cpu_count(), "jobs": args.jobs, "shapes": args.shapes,
                           "device": jax.devices()[0].device_kind, "summary": result, "rows": rows}, f, indent=1)
        return 0
    if args.check_time:
        from pallascheck.bench import check_time

        backend = _available_backend(args.backend or "mosaic_gpu")
        result = check_time.run(args.check_time, backend, dtype=args.dtype, layout=args.layout, cases=args.cases)
        print(f"{args.check_time} {args.dtype} on {result['device']} (jax {result['jax']}): first case "
              f"{result['first_seconds']:.2f} s, then median {result['median_seconds_after_first'] or 0:.2f} s; "
              f"peak device memory {(result['peak_device_bytes'] or 0) / 2**30:.1f} GiB")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 0
    if args.dispatch_stress:
        from pallascheck.bench import dispatch_stress
        from pallascheck.properties.spec import get_spec

        backend = _available_backend(args.backend or "mosaic_gpu")
        try:
            result = dispatch_stress.run(
                get_spec(args.dispatch_stress), backend, dtype=args.dtype, layout=args.layout, cases=args.cases,
                seconds=args.seconds, threads=args.threads, shapes=args.shapes, inputs=args.inputs,
                reference=args.reference)
        except ValueError as err:
            raise SystemExit(f"pallascheck: {err}") from None
        print(f"{result['kernel']} {result['dtype']} on {result['device']} (jax {result['jax']}), {result['shapes']}:")
        for name, calls in result["calls"].items():
            print(f"  {name}: {calls} calls" + (" alongside" if name == "oracle" else
                                                f", {result['mismatches'][name]} whose bits differ from the call alone"))
        for note in result["notes"]:
            print(f"  {note}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return 1 if any(result["mismatches"].values()) else 0
    if args.harness:
        from pallascheck.bench import harness

        rows = harness.run(pytest_too=not args.no_pytest, examples=args.examples, tests_dir=args.tests)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"jax": jax.__version__, "cores": os.cpu_count(), "rows": rows}, f, indent=2)
        return 0 if all(r["exit"] == 0 for r in rows) else 1
    if args.tokamax_autotune:
        from pallascheck.bench import tokamax_autotune

        backend = _available_backend(args.backend or "mosaic_gpu")
        results = tokamax_autotune.run(backend, args.op, args.json, resume=args.resume)
        return 1 if any(op.get("pick_rejected") for r in results for op in r["ops"]) else 0
    from pallascheck.bench import ops as bench

    backend = _available_backend(args.backend or "mosaic_gpu")
    print(f"benchmark on {backend}: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    rows = bench.run(backend, args.op)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": str(backend), "device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=2)
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from pallascheck.bench import probe

    report = probe.run(_available_backend(args.backend))
    probe.print_table(report)
    path = args.json or os.path.join(".pallascheck", f"probe-{report.backend.replace(':', '-')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(report.as_json())
    print(f"written to {path}")
    return 1 if any(report.violations.values()) else 0


def cmd_autotune(args: argparse.Namespace) -> int:
    from pallascheck.bench import autotune
    from pallascheck.bench.autotune_workloads import WORKLOADS
    from pallascheck.properties import strategies

    backends = [str(_available_backend(b)) for b in args.backend] if args.backend else autotune.default_backends()
    interpreted = [b for b in backends if get_backend(b).is_interpreted]
    if args.size == "production" and interpreted:
        raise SystemExit(f"pallascheck: --size production needs a GPU backend, not {', '.join(interpreted)} (an "
                         "interpreter: hours per config at these sizes); use --backend mosaic_gpu or triton")
    try:
        fn, inputs = WORKLOADS[args.workload](args.size, args.dtype)
    except ValueError as err:
        raise SystemExit(f"pallascheck: {err}") from None
    kinds = () if args.no_adversarial else strategies.ELEMENT_KINDS
    result = autotune.autotune(fn, *inputs, backends=backends, repeats=args.repeats, timeout_s=args.timeout,
                               adversarial=kinds, progress=lambda line: print(line, flush=True))
    for entry in result.entries:
        chosen = entry["chosen"]["fields"] if entry["chosen"] else "none (every config rejected): default"
        speedup = entry.get("speedup_over_default")
        print(f"{entry['key']}\n  chosen {chosen}" + (f", {speedup:.2f}x the default" if speedup else ""))
        print(f"  {len(entry['candidates'])} valid, {len(entry['rejected'])} rejected; configs disagree by at most "
              f"{(entry['largest_config_difference'] or {}).get('budget', 0.0):.3f} of their bounds")
        for r in entry["rejected"]:
            print(f"  rejected {r['config']['fields']}: {r['reason']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    result.dump(args.out)
    print(f"written to {args.out}")
    return 0


DESCRIPTION = (
    "pallascheck: correctness and numerics checks for Pallas (JAX) kernels. Each kernel's output is compared "
    "with a float64 oracle under an error bound derived from its dtype, reduction lengths and accumulation "
    "order; Hypothesis draws the inputs, adversarial ones included. Start with `pallascheck verify`."
)
def _examples_help(unit: str, on_hardware: dict[str, int]) -> str:
    return (f"Hypothesis examples per kernel x dtype {unit}, each a layout (shapes, config) checking "
            f"{runner.CASES_PER_LAYOUT} cases in the interpreters ({runner.CALLBACK_CASES_PER_LAYOUT} in "
            f"{' and '.join(runner.CALLBACK_INTERPRETERS)}), {on_hardware['small']} on a GPU "
            f"({on_hardware['production']} at --shapes production) that share one compiled kernel (the meaning "
            "of pytest's --examples too)")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default where it is a value; an option whose default is None
    or off says in its help what happens without it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pallascheck")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown (not installed)"


def _add_target_options(parser: argparse.ArgumentParser, kernel_help: str) -> None:
    """What verify and fuzz check: the shape tier, the kernels, where MODULE:NAME
    kernels come from, the dtypes."""
    parser.add_argument("--shapes", choices=runner.SHAPE_TIERS, default="small",
                        help="shape tier: small (fast, reaches every code path) or production (real model sizes, "
                             "GPU backends; layouts that do not fit the device are skipped, saying so)")
    parser.add_argument("--kernel", action="append", help=f"only this kernel (repeatable): {kernel_help}")
    parser.add_argument("--path", action="append", help="a directory to import MODULE:NAME kernels from (repeatable)")
    parser.add_argument("--dtype", action="append", help="only this dtype (repeatable); default: each kernel's dtypes")


def build_parser() -> argparse.ArgumentParser:
    from pallascheck.bench.autotune_workloads import SIZES, WORKLOADS
    from pallascheck.bench.dispatch_stress import INPUTS as DISPATCH_INPUTS

    parser = _Parser(prog="pallascheck", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"pallascheck {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    verify = sub.add_parser(
        "verify", help="run every registered kernel's checks and print a verdict per kernel",
        description="Check every registered kernel (or those named) on one backend: values, gradients, "
        "determinism, configs agreeing, metamorphic relations and bad inputs, against the float64 oracle under "
        "the derived bound. Prints a legend, failures first, and one line per kernel; --full prints every "
        "kernel x dtype x check row. Exits 1 on any failure and saves each failing case for `pallascheck replay`.")
    verify.add_argument("--backend", default=None, help=f"one of {NAMES} (tpu_interpret:SEED); default $PALLASCHECK_BACKEND or interpret")
    verify.add_argument("--examples", type=int, default=3,
                        help=_examples_help("property", runner.HARDWARE_CASES_PER_LAYOUT))
    verify.add_argument("--seed", type=int, default=0, help="Hypothesis seed of every property")
    _add_target_options(verify, "a registered name, or MODULE:NAME for a KernelSpec of an importable module (see "
                                "--path); default: every registered kernel")
    verify.add_argument("--full", action="store_true", help="print every kernel x dtype x check row, not a line per kernel")
    verify.add_argument("--json", help="also write every row as JSON to this path")
    verify.add_argument("--failures", default=DEFAULT_FAILURE_DIR, help="where failing cases are saved")
    verify.add_argument("--jobs", type=int, default=0, help="worker processes (default: every core on the CPU, three quarters of them on a GPU)")
    verify.add_argument("--case-timeout", type=float, default=watchdog.CASE_TIMEOUT_S,
                        help="seconds one case may take (its compiles included) before it is reported as a hang")
    verify.add_argument("--durations", type=int, default=0, help="also list the N slowest kernel x dtype x check rows (0: none)")
    verify.set_defaults(func=cmd_verify)
    fuzz = sub.add_parser(
        "fuzz", help="search for inputs that break kernels, keeping every failure once",
        description="Run tasks (one Hypothesis run of --examples cases of one kernel, dtype, input kind and config "
        "slot) in worker processes until the time is up. Targeted (default): Hypothesis climbs toward the inputs "
        "that use the most of their error bound and a bandit spends the next task where that budget climbs. A hang "
        "(no progress for --case-timeout s), a crash or a worker above --memory-gb becomes a saved reproducer and "
        "the worker is restarted. Failures are shrunk, deduplicated by signature and saved under CORPUS/failures/ "
        "with a replay command; --resume continues a campaign where it stopped.")
    fuzz.add_argument("--backend", default=None, help=f"one of {NAMES}; default $PALLASCHECK_BACKEND or interpret")
    fuzz.add_argument("--minutes", type=float, default=10.0, help="how long the campaign runs (tasks in flight finish)")
    fuzz.add_argument("--jobs", type=int, default=0,
                      help="worker processes (default: every core; on a GPU backend at --shapes production one "
                           "per GPU; the workers take the GPUs in turn, each seeing its own)")
    fuzz.add_argument("--examples", type=int, default=8,
                      help=_examples_help("task", runner.CAMPAIGN_HARDWARE_CASES_PER_LAYOUT))
    fuzz.add_argument("--cases", type=int, default=None,
                      help="cases per Hypothesis example, all of its one compiled layout (default: as --examples "
                           "says). A layout's first case pays its compiles (about 15 s at --shapes production on "
                           "an H100) and each later one about a second there: more cases per layout is a soak's "
                           "volume, fewer is more layouts and configs per minute (a search). A resumed campaign "
                           "keeps its own unless given")
    fuzz.add_argument("--seed", type=int, default=1000, help="the first task's Hypothesis seed (then +1 per task)")
    _add_target_options(fuzz, "a registered name, or MODULE:NAME for a KernelSpec (or a VARIANTS entry) of an "
                              "importable module (see --path)")
    fuzz.add_argument("--corpus", default=".pallascheck/corpus", help="where reproducers, logs and state go")
    fuzz.add_argument("--resume", action="store_true", help="continue the campaign saved in --corpus")
    fuzz.add_argument("--random", action="store_true", help="untargeted: the pairs in turn, unpinned draws (the baseline, and a soak)")
    fuzz.add_argument("--case-timeout", type=float, default=watchdog.CASE_TIMEOUT_S,
                      help="seconds a worker may go without progress (a case, or a task's first compile) before it "
                           "counts as hung")
    fuzz.add_argument("--memory-gb", type=float, default=0.0,
                      help="resident memory per worker before it counts as out of memory (default: 3/4 of the "
                           "machine's, shared among the jobs)")
    fuzz.set_defaults(func=cmd_fuzz)
    replay = sub.add_parser("replay", help="re-run the check that failed on a saved case")
    replay.add_argument("file", metavar="FILE", help="a saved case (.npz) from verify's --failures or a fuzz corpus")
    replay.add_argument("--backend", default=None, help="default: the backend the case was saved on")
    replay.add_argument("--path", action="append", help="a directory to import a MODULE:NAME kernel from")
    replay.add_argument("--repeat", type=int, default=1,
                        help="check the case this many times in one process and say whether it fails every time "
                             "(a failure that comes and goes is intermittent)")
    replay.set_defaults(func=cmd_replay)
    report.add_parser(sub)
    if mutate is not None:
        mutate.add_parser(sub)
    else:
        sub.add_parser("mutate", help="needs libcst (pip install libcst)")  # listed; main() says what to do
    bench = sub.add_parser("bench", help="time kernels against xla_reference (use on a GPU)")
    bench.add_argument("--backend", default=None, help=f"one of {NAMES} (default mosaic_gpu; with --time-to-find: "
                       "the CPU interpreters each variant is written for, interpret or mosaic_gpu_interpret)")
    bench.add_argument("--shapes", choices=runner.SHAPE_TIERS, default="small",
                       help="with --time-to-find: the shape tier the campaigns draw from; with --dispatch-stress: "
                            "the tier of its layout (production: a GPU backend)")
    bench.add_argument("--op", action="append", help="only this op family (repeatable); default all")
    bench.add_argument("--json", help="also write the results as JSON")
    bench.add_argument("--harness", action="store_true", help="time the harness itself: pytest, cold and warm verify")
    bench.add_argument("--check-time", metavar="KERNEL",
                       help="time checking production cases of KERNEL (every check, as verify runs them; GPU)")
    bench.add_argument("--dispatch-stress", metavar="KERNEL",
                       help="call KERNEL's forward and VJP on cases of one layout from --threads threads at once, "
                            "beside its float64 oracle, for --seconds, and count the calls whose bits differ from "
                            "the same call alone (0 for a deterministic kernel on a sound runtime and device; GPU)")
    bench.add_argument("--threads", type=int, default=3, help="with --dispatch-stress: threads calling the kernel")
    bench.add_argument("--seconds", type=float, default=60.0, help="with --dispatch-stress: how long")
    bench.add_argument("--inputs", choices=DISPATCH_INPUTS, default="placed",
                       help="with --dispatch-stress: each call's inputs copied to the device and waited for, as the "
                            "checks do (placed); handed to the program as numpy arrays (host); or placed once (device)")
    bench.add_argument("--reference", action="store_true",
                       help="with --dispatch-stress: stress the spec's XLA reference instead of the kernel")
    bench.add_argument("--layout", help="with --check-time or --dispatch-stress --shapes production: the production "
                       "layout whose name contains this")
    bench.add_argument("--dtype", default="bfloat16", help="with --check-time or --dispatch-stress: the dtype")
    bench.add_argument("--cases", type=int, default=4, help="with --check-time or --dispatch-stress: cases of the "
                       "one layout")
    bench.add_argument("--no-pytest", action="store_true", help="with --harness: time verify only")
    bench.add_argument("--tolerance-rules", action="store_true",
                       help="kills, misses and false alarms of the contract, the implementation bound and torch's and "
                            "JAX's default tolerances on the broken variants and the shipped kernels (CPU)")
    bench.add_argument("--time-to-find", action="store_true",
                       help="seconds a fuzz campaign takes to find each broken variant of tests/broken, targeted "
                            "against random (the CPU interpreters, or --backend's GPU)")
    bench.add_argument("--tokamax-autotune", action="store_true",
                       help="run tokamax.autotune on attention and ragged_dot (Hopper GPU) and check every config it "
                            "timed with the numerics gate; --op dot_product_attention|ragged_dot picks one")
    bench.add_argument("--resume", action="store_true",
                       help="with --tokamax-autotune: keep the verdicts already in --json's file, gate only the rest")
    bench.add_argument("--limit", type=float, default=120.0, help="with --time-to-find: seconds per campaign")
    bench.add_argument("--jobs", type=int, default=0, help="with --time-to-find: workers per campaign (default: as "
                       "fuzz's, every core, or one per GPU at --shapes production)")
    bench.add_argument("--variant", action="append", help="with --time-to-find: only this MODULE/NAME (repeatable)")
    bench.add_argument("--mode", action="append", choices=("targeted", "random"),
                       help="with --time-to-find: only this search mode (repeatable; default both)")
    bench.add_argument("--tests", default="tests", help="with --harness: the test directory pytest runs; with "
                                                         "--tolerance-rules or --time-to-find: the one holding broken/")
    bench.add_argument("--examples", type=int, default=6, help="with --harness: verify's --examples; with "
                       "--tolerance-rules: Hypothesis examples (one case each) per shipped kernel and dtype")
    bench.set_defaults(func=cmd_bench)
    probe = sub.add_parser("probe", help="measure the backend's dot arithmetic and check the tolerance model's assumptions")
    probe.add_argument("--backend", default=None, help=f"one of {NAMES}; default $PALLASCHECK_BACKEND or interpret")
    probe.add_argument("--json", help="where the measurements go (default .pallascheck/probe-BACKEND.json)")
    probe.set_defaults(func=cmd_probe)
    tune = sub.add_parser(
        "autotune", help="pick each kernel's fastest config among those that pass the numerics gate",
        description="Run a workload once to find the pallascheck kernels it calls, check every config of each "
        "kernel's autotuning space against the float64 oracle under its derived bound (values and gradients, "
        "on the workload's inputs and the spec's adversarial inputs at the same shapes), time the configs that pass "
        "(median and IQR) and write the result: chosen config, all timings, rejected configs with reasons. "
        "Pin it with `with pallascheck.use_configs(PATH):` or PALLASCHECK_CONFIGS=PATH.")
    tune.add_argument("--workload", required=True, choices=sorted(WORKLOADS), help="what to tune")
    tune.add_argument("--size", default="small", choices=SIZES,
                      help="small: seconds in the CPU interpreters; bench: a GPU size; production: a layout of the "
                      "production shape tier (matmul, attention, ragged_dot; GPU backends)")
    tune.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                      help="the workload's input dtype")
    tune.add_argument("--backend", action="append",
                      help="tune for this backend (repeatable); default: the GPU backends here, else $PALLASCHECK_BACKEND")
    tune.add_argument("--repeats", type=int, default=10, help="timed runs per config after a warm-up")
    tune.add_argument("--timeout", type=float, default=300.0, help="seconds before a config is rejected as hung")
    tune.add_argument("--no-adversarial", action="store_true", help="gate on the workload's own inputs only")
    tune.add_argument("--out", default=os.path.join(".pallascheck", "autotune.json"), help="the result file")
    tune.set_defaults(func=cmd_autotune)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if mutate is None and argv[:1] == ["mutate"]:
        raise SystemExit("pallascheck mutate parses kernels with libcst, which is not installed: pip install libcst")
    args = build_parser().parse_args(argv)
    for name in ("examples", "repeat"):
        if getattr(args, name, 1) < 1:
            raise SystemExit(f"pallascheck: --{name} must be >= 1")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
