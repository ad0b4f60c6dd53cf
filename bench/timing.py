"""Wall-clock timing for the benchmarks: medians of jitted calls after a warm-up,
each with ``block_until_ready``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np


def sample_seconds(fn: Callable[[], Any], repeats: int = 20) -> list[float]:
    """Wall times of ``repeats`` calls after one untimed call (compile + warm-up)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def interleaved_seconds(
    fns: Sequence[Callable[[], Any]],
    repeats: int,
    seed: int = 0,
    burst: int = 1,
    prepare: Callable[[], Any] | None = None,
) -> list[list[float]]:
    """Seconds per call of each of ``fns`` (already warmed up), ``repeats`` samples
    each, taken in rounds: each round times every function once, in a shuffled order,
    so that drift (clocks ramping up, a neighbour's load) falls on all of them alike.
    A sample is ``burst`` calls issued back to back and waited for once, divided by
    ``burst``: above 1 it measures the device's time per call rather than one call's
    dispatch and synchronisation latency. ``prepare()`` runs and is waited for before
    each sample, outside its time (the gate flushes the L2 cache there)."""
    order = np.random.default_rng(seed)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i in order.permutation(len(fns)):
            if prepare is not None:
                jax.block_until_ready(prepare())
            start = time.perf_counter()
            results = [fns[i]() for _ in range(burst)]
            jax.block_until_ready(results)
            times[i].append((time.perf_counter() - start) / burst)
    return times


def interleaved_samples[K: Hashable](
    thunks: dict[K, Callable[[], Any]], repeats: int, burst: int = 1
) -> tuple[dict[K, list[float]], dict[K, str]]:
    """Seconds per call of each named thunk, ``repeats`` samples each, timed together
    in shuffled rounds (``interleaved_seconds``), and the error of each thunk whose
    warm-up call failed: a competitor that does not compile or run is recorded, not
    fatal."""
    runnable: dict[K, Callable[[], Any]] = {}
    errors: dict[K, str] = {}
    for name, thunk in thunks.items():
        try:
            jax.block_until_ready(thunk())
            runnable[name] = thunk
        except Exception as err:  # noqa: BLE001 - recorded by the caller in its row
            errors[name] = f"{type(err).__name__}: {str(err)[:200]}"
    samples = interleaved_seconds(list(runnable.values()), repeats, burst=burst)
    return dict(zip(runnable, samples)), errors


def interleaved_medians[K: Hashable](
    thunks: dict[K, Callable[[], Any]], repeats: int, burst: int = 1
) -> tuple[dict[K, float], dict[K, str]]:
    """The medians of :func:`interleaved_samples`, and its errors."""
    samples, errors = interleaved_samples(thunks, repeats, burst)
    return {name: statistics.median(times) for name, times in samples.items()}, errors


def fastest(
    make: Callable[[Any], Callable[[], Any]], candidates: Sequence[Any], repeats: int, burst: int = 1
) -> tuple[float, Any] | None:
    """(median seconds per call, candidate) of the fastest candidate whose thunk
    ``make(candidate)`` runs, all timed together (``interleaved_medians``): timing each
    candidate's calls in a row let clock drift pick a slower config on the H200. A
    candidate that fails is said and skipped; None when none ran."""
    medians, errors = interleaved_medians({i: make(c) for i, c in enumerate(candidates)}, repeats, burst=burst)
    for i, err in errors.items():
        print(f"    config {candidates[i]} failed: {err[:120]}")
    if not medians:
        return None
    best = min(medians, key=medians.__getitem__)
    return medians[best], candidates[best]


def median_seconds(fn: Callable[[], Any], repeats: int = 20) -> float:
    return statistics.median(sample_seconds(fn, repeats))


def best_config(make: Callable[[Any], Callable[[], Any]], configs: list[Any]) -> tuple[float, Any]:
    results = []
    for config in configs:
        try:
            results.append((median_seconds(make(config), repeats=10), config))
        except Exception as err:  # noqa: BLE001 - a config that does not compile is skipped, and said
            print(f"    config {config} failed: {type(err).__name__}: {str(err)[:120]}")
    return min(results, key=lambda r: r[0])


def peak_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """Argument + output + temporary bytes of ``jax.jit(fn)`` compiled for ``args``
    (arrays or ShapeDtypeStructs: nothing runs)."""
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    if stats is None:
        raise RuntimeError("the compiled program has no memory analysis on this backend")
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes)


def print_row(row: dict) -> None:
    """One benchmark row on one line, floats to three figures."""
    print("  " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
