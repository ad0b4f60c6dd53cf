"""Soundness and correctness of every registered kernel: values, xla_reference
within the same bound, configs agreeing, gradients, determinism, metamorphic
relations; and bad input raising the promised errors."""
from __future__ import annotations

import pytest

from pallascheck.properties import checks, runner
from pallascheck.properties.spec import registry

SPECS = registry()
CASES = [(name, dtype) for name, spec in SPECS.items() for dtype in spec.dtypes]


@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_kernel_checks(name: str, dtype: str, backend, examples: int, request) -> None:
    replay = f"pytest '{request.node.nodeid}' --backend {backend}"
    tally = runner.run_property(
        SPECS[name], dtype, backend, examples=examples, seed=0, replay_hint=replay
    )
    assert not tally.failure, tally.failure
    assert set(tally.outcomes) >= {"values", "reference", "deterministic"}
    assert all(o.examples == examples for k, o in tally.outcomes.items() if k != "configs_agree")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_bad_inputs_raise_clear_errors(name: str) -> None:
    outcome = runner.run_errors(SPECS[name], context=checks.Context(kernel=name))
    assert outcome.examples > 0 and outcome.passed, outcome.detail
