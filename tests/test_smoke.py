"""One small case of every registered family on each backend that has it, every
check (the quick tier's reach into the kernels, oracles, bounds and the runner):
a drawn case of the small tier under the backend's default config."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, find, settings

from pallascheck.kernels.backends import Backend
from pallascheck.properties import checks, runner
from pallascheck.properties.registry import registry

SPECS = registry()
BACKENDS = (Backend("interpret"), Backend("mosaic_gpu_interpret"))
CASES = [
    (name, backend)
    for name, spec in sorted(SPECS.items())
    for backend in BACKENDS
    if spec.runs_on(backend) and (backend.name == "interpret" or spec.dtypes_for(backend) != spec.dtypes)
]


@pytest.mark.parametrize(("name", "backend"), CASES, ids=[f"{n}-{b}" for n, b in CASES])
def test_one_small_case_passes_every_check(name: str, backend: Backend) -> None:
    spec = SPECS[name]
    dtype = spec.dtypes_for(backend)[0]
    # the first draw of the small tier (derandomised, no shrinking): the smallest case
    case = find(
        spec.cases(dtype, backend),
        lambda case: True,
        settings=settings(database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck)),
    )
    tally = runner.check_case(
        spec, case, spec.default_config_for(backend), backend, context=checks.Context(kernel=name, dtype=dtype)
    )
    assert tally.outcomes and all(o.passed for o in tally.outcomes.values()), tally.outcomes
    assert {"values", "reference", "deterministic"} <= set(tally.outcomes), sorted(tally.outcomes)
