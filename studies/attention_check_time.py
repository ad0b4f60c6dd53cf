"""The float64 side of a production-size attention check, on the JAX CPU device: the
time of the checks the production tier runs (values, gradients, contract), the
oracle-side programs run and compiled. A benchmark command for the CPU; the GPU's
figure is ``pallascheck bench --check-time attention --backend mosaic_gpu``.

    python -m studies.attention_check_time [--seq 8192] [--heads 8] [--kv-heads 2] [--cases 2]

The case is checked by ``runner.check_case`` as the production tier checks it, with
device oracles on the CPU (``$PALLASCHECK_ORACLES=device``: the chunked oracle of
properties/families/attention_slices.py, ``SLICE_ELEMENTS`` as shipped), every
oracle-side call on its own thread as on a GPU. The kernel's side is a stand-in, so
that the time is the oracle's: the float64 output and gradients rounded to bfloat16
(within every bound: they are the exact values rounded once), computed before the
clock starts. The first case pays the compilations; the rest show the steady rate."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Any

import jax
import ml_dtypes
import numpy as np

from pallascheck.kernels.backends import Backend
from pallascheck.oracles import numeric
from pallascheck.properties import checks, runner
from pallascheck.properties.device import layout_programs
from pallascheck.properties.registry import get_spec
from pallascheck.properties.spec import Case, KernelSpec

CHECKS = ("values", "gradients", "contract")  # the production tier's bounded checks at 32k


def _case(seed: int, seq: int, heads: int, kv_heads: int, head_dim: int) -> Case:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16)

    arrays = {
        "q": normal(1, seq, heads, head_dim),
        "k": normal(1, seq, kv_heads, head_dim),
        "v": normal(1, seq, kv_heads, head_dim),
        "cotangent": normal(1, seq, heads, head_dim),
    }
    return Case(arrays, {"causal": True, "sm_scale": None})


def _stand_in(spec: KernelSpec, cases: list[Case]) -> KernelSpec:
    """``spec`` whose kernel and VJP return the exact values rounded to bfloat16."""
    outputs: dict[tuple[str, ...], tuple[np.ndarray, dict[str, np.ndarray]]] = {}
    with numeric.on_device(jax.devices("cpu")[0]):
        for case in cases:
            ref = spec.oracle(case)
            grads = spec.gradients.oracle_vjp(case, ref)
            outputs[runner.fingerprint(case)] = (
                np.asarray(spec.expected(ref)).astype(ml_dtypes.bfloat16),
                {k: np.asarray(g).astype(ml_dtypes.bfloat16) for k, g in grads.items()},
            )

    def kernel(case: Case, config: Any, backend: Backend) -> np.ndarray:
        return outputs[runner.fingerprint(case)][0]

    def kernel_vjp(case: Case, config: Any, backend: Backend) -> dict[str, np.ndarray]:
        return outputs[runner.fingerprint(case)][1]

    gradients = dataclasses.replace(spec.gradients, kernel_vjp=kernel_vjp)
    return dataclasses.replace(spec, kernel=kernel, gradients=gradients)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--cases", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    os.environ[runner.ORACLES_ENV_VAR] = "device"
    cases = [_case(seed, args.seq, args.heads, args.kv_heads, args.head_dim) for seed in range(args.cases)]
    spec = _stand_in(get_spec("attention"), cases)
    backend = Backend("interpret")
    config = spec.default_config_for(backend)
    context = checks.Context(kernel="attention", dtype="bfloat16", backend="cpu (device oracles)")

    compiles = [0]

    def counted(event: str, seconds: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(counted)
    runs = [0]
    seconds_in: dict[str, float] = {}  # per spec function: its programs' calls (waits for the lock included)
    compiled = layout_programs.compiled

    def counting(fn: Any, *a: Any, **k: Any) -> Any:
        runs[0] += 1
        start = time.perf_counter()
        try:
            return compiled(fn, *a, **k)
        finally:
            name = getattr(fn, "__name__", "?")
            seconds_in[name] = seconds_in.get(name, 0.0) + time.perf_counter() - start

    layout_programs.compiled = counting  # every oracle-side program call goes through it
    rows = []
    for i, case in enumerate(cases):
        runs[0] = compiles[0] = 0
        seconds_in.clear()
        start = time.perf_counter()
        tally = runner.check_case(spec, case, config, backend, context=context, selected=CHECKS)
        seconds = time.perf_counter() - start
        rows.append(
            {
                "case": i,
                "seconds": round(seconds, 2),
                "checks": {k: round(v, 2) for k, v in tally.seconds.items()},
                "programs_run": runs[0],
                "programs_compiled": compiles[0],
                "program_seconds": {k: round(v, 2) for k, v in sorted(seconds_in.items())},
                "budgets": {k: o.budget_used for k, o in tally.outcomes.items()},
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    later = [r["seconds"] for r in rows[1:]]
    result = {
        "layout": f"b1 s{args.seq} h{args.heads}/{args.kv_heads} d{args.head_dim} bf16 causal",
        "jax": jax.__version__,
        "first_seconds": rows[0]["seconds"],
        "median_seconds_after_first": statistics.median(later) if later else None,
        "rows": rows,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
