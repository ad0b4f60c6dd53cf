"""Fuzz campaigns: keep drawing inputs until a kernel breaks or time runs out.

A campaign runs rounds of ``runner.run_property`` over kernel x dtype pairs, each
round with a fresh Hypothesis seed, more examples than the test profiles and
shrinking on, so a failure is reported at its smallest input. Everything found is
written the moment it is found:

- ``CORPUS/round-<seed>/<kernel>-<dtype>-<check>.npz``: the failing case (arrays
  bit-exact), its config, backend and message; ``pallascheck replay FILE`` re-runs it;
- ``CORPUS/log.jsonl``: one line per finished (kernel, dtype, round) with its outcome,
  appended and flushed as it goes.

So a campaign that is interrupted (Ctrl-C, a killed job) loses at most the round in
flight, never a reproducer already found.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Sequence

from pallascheck.kernels.backends import Backend
from pallascheck.properties import runner
from pallascheck.properties.spec import KernelSpec


@dataclasses.dataclass
class Finding:
    kernel: str
    dtype: str
    seed: int
    message: str
    saved: list[str]


@dataclasses.dataclass
class CampaignResult:
    rounds: int = 0
    examples: int = 0
    findings: list[Finding] = dataclasses.field(default_factory=list)
    interrupted: bool = False


def run(
    specs: Sequence[KernelSpec],
    backend: Backend,
    corpus: str,
    *,
    seconds: float,
    examples_per_round: int = 50,
    first_seed: int = 0,
    dtypes: Sequence[str] | None = None,
) -> CampaignResult:
    """Fuzz ``specs`` on ``backend`` for about ``seconds`` (a round in flight finishes);
    each round checks ``examples_per_round`` cases per (kernel, dtype), as verify's
    ``--examples`` counts them.

    A (kernel, dtype) pair that failed is not fuzzed again in later rounds: its
    reproducer is in the corpus, and the other pairs get the time.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    if examples_per_round < 1:
        raise ValueError(f"examples_per_round must be >= 1, got {examples_per_round!r}")
    os.makedirs(corpus, exist_ok=True)
    pairs = [(s, d) for s in specs for d in s.dtypes_for(backend) if dtypes is None or d in dtypes]
    if not pairs:
        raise ValueError("no (kernel, dtype) pair to fuzz: check --kernel and --dtype")
    result = CampaignResult()
    deadline = time.monotonic() + seconds
    seed = first_seed
    broken: set[tuple[str, str]] = set()
    try:
        with open(os.path.join(corpus, "log.jsonl"), "a") as log:
            while time.monotonic() < deadline and len(broken) < len(pairs):
                for spec, dtype in pairs:
                    if (spec.name, dtype) in broken or time.monotonic() >= deadline:
                        continue
                    found, examples = _round(spec, dtype, backend, corpus, seed, examples_per_round, log)
                    result.examples += examples
                    if found is not None:
                        broken.add((spec.name, dtype))
                        result.findings.append(found)
                result.rounds += 1
                seed += 1
    except KeyboardInterrupt:
        result.interrupted = True
    return result


def _round(
    spec: KernelSpec, dtype: str, backend: Backend, corpus: str, seed: int, examples: int, log
) -> tuple[Finding | None, int]:
    """One Hypothesis run; (the finding or None, the examples it checked)."""
    directory = os.path.join(corpus, f"round-{seed}")
    replay = f"pallascheck replay {directory}/{spec.name}-{dtype}-<check>.npz"
    start = time.monotonic()
    tally = runner.run_property(
        spec, dtype, backend, examples=runner.examples_for(examples), seed=seed, shrink=True,
        failure_dir=directory, replay_hint=replay,
    )
    saved = sorted(
        os.path.join(directory, f) for f in (os.listdir(directory) if os.path.isdir(directory) else ())
        if f.startswith(f"{spec.name}-{dtype}-")
    )
    checked = tally.outcomes["values"].examples if "values" in tally.outcomes else 0
    entry = {
        "kernel": spec.name, "dtype": dtype, "backend": str(backend), "seed": seed, "examples": checked,
        "seconds": round(time.monotonic() - start, 2), "passed": not tally.failure, "saved": saved,
        "budget_used": {k: (None if o.budget_used == float("inf") else o.budget_used) for k, o in tally.outcomes.items()},
    }
    log.write(json.dumps(entry) + "\n")
    log.flush()
    return (Finding(spec.name, dtype, seed, tally.failure, saved) if tally.failure else None), checked
