"""Honest timing of a candidate (hardware only): fresh inputs for every call, the L2
cache flushed before each, ``block_until_ready``, interleaved in shuffled rounds with
the reference under ``jax.jit`` (XLA's version of the op: what a user writes instead),
the outputs of the timed calls validated against the oracle afterwards, and the spread
of the per-round speedups reported."""

from __future__ import annotations

import itertools
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.bench import timing
from pallascheck.bench.gate import probes, units
from pallascheck.bench.gate.candidate import Candidate
from pallascheck.bench.gate.task import Task
from pallascheck.kernels.backends import Backend

NOT_TIMED = "not timed: the interpret backend's time says nothing of a GPU's"
# Distinct input sets the timed calls cycle through: a result cached by input identity
# or position is then stale for the next call, and re-validation shows it.
INPUT_SETS = 4
REPEATS = 30
# Bytes written between samples: above the largest L2 of the GPUs run here (H100 50 MiB,
# H200 50 MiB) by 4x, so no input or output of the last call is left in it.
FLUSH_BYTES = 4 * 50 * 2**20


def time_candidate(task: Task, candidate: Candidate, unit: units.Unit, backend: Backend, seed: int) -> dict[str, Any]:
    """The timing entry of the verdict."""
    if backend.is_interpreted:
        return {"status": "not timed", "summary": NOT_TIMED}
    spec = units.unit_spec(task, candidate, unit, 0)
    cases = [units.case(task, unit, seed + 100 + i) for i in range(INPUT_SETS)]
    inputs = [[jnp.asarray(a) for a in units.arguments(task, c)] for c in cases]
    jax.block_until_ready(inputs)
    interpret = backend.interpret_arg()
    kernel = jax.jit(lambda *a: candidate.call(interpret, *a, **unit.options))
    reference = jax.jit(lambda *a: task.reference(*a, **unit.options))
    flush = jnp.zeros((FLUSH_BYTES // 4,), jnp.float32)
    flush_fn = jax.jit(lambda b: b + 1.0)
    outputs: dict[int, Any] = {}
    turns = {"kernel": itertools.count(), "reference": itertools.count()}

    def thunk(name: str, fn: Any) -> Any:
        def call() -> Any:
            i = next(turns[name]) % INPUT_SETS
            out = fn(*inputs[i])
            if name == "kernel":
                outputs[i] = out
            return out

        return call

    for fn in (kernel, reference):  # compile and warm up outside the samples
        jax.block_until_ready([fn(*x) for x in inputs])
    samples = timing.interleaved_seconds(
        [thunk("kernel", kernel), thunk("reference", reference)],
        REPEATS,
        seed=seed,
        prepare=lambda: flush_fn(flush),
    )
    revalidated = [probes.judged(spec, cases[i], backend)(out) for i, out in outputs.items()]
    kernel_s, reference_s = samples
    ratios = sorted(r / k for k, r in zip(kernel_s, reference_s))
    quartiles = np.quantile(ratios, [0.25, 0.5, 0.75])
    speedup = float(quartiles[1])
    result = {
        "status": "timed",
        "unit": unit.label(),
        "kernel_median_s": statistics.median(kernel_s),
        "reference_median_s": statistics.median(reference_s),
        "speedup_median": speedup,
        "speedup_quartiles": [float(quartiles[0]), float(quartiles[2])],
        "speedup_range": [ratios[0], ratios[-1]],
        "rounds": REPEATS,
        "revalidated": all(o.passed for o in revalidated),
        "revalidated_worst_budget": max(o.budget_used for o in revalidated),
        "device": jax.devices(backend.platform)[0].device_kind,
    }
    result["summary"] = (
        f"{speedup:.2f}x the jitted reference (quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f}, "
        f"{REPEATS} interleaved rounds, fresh inputs, L2 flushed); timed outputs "
        + ("re-validated" if result["revalidated"] else "WRONG after the timed calls")
    )
    return result
