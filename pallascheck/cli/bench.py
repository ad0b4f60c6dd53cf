"""``pallascheck bench``: kernels timed against xla_reference, the time to check a
production case, and the dispatch stress (GPU). The studies behind docs/results.md
run from a checkout: ``python -m studies.NAME`` (studies/README.md)."""

from __future__ import annotations

import argparse
import json

from pallascheck.bench import check_time, dispatch_stress
from pallascheck.bench import ops as bench_ops
from pallascheck.cli._common import add_backend_option, available_backend
from pallascheck.fuzz import scope
from pallascheck.kernels.backends import Backend
from pallascheck.properties import runner
from pallascheck.properties.registry import get_spec


def _write_json(path: str | None, result: object) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def _dtype(kernel: str, asked: str | None, backend: Backend) -> str:
    """The dtype --check-time and --dispatch-stress check ``kernel`` in: the one asked
    for (an alias resolved), else bfloat16 where the kernel has it on ``backend``, else
    its first dtype there (fp8_matmul's float8_e4m3fn); a one-line error for a dtype
    the kernel does not have."""
    dtypes = get_spec(kernel).dtypes_for(backend)
    if asked is None:
        return "bfloat16" if "bfloat16" in dtypes else dtypes[0]
    dtype = scope.canonical_dtype(asked)
    if dtype not in dtypes:
        hint = scope.did_you_mean(asked, list(dtypes), scope.DTYPE_ALIASES)
        raise SystemExit(f"pallascheck: --dtype {asked!r}: {kernel} has no such version on {backend}: {hint}")
    return dtype


def run(args: argparse.Namespace) -> int:
    import jax

    backend = available_backend(args.backend or "mosaic_gpu")
    if args.check_time:
        dtype = _dtype(args.check_time, args.dtype, backend)
        result = check_time.run(args.check_time, backend, dtype=dtype, layout=args.layout, cases=args.cases)
        print(check_time.summary(result))
        _write_json(args.json, result)
        return 0
    if args.dispatch_stress:
        try:
            result = dispatch_stress.run(
                get_spec(args.dispatch_stress),
                backend,
                dtype=_dtype(args.dispatch_stress, args.dtype, backend),
                layout=args.layout,
                cases=args.cases,
                seconds=args.seconds,
                threads=args.threads,
                shapes=args.shapes,
                inputs=args.inputs,
                reference=args.reference,
            )
        except ValueError as err:
            raise SystemExit(f"pallascheck: {err}") from None
        print(f"{result['kernel']} {result['dtype']} on {result['device']} (jax {result['jax']}), {result['shapes']}:")
        for name, calls in result["calls"].items():
            print(
                f"  {name}: {calls} calls"
                + (
                    " alongside"
                    if name == "oracle"
                    else f", {result['mismatches'][name]} whose bits differ from the call alone"
                )
            )
        for note in result["notes"]:
            print(f"  {note}")
        _write_json(args.json, result)
        return 1 if any(result["mismatches"].values()) else 0
    print(f"benchmark on {backend}: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    rows = bench_ops.run(backend, args.op)
    _write_json(
        args.json,
        {"backend": str(backend), "device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows},
    )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``pallascheck bench``."""
    bench = sub.add_parser("bench", help="time kernels against xla_reference (use on a GPU)")
    add_backend_option(bench, default="mosaic_gpu")
    bench.add_argument(
        "--shapes",
        choices=runner.SHAPE_TIERS,
        default="small",
        help="with --dispatch-stress: the tier of its layout (production: a GPU backend)",
    )
    bench.add_argument("--op", action="append", help="only this op family (repeatable); default all")
    bench.add_argument("--json", help="also write the results as JSON")
    modes = bench.add_mutually_exclusive_group()
    modes.add_argument(
        "--check-time",
        metavar="KERNEL",
        help="time checking production cases of KERNEL (every check, as verify runs them; GPU)",
    )
    modes.add_argument(
        "--dispatch-stress",
        metavar="KERNEL",
        help="call KERNEL's forward and VJP on cases of one layout from --threads threads at once, "
        "beside its float64 oracle, for --seconds, and count the calls whose bits differ from "
        "the same call alone (0 for a deterministic kernel on a sound runtime and device; GPU)",
    )
    bench.add_argument("--threads", type=int, default=3, help="with --dispatch-stress: threads calling the kernel")
    bench.add_argument("--seconds", type=float, default=60.0, help="with --dispatch-stress: how long")
    bench.add_argument(
        "--inputs",
        choices=dispatch_stress.INPUTS,
        default="placed",
        help="with --dispatch-stress: each call's inputs copied to the device and waited for, as the "
        "checks do (placed); handed to the program as numpy arrays (host); or placed once (device)",
    )
    bench.add_argument(
        "--reference",
        action="store_true",
        help="with --dispatch-stress: stress the spec's XLA reference instead of the kernel",
    )
    bench.add_argument(
        "--layout",
        help="with --check-time or --dispatch-stress --shapes production: the production "
        "layout whose name contains this",
    )
    bench.add_argument(
        "--dtype",
        help="with --check-time or --dispatch-stress: the dtype (aliases such as bf16, e4m3 accepted; default "
        "bfloat16, or the kernel's own where it has no bfloat16 version: fp8_matmul's float8_e4m3fn)",
    )
    bench.add_argument(
        "--cases", type=int, default=4, help="with --check-time or --dispatch-stress: cases of the one layout"
    )
    bench.set_defaults(func=run)
