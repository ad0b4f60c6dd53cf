"""Soundness and correctness of every registered kernel on every backend of the
session (``--backend``; the CPU default adds ``mosaic_gpu_interpret`` for the kernels
that have Mosaic GPU versions): values, the accuracy contract, xla_reference within
the same bound, configs agreeing, gradients, determinism, metamorphic relations; and
bad input raising the promised errors."""

from __future__ import annotations

import pytest

from pallascheck.properties import checks, runner
from pallascheck.properties.pytest_plugin import spec_tests
from pallascheck.properties.registry import registry

SPECS = registry()


# The plugin's spec_tests, as any project would use it: one test per spec x dtype x backend.
test_kernel_checks = spec_tests(*SPECS.values())


@pytest.mark.parametrize("name", sorted(SPECS))
def test_bad_inputs_raise_clear_errors(name: str) -> None:
    outcome = runner.run_errors(SPECS[name], context=checks.Context(kernel=name))
    assert outcome.examples > 0 and outcome.passed, outcome.detail
