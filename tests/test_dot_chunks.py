"""The dot-like families' float64 oracles, bounds, contracts and exact gradients in
spans of rows, columns and groups (oracles/chunks.py) are the whole computation's:
a small ``CHUNK_ELEMENTS`` makes small cases take many spans.

Not bitwise: a span computes the same products and the same K-term float64 sums,
but BLAS (numpy) and Eigen (XLA:CPU) pick their blocking of K by the operands'
shapes (a [300, 700] @ [700, 500] float64 product and its 8-row spans differ in the
last bit, numpy's and XLA's), and on a device the spans run op by op where the
whole is one fused program (properties/device/programs.py). So the test bounds the
difference by float64 reassociation, far below every bound."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest

from pallascheck.kernels.backends import Backend
from pallascheck.oracles import chunks, numeric
from pallascheck.oracles.tolerance import arithmetic_for, gamma, unit_roundoff
from pallascheck.properties.registry import get_spec
from pallascheck.properties.spec import Case, Layout

BF16 = ml_dtypes.bfloat16
# Values: a span reassociates float64 sums of n <= 64 terms (K, the tokens of a
# gradient's sum): |delta| <= 2 gamma_n(2^-53) sum|terms| <= 2^-45 sum|terms|, where
# every bound is >= 2^-24 sum|terms| (an f32 accumulation's gamma): <= 2^-21 bound.
VALUE_OF_BOUND = 2.0**-20
# Bounds: sums of non-negative terms (no cancellation), reassociated: <= 2^-45 relative,
# and the elementwise error algebra on them is the whole's.
BOUND_RTOL = 2.0**-40


def _matmul(activation: str) -> Case:
    rng = np.random.default_rng(1)
    arrays = {
        "x": rng.standard_normal((37, 52)),
        "y": rng.standard_normal((52, 45)),
        "cotangent": rng.standard_normal((37, 45)),
    }
    return Case({k: a.astype(BF16) for k, a in arrays.items()}, {"activation": activation, "out_dtype": "bfloat16"})


def _glu(activation: str) -> Case:
    rng = np.random.default_rng(2)
    arrays = {
        "x": rng.standard_normal((3, 13, 40)),
        "weights": rng.standard_normal((40, 2, 27)) / 8,
        "cotangent": rng.standard_normal((3, 13, 27)),
    }
    return Case({k: a.astype(BF16) for k, a in arrays.items()}, {"activation": activation})


def _ragged_dot() -> Case:
    rng = np.random.default_rng(3)
    arrays = {
        "lhs": rng.standard_normal((50, 24)),
        "rhs": rng.standard_normal((5, 24, 19)),
        "cotangent": rng.standard_normal((50, 19)),
    }
    arrays = {k: a.astype(np.float32) for k, a in arrays.items()}
    # an empty first group, groups straddling spans, rows past the last group
    arrays["group_sizes"] = np.array([0, 7, 20, 1, 15], np.int32)
    return Case(arrays, {})


CASES = {
    "matmul, gelu": ("matmul", _matmul("gelu")),
    "matmul, relu": ("matmul", _matmul("relu")),
    "gated_linear_unit, silu": ("gated_linear_unit", _glu("silu")),
    "ragged_dot": ("ragged_dot", _ragged_dot()),
}


def _evaluate(family: str, case: Case, where: str) -> dict[str, Any]:
    """Every value and bound the spec computes from its oracle, as it returns them:
    with numpy oracles (``where`` "host"), or on the CPU device, its results held on
    the host ("device, held") or not ("device")."""
    spec, arith = get_spec(family), arithmetic_for(Backend("interpret"))
    device = jax.devices("cpu")[0]
    on = numeric.on_device(device, hold_results=where == "device, held") if where != "host" else None
    with on or contextlib.nullcontext():
        ref = spec.oracle(case)
        results = {
            "out": spec.expected(ref),
            "bound": spec.bound(case, ref, spec.default_config, arith),
            "xla bound": spec.bound(case, ref, None, arith),
            "contract": spec.contract(case, ref, arith),
        }
        grads = spec.gradients.oracle_vjp(case, ref)
        results.update(grads)
        bounds = spec.gradients.bound(case, ref, grads, spec.default_config, arith)
        results.update({f"bound {k}": v for k, v in bounds.items()})
        contract = spec.gradients.contract(case, ref, grads, arith)
        results.update({f"contract {k}": v for k, v in contract.items()})
    return results


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("where", ["host", "device", "device, held"])
def test_spans_give_the_whole_results(name: str, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    family, case = CASES[name]
    whole = _evaluate(family, case, where)
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 64)  # spans of 1-2 rows, columns; groups one by one
    sizes = [a.shape for a in case.arrays.values()]
    assert all(max(s) * max(s) > 64 for s in sizes if len(s) > 1)  # every axis takes several spans
    spanned = _evaluate(family, case, where)
    assert set(spanned) == set(whole)
    if where != "host":  # a streamed case's results held on the host where asked; a whole case's on the device
        kind = np.ndarray if where == "device, held" else jax.Array
        assert all(isinstance(v, kind) for v in spanned.values()), {k: type(v) for k, v in spanned.items()}
        assert all(isinstance(v, jax.Array) for v in whole.values()), {k: type(v) for k, v in whole.items()}
    whole, spanned = ({k: np.asarray(v) for k, v in r.items()} for r in (whole, spanned))
    values = [k for k in whole if "bound" not in k and "contract" not in k]
    for key in values:
        assert spanned[key].shape == whole[key].shape, key
        gap = np.abs(spanned[key] - whole[key])
        judge = whole["bound"] if key == "out" else whole[f"bound {key}"] if f"bound {key}" in whole else None
        if judge is None:  # dz, dgate, dup: elementwise in the oracle's projections
            np.testing.assert_allclose(spanned[key], whole[key], rtol=2.0**-40, atol=0, err_msg=key)
        else:
            assert np.all(gap <= VALUE_OF_BOUND * judge), (key, float(np.max(gap / judge)))
    for key in set(whole) - set(values):
        np.testing.assert_allclose(spanned[key], whole[key], rtol=BOUND_RTOL, atol=0, err_msg=key)


def test_spans_rule() -> None:
    assert chunks.CHUNK_ELEMENTS == 2**24
    assert chunks.spans(8192, 14336) == [(s, s + 1024) for s in range(0, 8192, 1024)]
    assert chunks.spans(1, 28672) == [(0, 1)]  # a decode row: one span
    assert chunks.spans(4000, 4096) == [(0, 4000)]  # 1.6e7 elements fit
    assert chunks.spans(100, 2**25) == [(i, i + 1) for i in range(100)]  # one item over the budget: one at a time
    assert chunks.spans(0, 5) == [(0, 0)]
    with pytest.raises(ValueError, match="width must be >= 0"):
        chunks.spans(3, -1)


def test_oracle_rounding_is_far_below_the_smallest_bound() -> None:
    """The float64 oracle's own error, gamma_{K-1}(2^-53) |x| @ |y| for a K-term sum
    in any order, against the smallest dot bound of these families' model at that K:
    float32 accumulation in the shallowest order, pairwise, gamma_{ceil(log2 K)}(2^-24)
    |x| @ |y| (every order the model charges is at least as deep; the output rounding
    only adds), at the longest production reduction (K 28672, the 70B decode matmul):
    2^-18 of it."""
    k = 28672
    oracle_error = gamma(k - 1, unit_roundoff(np.float64))
    smallest_bound = gamma(int(np.ceil(np.log2(k))), unit_roundoff(np.float32))
    assert oracle_error < 2.0**-18 * smallest_bound


def _layout(family: str, prefix: str) -> Layout:
    (layout,) = [l for l in get_spec(family).production_layouts if l.name.startswith(prefix)]
    return layout


def test_the_streamed_rule_fits_every_layout_in_a_16_gib_share() -> None:
    """A streamed case holds its float64 results on the host (oracles/chunks.py), so
    by the rule every named layout of the three families fits a 16 GiB share of a
    GPU, DeepSeek-V3's 256 experts (23.7 GiB when the results stayed on the device;
    448 GiB by the rule before streaming, xla_reference's dense [g, m, max(k, n)] now
    charged apart by ``reference_bytes``), the GLU at 8k tokens and the Mixtral
    ragged dot included."""
    for family in ("matmul", "gated_linear_unit", "ragged_dot"):
        for layout in get_spec(family).production_layouts:
            assert layout.needs <= 16 * 2**30, (layout.name, layout.needs / 2**30)
    deepseek = _layout("ragged_dot", "DeepSeek-V3")
    assert deepseek.needs / 2**30 == pytest.approx(10.9, abs=0.1)
    m, k, n, g = 16384, 7168, 256, 256
    case = Case(
        {"lhs": np.broadcast_to(np.zeros((), BF16), (m, k)), "rhs": np.broadcast_to(np.zeros((), BF16), (g, k, n))}, {}
    )
    assert get_spec("ragged_dot").reference_bytes(case) == 16 * g * m * k  # 448 GiB


def test_a_case_whose_reference_does_not_fit_runs_every_other_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """ragged_dot's xla_reference runs densely: where its bytes exceed the process's
    share, the reference check is left out of the case, saying why, and the others run."""
    from pallascheck.properties import checks, production, runner

    spec, backend = get_spec("ragged_dot"), Backend("interpret")
    _, case = CASES["ragged_dot"]
    needs = spec.reference_bytes(case)
    monkeypatch.setattr(production, "memory_limit", lambda backend: needs - 1)
    tally = runner.check_case(
        spec, case, spec.default_config, backend, context=checks.Context(spec.name, "float32", "interpret")
    )
    assert "reference" not in tally.outcomes and set(tally.left_out) == {"reference"}
    assert tally.left_out["reference"].startswith(
        "xla_reference needs ~0 GiB at this layout, the process may use 0 GiB"
    )
    assert {"values", "gradients", "contract"} <= set(tally.outcomes), tally.outcomes
    monkeypatch.setattr(production, "memory_limit", lambda backend: needs)
    tally = runner.check_case(
        spec, case, spec.default_config, backend, context=checks.Context(spec.name, "float32", "interpret")
    )
    assert "reference" in tally.outcomes and not tally.left_out
