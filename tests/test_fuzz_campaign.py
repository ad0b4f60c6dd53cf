"""Fuzz campaigns find broken kernels, keep replayable reproducers, and lose nothing
when interrupted."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from broken.matmul_variants import VARIANTS
from pallascheck.fuzz import campaign, cli
from pallascheck.kernels.backends import Backend
from pallascheck.properties import checks, runner
from pallascheck.properties.matmul_spec import SPEC as MATMUL
from pallascheck.properties.spec import Case

DROPPED_TILE, _, _ = VARIANTS["dropped_last_k_tile"]


def _generic(backend: Backend) -> Backend:
    """The campaign is exercised with a Pallas-generic matmul variant in float32."""
    if backend.is_mosaic_gpu:
        pytest.skip(f"the campaign's test kernel is a Pallas-generic matmul variant in float32; {backend} has none")
    return backend


def _log(corpus: str) -> list[dict]:
    with open(os.path.join(corpus, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_campaign_keeps_a_replayable_reproducer(tmp_path, backend) -> None:
    backend = _generic(backend)
    corpus = str(tmp_path)
    result = campaign.run([DROPPED_TILE], backend, corpus, seconds=120, examples_per_round=30, dtypes=["float32"])
    assert len(result.findings) == 1 and not result.interrupted
    (finding,) = result.findings
    assert finding.saved and all(p.endswith(".npz") for p in finding.saved)
    log = _log(corpus)
    assert log[-1]["passed"] is False and log[-1]["saved"] == finding.saved

    case = Case.load(finding.saved[0])
    meta = case.params["__failure__"]
    case = Case(case.arrays, {k: v for k, v in case.params.items() if k != "__failure__"})
    config = type(MATMUL.default_config)(**meta["config"])
    context = checks.Context(kernel=DROPPED_TILE.name, dtype="float32", backend=str(backend))
    with pytest.raises(checks.CheckFailure):  # the reproducer still breaks the broken kernel
        runner.check_case(DROPPED_TILE, case, config, backend, context=context)
    runner.check_case(MATMUL, case, config, backend, context=context)  # and the real kernel passes it


def test_interrupted_campaign_keeps_what_it_found(tmp_path, backend) -> None:
    backend = _generic(backend)
    corpus = str(tmp_path)

    def off_by_one_then_interrupted(case, config, be):
        if any(p.startswith("round-") for p in os.listdir(corpus)):
            raise KeyboardInterrupt  # Ctrl-C while Hypothesis shrinks the first failure
        return np.asarray(MATMUL.kernel(case, config, be), np.float64) + 1.0

    spec = dataclasses.replace(MATMUL, name="matmul[plus_one]", kernel=off_by_one_then_interrupted)
    result = campaign.run([spec], backend, corpus, seconds=120, examples_per_round=10, dtypes=["float32"])
    assert result.interrupted
    saved = [f for d in os.listdir(corpus) if d.startswith("round-") for f in os.listdir(os.path.join(corpus, d))]
    assert saved == ["matmul[plus_one]-float32-values.npz"]


def test_fuzz_command_runs_a_clean_campaign(tmp_path) -> None:
    argv = ["fuzz", "--kernel", "rms_norm", "--dtype", "float32", "--minutes", "0.001", "--examples", "2",
            "--corpus", str(tmp_path)]
    assert cli.main(argv) == 0
    (entry,) = _log(str(tmp_path))
    assert entry["passed"] and entry["examples"] == 2
