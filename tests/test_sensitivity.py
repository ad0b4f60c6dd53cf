"""Sensitivity of the harness: every deliberately broken kernel in tests/broken/
must be caught by the same checks that pass the real kernels. The fraction caught
is the kill rate; anything below 100% fails the suite.

Each module in ``broken.MODULES`` exports ``VARIANTS``: variant name ->
(KernelSpec of the broken kernel, dtypes where it is wrong, examples to draw).
"""
from __future__ import annotations

import importlib

import pytest

from broken import MODULES
from pallascheck.properties import runner

VARIANTS = {
    f"{module}/{name}": variant
    for module in MODULES
    for name, variant in importlib.import_module(f"broken.{module}").VARIANTS.items()
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_broken_variant_is_caught(variant: str, backend) -> None:
    spec, dtypes, examples = VARIANTS[variant]
    survived = []
    for dtype in dtypes:
        tally = runner.run_property(spec, dtype, backend, examples=examples, seed=0)
        if not tally.failure:
            survived.append(dtype)
    assert not survived, f"{variant} survived {examples} examples on {survived}"
