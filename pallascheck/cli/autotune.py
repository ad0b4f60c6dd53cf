"""``pallascheck autotune``: each kernel's fastest config among those that pass the numerics gate."""

from __future__ import annotations

import argparse
import os

from pallascheck.bench import autotune
from pallascheck.bench.autotune_workloads import SIZES, WORKLOADS
from pallascheck.cli._common import available_backend
from pallascheck.kernels.backends import get_backend
from pallascheck.properties import strategies


def run(args: argparse.Namespace) -> int:
    backends = [str(available_backend(b)) for b in args.backend] if args.backend else autotune.default_backends()
    interpreted = [b for b in backends if get_backend(b).is_interpreted]
    if args.size == "production" and interpreted:
        raise SystemExit(
            f"pallascheck: --size production needs a GPU backend, not {', '.join(interpreted)} (an "
            "interpreter: hours per config at these sizes); use --backend mosaic_gpu or triton"
        )
    try:
        fn, inputs = WORKLOADS[args.workload](args.size, args.dtype)
    except ValueError as err:
        raise SystemExit(f"pallascheck: {err}") from None
    kinds = () if args.no_adversarial else strategies.ELEMENT_KINDS
    result = autotune.autotune(
        fn,
        *inputs,
        backends=backends,
        repeats=args.repeats,
        timeout_s=args.timeout,
        adversarial=kinds,
        progress=lambda line: print(line, flush=True),
    )
    for entry in result.entries:
        chosen = entry["chosen"]["fields"] if entry["chosen"] else "none (every config rejected): default"
        speedup = entry.get("speedup_over_default")
        print(f"{entry['key']}\n  chosen {chosen}" + (f", {speedup:.2f}x the default" if speedup else ""))
        print(
            f"  {len(entry['candidates'])} valid, {len(entry['rejected'])} rejected; configs disagree by at most "
            f"{(entry['largest_config_difference'] or {}).get('budget', 0.0):.3f} of their bounds"
        )
        for r in entry["rejected"]:
            print(f"  rejected {r['config']['fields']}: {r['reason']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    result.dump(args.out)
    print(f"written to {args.out}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``pallascheck autotune``."""
    tune = sub.add_parser(
        "autotune",
        help="pick each kernel's fastest config among those that pass the numerics gate",
        description="Run a workload once to find the pallascheck kernels it calls, check every config of each "
        "kernel's autotuning space against the float64 oracle under its derived bound (values and gradients, "
        "on the workload's inputs and the spec's adversarial inputs at the same shapes), time the configs that pass "
        "(median and IQR) and write the result: chosen config, all timings, rejected configs with reasons. "
        "Pin it with `with pallascheck.use_configs(PATH):` or PALLASCHECK_CONFIGS=PATH.",
    )
    tune.add_argument("--workload", required=True, choices=sorted(WORKLOADS), help="what to tune")
    tune.add_argument(
        "--size",
        default="small",
        choices=SIZES,
        help="small: seconds in the CPU interpreters; bench: a GPU size; production: a layout of the "
        "production shape tier (matmul, attention, ragged_dot; GPU backends)",
    )
    tune.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="the workload's input dtype"
    )
    tune.add_argument(
        "--backend",
        action="append",
        help="tune for this backend (repeatable); default: the GPU backends here, else $PALLASCHECK_BACKEND",
    )
    tune.add_argument("--repeats", type=int, default=10, help="timed runs per config after a warm-up")
    tune.add_argument("--timeout", type=float, default=300.0, help="seconds before a config is rejected as hung")
    tune.add_argument("--no-adversarial", action="store_true", help="gate on the workload's own inputs only")
    tune.add_argument("--out", default=os.path.join(".pallascheck", "autotune.json"), help="the result file")
    tune.set_defaults(func=run)
