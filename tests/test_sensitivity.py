"""Sensitivity of the harness: every deliberately broken kernel in tests/broken/
must be caught by the same checks that pass the real kernels. The fraction caught
is the kill rate; anything below 100% fails the suite.

Each module in ``broken.MODULES`` exports ``VARIANTS``: variant name ->
(KernelSpec of the broken kernel, dtypes where it is wrong, examples to draw); may
export ``BACKENDS``, the backends its broken kernels run on (default: the
Pallas-generic ones; the Mosaic GPU variants run on ``mosaic_gpu``, and on a CPU
session in ``mosaic_gpu_interpret``); and may export ``NOT_ON``: variant name ->
{backend name: why the bug cannot exist there} (e.g. a wrong exact-gelu on a backend
that refuses exact gelu); those are skipped on that backend with the reason, and
count as neither caught nor survived.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from broken import MODULES
from pallascheck.kernels.backends import GENERIC, Backend
from pallascheck.properties import runner
from pallascheck.properties.pytest_plugin import backends_under_test

_MODULES = {module: importlib.import_module(f"broken.{module}") for module in MODULES}
VARIANTS = {
    f"{module}/{name}": (dataclasses.replace(spec, backends=getattr(m, "BACKENDS", GENERIC)), dtypes, examples)
    for module, m in _MODULES.items()
    for name, (spec, dtypes, examples) in m.VARIANTS.items()
}
NOT_ON = {
    f"{module}/{name}": backends
    for module, m in _MODULES.items()
    for name, backends in getattr(m, "NOT_ON", {}).items()
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "variant_case" in metafunc.fixturenames:
        cases = [
            (variant, backend)
            for backend in backends_under_test(metafunc.config)
            for variant in sorted(VARIANTS)
            if VARIANTS[variant][0].runs_on(backend)
        ]
        metafunc.parametrize("variant_case", cases, ids=[f"{v}-{b}" for v, b in cases])


def test_broken_variant_is_caught(variant_case: tuple[str, Backend]) -> None:
    variant, backend = variant_case
    if backend.name in NOT_ON.get(variant, {}):
        pytest.skip(f"{variant} does not exist on {backend.name}: {NOT_ON[variant][backend.name]}")
    spec, dtypes, examples = VARIANTS[variant]
    survived = []
    for dtype in dtypes:
        tally = runner.run_property(spec, dtype, backend, examples=examples, seed=0)
        if not tally.failure:
            survived.append(dtype)
    assert not survived, f"{variant} survived {examples} examples on {survived}"


CONTRACT_ONLY = [f"{module}/{name}" for module, m in _MODULES.items() for name in getattr(m, "CONTRACT_ONLY", ())]
# The checks against the implementation bound, without the contract and the relations
# (which are stated within the contract).
IMPLEMENTATION_CHECKS = ("values", "reference", "configs_agree", "gradients", "deterministic")


@pytest.mark.parametrize("variant", CONTRACT_ONLY)
def test_contract_only_variant_meets_its_own_bound(variant: str) -> None:
    """A kernel may be right about its own arithmetic and still be inaccurate: these
    variants pass every implementation-bound check and fail the accuracy contract."""
    spec, dtypes, examples = VARIANTS[variant]
    backend = Backend("interpret")
    for dtype in dtypes:
        own = runner.run_property(spec, dtype, backend, examples=examples, seed=0, selected=IMPLEMENTATION_CHECKS)
        assert not own.failure, own.failure
        contract = runner.run_property(spec, dtype, backend, examples=examples, seed=0, selected=("contract",))
        assert contract.failure.startswith("[contract]"), contract.failure
