"""``pallascheck bench --check-time KERNEL``: how long checking one case takes.

Draws ``cases`` cases of one production layout (``--layout``, a part of its name;
properties/production.py), all with the same shapes and static parameters, and runs
every check of the production tier on each, as ``verify --shapes production`` does:
the first case pays the compilations (kernel, VJP, reference, oracle programs), the
rest show the steady rate. Prints per case the wall time of its checks (drawing its
input apart) and where it went (per check: the "values" check includes the kernel's
run, the oracle and the bound), and the peak device memory where the device reports it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from pallascheck.kernels.backends import Backend
from pallascheck.properties import check_kinds, checks, runner
from pallascheck.properties.registry import get_spec
from pallascheck.properties.spec import Case, KernelSpec


def layout_cases(
    spec: KernelSpec, backend: Backend, *, dtype: str, layout: str | None, cases: int, shapes: str = "production"
) -> list[Case]:
    """``cases`` distinct cases of one layout of the ``shapes`` tier (at production,
    the layout whose name contains ``layout``; None: the first drawn): one Hypothesis
    example, as the cases of one example of verify and fuzz share a layout (shapes,
    static parameters: strategies.layout). Hypothesis first tries its simplest
    example, in which every case draws the same seed: a repeated case rejects the
    example, and the next one is drawn at random."""
    if layout is not None and shapes != "production":
        raise ValueError(f"layout names a production layout; at --shapes {shapes} leave it out")
    if shapes == "production":
        if spec.production is None:
            raise ValueError(f"{spec.name} has no production shape tier")
        strategy = spec.production(dtype, backend, layout=layout)
    else:
        strategy = runner.tier_cases(spec, shapes)(dtype, backend)
    found: list[Case] = []

    @settings(
        max_examples=1,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def one(data: st.DataObject) -> None:
        drawn: dict[tuple[str, ...], Case] = {}
        for _ in range(cases):
            case = data.draw(strategy)
            key = runner.fingerprint(case)
            assume(key not in drawn)
            drawn[key] = case
        found[:] = drawn.values()

    one()
    return found


def run(kernel: str, backend: Backend, *, dtype: str, layout: str | None, cases: int) -> dict[str, Any]:
    spec = get_spec(kernel)
    if spec.production is None:
        raise ValueError(f"{kernel} has no production shape tier")
    config = spec.default_config_for(backend)
    context = checks.Context(kernel=kernel, dtype=dtype, backend=str(backend))
    start = time.perf_counter()
    drawn = layout_cases(spec, backend, dtype=dtype, layout=layout, cases=cases)
    print(f"{cases} cases drawn in {time.perf_counter() - start:.1f} s", flush=True)
    rows: list[dict[str, Any]] = []
    for case in drawn:
        start = time.perf_counter()
        tally = runner.check_case(
            spec, case, config, backend, context=context, selected=runner.tier_checks(check_kinds.CHECKS, "production")
        )
        seconds = time.perf_counter() - start
        row: dict[str, Any] = {
            "case": len(rows),
            "shapes": case.describe()[:160],
            "seconds": seconds,
            "checks": {k: round(v, 3) for k, v in tally.seconds.items()},
            "budgets": {k: o.budget_used for k, o in tally.outcomes.items()},
        }
        rows.append(row)
        print(
            f"case {row['case']}: {seconds:.2f} s  "
            + ", ".join(f"{k} {v:.2f}" for k, v in row["checks"].items())
            + "\n  budgets: "
            + ", ".join(f"{k} {v:.3g}" for k, v in row["budgets"].items()),
            flush=True,
        )
    stats = jax.devices(backend.platform)[0].memory_stats() or {}
    later = [r["seconds"] for r in rows[1:]]
    return {
        "kernel": kernel,
        "dtype": dtype,
        "backend": str(backend),
        "device": jax.devices(backend.platform)[0].device_kind,
        "jax": jax.__version__,
        "first_seconds": rows[0]["seconds"] if rows else None,
        "median_seconds_after_first": statistics.median(later) if later else None,
        "peak_device_bytes": stats.get("peak_bytes_in_use"),
        "rows": rows,
    }


def summary(result: dict[str, Any]) -> str:
    """``run``'s result in one line: what was not measured (no case, no case after the
    first, a device that reports no peak memory) is said, never printed as 0."""
    first, later, peak = result["first_seconds"], result["median_seconds_after_first"], result["peak_device_bytes"]
    timing = "no case checked" if first is None else f"first case {first:.2f} s"
    if first is not None:
        timing += f", then median {later:.2f} s" if later is not None else ", no case after the first"
    memory = (
        f"peak device memory {peak / 2**30:.1f} GiB" if peak is not None else "peak memory not reported by the device"
    )
    return f"{result['kernel']} {result['dtype']} on {result['device']} (jax {result['jax']}): {timing}; {memory}"
