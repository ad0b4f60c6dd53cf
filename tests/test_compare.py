"""``checks.compare``'s rules for non-finite values: an infinite bound (the model says a
rounding may overflow there) admits the inf or NaN that overflow makes, and only there;
a finite bound still fails a non-finite result, and a non-finite oracle value must be
matched exactly whatever the bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallascheck.kernels import gated_linear_unit as glu
from pallascheck.kernels.backends import Backend
from pallascheck.oracles import gated_linear_unit as glu_oracle
from pallascheck.oracles import numeric
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import checks


@pytest.mark.parametrize("where", ["host", "device"])
def test_an_infinite_bound_admits_non_finite_results_and_a_finite_one_does_not(where: str) -> None:
    expected = np.array([1.0, 1.0, 1.0, 1.0, np.inf, np.nan])
    actual = np.array([np.nan, np.inf, np.nan, -np.inf, np.nan, 2.0], np.float32)
    bound = np.array([np.inf, np.inf, 1e30, 1e30, np.inf, np.inf])
    if where == "device":
        with numeric.on_device(jax.devices("cpu")[0]):
            per_element = [
                checks.compare(
                    actual[i : i + 1], numeric.f64(expected[i : i + 1]), numeric.f64(bound[i : i + 1])
                ).passed
                for i in range(6)
            ]
    else:
        per_element = [
            checks.compare(actual[i : i + 1], expected[i : i + 1], bound[i : i + 1]).passed for i in range(6)
        ]
    # overflow admitted where unbounded; not under a finite bound; an inf or NaN oracle exactly matched
    assert per_element == [True, True, False, False, False, False]


def test_a_glu_gradient_that_overflows_where_its_bound_allows_passes() -> None:
    """dup = g * gate is 2^130 (beyond float32 and bfloat16) with g of both signs, so the
    kernel's dz holds +inf and -inf and dW = x^T dz sums them to NaN, where the float64
    oracle is exactly 0: the overflow the bound model declares (an infinite bound there),
    not a kernel error. Under a finite bound the same NaN fails. dx[:, 1] is inf times a
    zero weight, NaN too: its bound is unbounded as well (``algebra.matmul``)."""
    bf16 = ml_dtypes.bfloat16
    x = np.array([[2.0**60, 0.0], [2.0**60, 0.0]], bf16)
    w = np.zeros((2, 2, 1), bf16)
    w[0, 0, 0], w[0, 1, 0] = 2.0**60, 2.0**-60  # gate 2^120, up 1: the forward is finite
    g = np.array([[2.0**10], [-(2.0**10)]], bf16)
    backend = Backend("interpret")
    config = glu.configs(2, 1, 2, backend, itemsize=2)[0]
    _, vjp = jax.vjp(
        lambda a, b: glu.gated_linear_unit(a, b, activation=None, config=config, backend=backend),
        jnp.asarray(x),
        jnp.asarray(w),
    )
    dx, dw = (np.asarray(v) for v in vjp(jnp.asarray(g)))
    # dx = dz W^T: +-inf through the up weight, NaN where the inf meets x's zero column's weights
    assert np.isnan(np.asarray(dw, np.float32)[0, 1, 0]) and not np.isfinite(np.asarray(dx, np.float32)).any()

    ref = glu_oracle.oracle(x, w, activation="none")
    exact = glu_oracle.oracle_vjp(x, w, g, activation="none")
    bounds = glu_oracle.gradient_bound(
        ref,
        exact,
        x,
        w,
        g,
        activation="none",
        operand_dtype=bf16,
        arith=arithmetic_for(backend),
        block_k=config.block_k,
    )
    assert exact["dweights"][0, 1, 0] == 0.0 and np.isinf(bounds["dweights"][0, 1, 0])
    assert np.isinf(bounds["dx"]).all()  # including dx[:, 1], 0 times an unbounded dz
    outcome = checks.check_gradients(
        {"dx": dx, "dweights": dw}, exact, bounds, context=checks.Context("gated_linear_unit", "bfloat16", "interpret")
    )
    assert outcome.passed, outcome.detail
    finite = np.where(np.isinf(bounds["dweights"]), 1e300, bounds["dweights"])
    assert not checks.compare(dw, exact["dweights"], finite).passed
