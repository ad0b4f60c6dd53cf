"""studies/derived_references.py: the jax.numpy references of our kernels compute what
the family oracles compute (a wrong reference would show as a gap above the
derived bound: the only gap allowed is the rounding of the f32 constants it states), and the bounds derived from them hold for our kernels on one drawn
case per family, values and gradients. The measured tables (every family x dtype,
more cases, `verify` draws, the broken variants) are in docs/derived_bounds.md."""

from __future__ import annotations

import numpy as np
import pytest

from pallascheck.kernels.backends import Backend
from pallascheck.oracles import derive
from pallascheck.oracles.tolerance import CPU
from pallascheck.properties.registry import get_spec
from studies.derived_bounds import drawn_cases
from studies.derived_references import REFERENCES, judged, reference_gap


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_reference_is_the_oracle_and_its_bound_holds_for_our_kernel(name: str) -> None:
    spec = get_spec(name)
    backend = Backend("interpret")
    config = spec.default_config_for(backend)
    (case,) = drawn_cases(spec, "bfloat16", 1)
    stated = REFERENCES[name](case, config)
    ref = spec.oracle(case)
    expected = np.asarray(spec.expected(ref), np.float64)
    d = derive.derive(stated.fn, stated.args, facts=stated.facts, arith=CPU)
    bound = np.asarray(judged(spec, REFERENCES[name]).bound(case, ref, config, CPU))
    if stated.comparable:  # the gap is the f32 constants' rounding, which the derivation charges too
        own = np.where(d.unverifiable[0], np.inf, d.bounds[0]).reshape(expected.shape)
        assert np.all(reference_gap(d.values[0], expected) <= own)
    out = np.asarray(spec.kernel(case, config, backend)).astype(np.float64).reshape(expected.shape)
    finite = np.isfinite(expected)
    assert np.all(np.abs(out - expected)[finite] <= bound[finite])
    if spec.gradients is None:
        return
    exact = spec.gradients.oracle_vjp(case, ref)
    grads = spec.gradients.kernel_vjp(case, config, backend)
    bounds = judged(spec, REFERENCES[name]).gradients.bound(case, ref, exact, config, CPU)
    for g, b in bounds.items():
        e = np.asarray(exact[g], np.float64)
        got = np.asarray(grads[g]).astype(np.float64).reshape(e.shape)
        ok = np.isfinite(e)
        assert np.all(np.abs(got - e)[ok] <= np.asarray(b)[ok]), g
