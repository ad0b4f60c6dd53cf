"""``python -m studies.time_to_find``: how long a fuzz campaign takes to find each
deliberately broken kernel of ``tests/broken``, targeted against random.

Each variant is fuzzed twice from nothing (an empty corpus, no compilation cache,
fresh worker processes), once with the targeted search (Hypothesis' ``target`` on
the budget used and the bandit over input kinds and config slots) and once with
random draws (uniform pairs, unpinned kinds and configs), each until its first
failure or ``limit`` seconds. The time counts everything a user waits for: worker
start-up, compilation, drawing, checking and shrinking the first failure. Variants
run on the backend their kernels are written for (the Mosaic GPU ones in the Mosaic
GPU interpreter), in the dtypes where they are wrong; with ``--backend`` a GPU's
variants run on that GPU, at the ``--shapes`` tier.
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import tempfile
from typing import Any

from pallascheck.fuzz import campaign, plan
from pallascheck.kernels.backends import GENERIC, Backend
from pallascheck.properties.device.compilation import CACHE_ENV_VAR

MODES = ("targeted", "random")


def variants(tests_dir: str, backend: Backend | None = None) -> list[dict[str, Any]]:
    """Every broken variant: its target string, backend and wrong dtypes. With
    ``backend`` (a GPU's), the variants whose kernels run there; else every variant,
    on the CPU interpreter its kernels are written for."""
    sys.path.insert(0, os.path.abspath(tests_dir))
    broken = importlib.import_module("broken")
    rows = []
    for module_name in broken.MODULES:
        module = importlib.import_module(f"broken.{module_name}")
        backends = getattr(module, "BACKENDS", GENERIC)
        if backend is not None and backend.name not in backends:
            continue
        on = backend.name if backend is not None else "interpret" if "interpret" in backends else "mosaic_gpu_interpret"
        for name, (_, dtypes, _) in module.VARIANTS.items():
            if on in getattr(module, "NOT_ON", {}).get(name, {}):
                continue
            rows.append(
                {
                    "variant": f"{module_name}/{name}",
                    "target": f"broken.{module_name}:{name}",
                    "backend": on,
                    "dtypes": list(dtypes),
                }
            )
    return rows


def time_to_find(
    row: dict[str, Any], mode: str, *, limit: float, jobs: int, tests_dir: str, shapes: str = "small"
) -> float | None:
    """Seconds to the first failure of ``row``'s variant (None: not within ``limit``);
    ``jobs`` 0: fuzz's default (``plan.default_jobs``)."""
    backend = Backend(row["backend"])
    with tempfile.TemporaryDirectory() as corpus:
        result = campaign.run(
            [row["target"]],
            backend,
            corpus,
            seconds=limit,
            jobs=jobs or plan.default_jobs("fuzz", backend, shapes),
            targeted=mode == "targeted",
            dtypes=row["dtypes"],
            paths=[os.path.abspath(tests_dir)],
            stop_on_first=True,
            shapes=shapes,
        )
    found = result.first_failure_seconds
    return found if found is not None and found <= limit else None


def run(
    tests_dir: str,
    *,
    limit: float,
    jobs: int,
    only: list[str] | None = None,
    modes: tuple[str, ...] = MODES,
    backend: Backend | None = None,
    shapes: str = "small",
) -> list[dict[str, Any]]:
    """``modes`` for every variant (or those named in ``only``) on ``backend``
    (``variants``) at the ``shapes`` tier, printing as it goes."""
    os.environ[CACHE_ENV_VAR] = ""  # every run compiles from nothing, as a first campaign does
    rows = [r for r in variants(tests_dir, backend) if not only or r["variant"] in only]
    print(f"{'variant':58s} " + " ".join(f"{m:>9s}" for m in modes), flush=True)
    for row in rows:
        for mode in modes:
            row[mode] = time_to_find(row, mode, limit=limit, jobs=jobs, tests_dir=tests_dir, shapes=shapes)
        print(f"{row['variant']:58s} " + " ".join(f"{_fmt(row[m]):>9s}" for m in modes), flush=True)
    return rows


def _fmt(seconds: float | None) -> str:
    return "not found" if seconds is None else f"{seconds:.1f}"


def summary(rows: list[dict[str, Any]], limit: float) -> dict[str, Any]:
    """Medians (a variant not found counts as ``limit``: a lower bound on its time),
    the number never found, and the median of the per-variant ratios random / targeted."""
    out: dict[str, Any] = {"variants": len(rows), "limit_s": limit}
    if not all(mode in row for row in rows for mode in MODES):
        return out
    for mode in MODES:
        times = [limit if r[mode] is None else r[mode] for r in rows]
        out[f"{mode}_median_s"] = statistics.median(times) if times else None
        out[f"{mode}_not_found"] = sum(r[mode] is None for r in rows)
    ratios = [
        (limit if r["random"] is None else r["random"]) / (limit if r["targeted"] is None else r["targeted"])
        for r in rows
    ]
    out["median_speedup"] = statistics.median(ratios) if ratios else None
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m studies.time_to_find [--backend B [--shapes production]] [--tests DIR] [--limit S] [--jobs N]
    [--variant V ...] [--mode targeted|random] [--json PATH]``"""
    import argparse
    import json
    import os
    import sys

    import jax

    from pallascheck.cli._common import available_backend
    from pallascheck.properties import runner

    parser = argparse.ArgumentParser(
        prog="python -m studies.time_to_find",
        description="seconds a fuzz campaign takes to find each broken variant of "
        "tests/broken, targeted against random",
    )
    parser.add_argument(
        "--backend", default=None, help="the GPU backend (default: the CPU interpreters each variant is written for)"
    )
    parser.add_argument("--shapes", choices=runner.SHAPE_TIERS, default="small", help="the tier campaigns draw from")
    parser.add_argument("--tests", default="tests", help="the test directory holding broken/")
    parser.add_argument("--limit", type=float, default=120.0, help="seconds per campaign")
    parser.add_argument("--jobs", type=int, default=0, help="workers per campaign (default: as fuzz's)")
    parser.add_argument("--variant", action="append", help="only this MODULE/NAME (repeatable)")
    parser.add_argument("--mode", action="append", choices=MODES, help="only this search mode (repeatable)")
    parser.add_argument("--json", help="also write the results as JSON")
    args = parser.parse_args(argv)
    backend = available_backend(args.backend) if args.backend else None
    if args.shapes == "production" and (backend is None or backend.platform == "cpu"):
        sys.exit("--shapes production needs a GPU backend: add --backend mosaic_gpu (or triton)")
    rows = run(
        args.tests,
        limit=args.limit,
        jobs=args.jobs,
        only=args.variant,
        modes=tuple(args.mode or MODES),
        backend=backend,
        shapes=args.shapes,
    )
    result = summary(rows, args.limit)
    print("\n" + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "jax": jax.__version__,
                    "cores": os.cpu_count(),
                    "jobs": args.jobs,
                    "shapes": args.shapes,
                    "device": jax.devices()[0].device_kind,
                    "summary": result,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
