"""Wall-clock timing for the benchmarks: medians of jitted calls after a warm-up,
each with ``block_until_ready``."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax


def median_seconds(fn: Callable[[], Any], repeats: int = 20) -> float:
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def best_config(make: Callable[[Any], Callable[[], Any]], configs: list[Any]) -> tuple[float, Any]:
    results = []
    for config in configs:
        try:
            results.append((median_seconds(make(config), repeats=5), config))
        except Exception as err:  # noqa: BLE001 - a config that does not compile is skipped, and said
            print(f"    config {config} failed: {type(err).__name__}: {str(err)[:120]}")
    return min(results, key=lambda r: r[0])
