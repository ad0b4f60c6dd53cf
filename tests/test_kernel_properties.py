"""Soundness and correctness of every registered kernel on every backend of the
session (``--backend``; the CPU default adds ``mosaic_gpu_interpret`` for the kernels
that have Mosaic GPU versions): values, xla_reference within the same bound,
configs agreeing, gradients, determinism, metamorphic relations; and bad input
raising the promised errors."""
from __future__ import annotations

import pytest

from pallascheck.kernels.backends import Backend
from pallascheck.properties import checks, runner
from pallascheck.properties.pytest_plugin import backends_under_test
from pallascheck.properties.spec import registry

SPECS = registry()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kernel_case" in metafunc.fixturenames:
        cases = [
            (name, dtype, backend)
            for backend in backends_under_test(metafunc.config)
            for name, spec in SPECS.items() if spec.runs_on(backend)
            for dtype in spec.dtypes_for(backend)
        ]
        metafunc.parametrize("kernel_case", cases, ids=[f"{n}-{d}-{b}" for n, d, b in cases])


def test_kernel_checks(kernel_case: tuple[str, str, Backend], examples: int, request) -> None:
    name, dtype, backend = kernel_case
    replay = f"pytest '{request.node.nodeid}' --backend {request.config.getoption('--backend') or 'interpret'}"
    tally = runner.run_property(
        SPECS[name], dtype, backend, examples=examples, seed=0, replay_hint=replay
    )
    assert not tally.failure, tally.failure
    assert set(tally.outcomes) >= {"values", "reference", "deterministic"}
    cases = examples * runner.CASES_PER_LAYOUT
    per_case = {"metamorphic": len(SPECS[name].relations)}  # one example per relation
    assert all(o.examples == cases * per_case.get(k, 1) for k, o in tally.outcomes.items() if k != "configs_agree")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_bad_inputs_raise_clear_errors(name: str) -> None:
    outcome = runner.run_errors(SPECS[name], context=checks.Context(kernel=name))
    assert outcome.examples > 0 and outcome.passed, outcome.detail
