"""The ``pallascheck`` command.

    pallascheck verify [--backend B] [--examples N] [--kernel K ...] [--dtype D ...] [--json PATH]
    pallascheck fuzz [--backend B] [--minutes M] [--kernel K ...] [--dtype D ...] [--corpus DIR]
    pallascheck replay FILE.npz [--backend B]
    pallascheck bench [--backend gpu] [--op FAMILY] [--json PATH]

The command lives in ``fuzz`` because it sits at the top of the dependency chain
(kernels -> oracles -> properties -> fuzz).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Any, Sequence

from pallascheck.kernels.backends import NAMES, get_backend
from pallascheck.properties import checks, runner
from pallascheck.properties.spec import Case, get_spec, registry

DEFAULT_FAILURE_DIR = ".pallascheck/failures"


@dataclasses.dataclass
class Row:
    kernel: str
    dtype: str
    check: str
    passed: bool
    examples: int
    budget_used: float
    probabilistic_budget: float | None
    seconds: float


def _verify_rows(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    backend = get_backend(args.backend)
    specs = registry()
    names = [n for n in args.kernel if n in specs] if args.kernel else list(specs)
    rows, failures = [], []
    for name in names:
        spec = get_spec(name)
        t0 = time.perf_counter()
        err = runner.run_errors(spec, context=checks.Context(kernel=name, backend=str(backend)))
        rows.append(Row(name, "-", "errors", err.passed, err.examples, err.budget_used, None, time.perf_counter() - t0))
        if not err.passed:
            failures.append(f"[errors] kernel={name}: {err.detail}")
        for dtype in [d for d in spec.dtypes if not args.dtype or d in args.dtype]:
            replay = f"pallascheck verify --backend {backend} --kernel {name} --dtype {dtype} --examples {args.examples} --seed {args.seed}"
            tally = runner.run_property(
                spec, dtype, backend, examples=args.examples, seed=args.seed,
                failure_dir=args.failures, replay_hint=replay,
            )
            for check in runner.REPORTED:
                if check not in tally.outcomes:
                    continue
                o = tally.outcomes[check]
                prob = tally.probabilistic_budget if check == "values" else None
                rows.append(Row(name, dtype, check, o.passed, o.examples, o.budget_used, prob, tally.seconds.get(check, 0.0)))
            if tally.failure:
                failures.append(tally.failure)
            print(f"  {name} {dtype}: done in {sum(tally.seconds.values()):.1f}s", file=sys.stderr, flush=True)
    return rows, failures


# The distributed kernels need a mesh: verify runs them in a child process with this
# many CPU devices (meshes 4 and 2x2), on the TPU interpreter whatever --backend says.
DISTRIBUTED_DEVICES = 4


def _distributed_rows(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    from pallascheck.properties import multidevice
    from pallascheck.properties.collectives_checks import PROPERTIES

    names = [n for n in PROPERTIES if not args.kernel or n in args.kernel]
    if not names:
        return [], []
    start = time.perf_counter()
    result = multidevice.run_with_cpu_devices(
        "pallascheck.properties.collectives_checks:run_checks", DISTRIBUTED_DEVICES,
        {"examples": args.examples, "seed": args.seed, "kernels": names}, timeout_s=600,
    )
    seconds = (time.perf_counter() - start) / len(names)
    rows, failures = [], []
    errors = result.pop("errors")
    rows.append(Row("collectives", "-", "errors", not errors, len(PROPERTIES), 0.0, None, 0.0))
    failures += [f"[errors] {case}: {message}" for case, message in errors.items()]
    for name, tally in result.items():
        check = f"values (tpu_interpret, {DISTRIBUTED_DEVICES} CPU devices)"
        for dtype in [d for d in sorted(tally["examples"]) if not args.dtype or d in args.dtype]:
            rows.append(Row(name, dtype, check, not tally["failures"], tally["examples"][dtype],
                            tally["budget"][dtype], None, seconds))
        if tally["failures"]:
            rows.append(Row(name, "-", check, False, 0, float("inf"), None, seconds))
            failures += [f"[{name} on {DISTRIBUTED_DEVICES} CPU devices] {f}" for f in tally["failures"]]
    return rows, failures


def _fmt_budget(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.3g}"


def _print_table(rows: Sequence[Row]) -> None:
    header = ("kernel", "dtype", "check", "result", "examples", "budget used", "prob. budget", "time (s)")
    body = [
        (r.kernel, r.dtype, r.check, "pass" if r.passed else "FAIL", str(r.examples),
         _fmt_budget(r.budget_used), _fmt_budget(r.probabilistic_budget), f"{r.seconds:.1f}")
        for r in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    for line in [header, tuple("-" * w for w in widths), *body]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))


def cmd_verify(args: argparse.Namespace) -> int:
    from pallascheck.properties.collectives_checks import PROPERTIES

    known = set(registry()) | set(PROPERTIES)
    unknown = sorted(set(args.kernel or ()) - known)
    if unknown:
        raise SystemExit(f"pallascheck: --kernel must be among {sorted(known)}, got {unknown}")
    start = time.perf_counter()
    rows, failures = _verify_rows(args)
    distributed_rows, distributed_failures = _distributed_rows(args)
    rows, failures = rows + distributed_rows, failures + distributed_failures
    _print_table(rows)
    elapsed = time.perf_counter() - start
    ok = all(r.passed for r in rows)
    print(f"\n{'PASS' if ok else 'FAIL'}: {sum(r.passed for r in rows)}/{len(rows)} checks passed "
          f"on backend {get_backend(args.backend)} in {elapsed:.1f}s")
    for message in failures:
        print("\n" + message)
    if failures and args.failures:
        print(f"\nfailing cases saved under {args.failures}/ (pallascheck replay FILE)")
    if args.json:
        import jax

        report = {
            "backend": str(get_backend(args.backend)), "jax": jax.__version__, "examples": args.examples,
            "seed": args.seed, "seconds": elapsed, "passed": ok, "failures": failures,
            "rows": [
                {**dataclasses.asdict(r),
                 "budget_used": None if math.isinf(r.budget_used) else r.budget_used}
                for r in rows
            ],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


def cmd_fuzz(args: argparse.Namespace) -> int:
    from . import campaign

    backend = get_backend(args.backend)
    specs = [get_spec(name) for name in (args.kernel or registry())]
    print(f"fuzzing {', '.join(s.name for s in specs)} on {backend} for {args.minutes:g} min; corpus {args.corpus}/")
    result = campaign.run(
        specs, backend, args.corpus, seconds=60.0 * args.minutes, examples_per_round=args.examples,
        first_seed=args.seed, dtypes=args.dtype,
    )
    status = "interrupted" if result.interrupted else "done"
    print(f"{status}: {result.rounds} rounds, {result.examples} passing examples, {len(result.findings)} findings")
    for finding in result.findings:
        print(f"\n{finding.kernel} {finding.dtype} (seed {finding.seed}): saved {', '.join(finding.saved) or 'nothing'}")
        print(finding.message)
    if result.interrupted:
        return 130
    return 1 if result.findings else 0


def cmd_replay(args: argparse.Namespace) -> int:
    case = Case.load(args.file)
    meta: dict[str, Any] = dict(case.params).pop("__failure__")
    params = {k: v for k, v in case.params.items() if k != "__failure__"}
    case = Case(case.arrays, params)
    spec = get_spec(meta["kernel"])
    config = type(spec.default_config)(**meta["config"]) if isinstance(meta["config"], dict) else meta["config"]
    backend = get_backend(args.backend or meta["backend"])
    print(f"replaying {meta['kernel']} {meta['dtype']} [{meta['check']}] on {backend}: {case.describe()}; config={config}")
    context = checks.Context(kernel=spec.name, dtype=meta["dtype"], backend=str(backend), replay=f"pallascheck replay {args.file}")
    try:
        tally = runner.check_case(spec, case, config, backend, context=context)
    except checks.CheckFailure as failure:
        print(f"FAIL\n{failure}")
        return 1
    print("PASS: " + ", ".join(f"{k} (budget {_fmt_budget(o.budget_used)})" for k, o in tally.outcomes.items()))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import jax

    from . import bench

    backend = get_backend(args.backend)
    print(f"benchmark on {backend}: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    rows = bench.run(backend, args.op)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": str(backend), "device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pallascheck", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser("verify", help="run every registered kernel's checks")
    verify.add_argument("--backend", default=None, help=f"one of {NAMES} (tpu_interpret:SEED); default $PALLASCHECK_BACKEND or interpret")
    verify.add_argument("--examples", type=int, default=6, help="Hypothesis examples per kernel and dtype")
    verify.add_argument("--seed", type=int, default=0)
    verify.add_argument("--kernel", action="append", help="only this kernel (repeatable)")
    verify.add_argument("--dtype", action="append", help="only this dtype (repeatable)")
    verify.add_argument("--json", help="also write the table as JSON to this path")
    verify.add_argument("--failures", default=DEFAULT_FAILURE_DIR, help="where failing cases are saved")
    verify.set_defaults(func=cmd_verify)
    fuzz = sub.add_parser("fuzz", help="fuzz kernels until the time is up, keeping every failing case")
    fuzz.add_argument("--backend", default=None, help=f"one of {NAMES}")
    fuzz.add_argument("--minutes", type=float, default=10.0)
    fuzz.add_argument("--examples", type=int, default=50, help="examples per kernel, dtype and round")
    fuzz.add_argument("--seed", type=int, default=1000, help="the first round's Hypothesis seed (then +1 per round)")
    fuzz.add_argument("--kernel", action="append", help="only this kernel (repeatable)")
    fuzz.add_argument("--dtype", action="append", help="only this dtype (repeatable)")
    fuzz.add_argument("--corpus", default=".pallascheck/corpus", help="where reproducers and the log go")
    fuzz.set_defaults(func=cmd_fuzz)
    replay = sub.add_parser("replay", help="re-run the checks on a saved failing case")
    replay.add_argument("file")
    replay.add_argument("--backend", default=None)
    replay.set_defaults(func=cmd_replay)
    bench = sub.add_parser("bench", help="time kernels against xla_reference (use on a GPU)")
    bench.add_argument("--backend", default="gpu")
    bench.add_argument("--op", action="append", help="only this op family (repeatable); default all")
    bench.add_argument("--json", help="also write the results as JSON")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "examples", 1) < 1:
        raise SystemExit("pallascheck: --examples must be >= 1")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
