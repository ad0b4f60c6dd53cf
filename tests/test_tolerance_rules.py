"""``python -m studies.tolerance_rules``: the five rules judge the same inputs, and the
contract-only variant shows how they differ (the implementation bound passes it, the
contract does not); Tokamax's own tolerances (the ``tokamax`` rule) apply by op and
dtype, and tell outputs apart that our bounds judge otherwise."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from broken import loss_variants
from pallascheck.kernels.backends import Backend
from pallascheck.properties.registry import registry
from pallascheck.properties.spec import Case
from studies import tokamax_tolerances, tolerance_rules

INTERPRET = Backend("interpret")


def test_rules_tell_a_contract_only_variant_apart() -> None:
    spec, _, examples = loss_variants.VARIANTS["lse_minus_target"]
    result = tolerance_rules.judge("lse_minus_target", spec, ("float32",), INTERPRET, examples, 0, "broken")
    assert result.caught["contract"] and not result.caught["implementation"], result
    # Tokamax's tests have no cross-entropy tolerance: not applicable, neither a kill nor a miss
    assert not result.applies["tokamax"] and result.worst["tokamax"] is None, result
    summary = tolerance_rules.summary([result])
    assert summary["contract"]["kills"] == 1 and summary["implementation"]["misses"] == 1
    assert summary["tokamax"] == {
        "kills": 0,
        "misses": 0,
        "false_alarms": 0,
        "variants": 1,
        "variants_applied": 0,
        "shipped": 0,
        "shipped_applied": 0,
    }


def test_specs_map_to_tokamax_ops_by_name() -> None:
    op_of = tokamax_tolerances.op_of
    assert op_of("layer_norm[ln_eps_outside_sqrt]") == op_of("tokamax:rms_norm:xla") == "normalization"
    assert (
        op_of("mosaic_gpu_attention[missing_rescale]")
        == op_of("tokamax:dot_product_attention:xla_chunked")
        == "attention"
    )
    assert op_of("lce_dropped_last_hidden_chunk") == "linear_softmax_cross_entropy_loss"
    assert op_of("glu[gate_and_up_swapped]") == "gated_linear_unit"
    assert op_of("ce_no_max_subtraction") is op_of("matmul[y_tile_wraps]") is op_of("top_k") is None
    assert tokamax_tolerances.applies("normalization", "bfloat16")
    assert not tokamax_tolerances.applies("normalization", "float16")
    assert not tokamax_tolerances.applies("gated_linear_unit", "float32")
    assert not tokamax_tolerances.applies(None, "float32")


def _rounded_kernel(spec, nudge_ulps: int = 0):
    """``spec`` with its kernel replaced by the oracle rounded to the inputs' dtype (a
    correctly rounded kernel), moved ``nudge_ulps`` ulps away from the exact value;
    gradients likewise, unmoved."""

    def out(case: Case, config, backend) -> np.ndarray:
        dtype = next(iter(case.arrays.values())).dtype
        exact = np.asarray(spec.expected(spec.oracle(case)), np.float64)
        values = exact.astype(dtype)
        for _ in range(nudge_ulps):
            away = np.where(values.astype(np.float64) >= exact, np.inf, -np.inf).astype(dtype)
            values = np.nextafter(values, away)
        return values

    def grads(case: Case, config, backend) -> dict[str, np.ndarray]:
        dtype = next(iter(case.arrays.values())).dtype
        exact = spec.gradients.oracle_vjp(case, spec.oracle(case))
        return {k: np.asarray(v, np.float64).astype(dtype) for k, v in exact.items()}

    gradients = spec.gradients and dataclasses.replace(spec.gradients, kernel_vjp=grads)
    return dataclasses.replace(spec, kernel=out, gradients=gradients)


def _norm_case(dtype) -> Case:
    rng = np.random.default_rng(0)
    return Case(
        {
            "x": rng.standard_normal((4, 32)).astype(dtype),
            "cotangent": rng.standard_normal((4, 32)).astype(dtype),
            "scale": np.full(32, 3.0, dtype),
            "offset": rng.standard_normal(32).astype(dtype),
        },
        {"eps": 1e-6},
    )


def test_tokamax_rule_applies_to_norms_in_bf16_not_f16() -> None:
    """Tokamax's norm tests hold f32 and bf16 tolerances, none for f16; against the
    oracle rounded as Tokamax rounds its reference, a correctly rounded bf16 layer norm
    passes (values and the three gradients) and one an ulp off fails (|y| up to ~9
    here, where an ulp is 0.03 > 2e-3 sqrt(32))."""
    spec = registry()["layer_norm"]
    bf16, f16 = _norm_case(ml_dtypes.bfloat16), _norm_case(np.float16)
    assert tolerance_rules.judge_case(_rounded_kernel(spec), f16, spec.default_config, INTERPRET)["tokamax"] is None
    verdict = tolerance_rules.judge_case(_rounded_kernel(spec), bf16, spec.default_config, INTERPRET)
    assert verdict["tokamax"] is not None and verdict["tokamax"] <= 1.0, verdict
    assert tolerance_rules.judge_case(_rounded_kernel(spec, 1), bf16, spec.default_config, INTERPRET)["tokamax"] > 1.0
    assert tokamax_tolerances.tolerance("normalization", "dscale", bf16).atol == 2e-3 * 10 * 2  # sqrt(4 rows)


def test_tokamax_rule_passes_a_glu_output_our_bound_fails() -> None:
    """A bf16 GLU output one ulp off the correctly rounded one: outside our bound (which
    allows the final rounding's half ulp and f32 dots), inside Tokamax's atol 0.1, rtol
    0.02 (gated_linear_unit/test_base.py:96); in f16 Tokamax's rule does not apply."""
    spec = dataclasses.replace(registry()["gated_linear_unit"], gradients=None)
    rng = np.random.default_rng(0)
    for dtype, applies in ((ml_dtypes.bfloat16, True), (np.float16, False)):
        case = Case(
            {
                "x": rng.standard_normal((17, 64)).astype(dtype),
                "weights": rng.standard_normal((64, 2, 16)).astype(dtype),
                "cotangent": rng.standard_normal((17, 16)).astype(dtype),
            },
            {"activation": "silu"},
        )
        verdict = tolerance_rules.judge_case(_rounded_kernel(spec), case, spec.default_config, INTERPRET)
        assert verdict["contract"] <= 1.0 and verdict["implementation"] <= 1.0, verdict  # correctly rounded passes
        verdict = tolerance_rules.judge_case(_rounded_kernel(spec, 1), case, spec.default_config, INTERPRET)
        assert verdict["implementation"] > 1.0 and verdict["contract"] > 1.0, verdict
        assert (verdict["tokamax"] is not None and verdict["tokamax"] <= 1.0) if applies else verdict["tokamax"] is None


def test_summary_counts_the_tokamax_rule_where_it_applies() -> None:
    rules = tolerance_rules.RULES
    yes, no = dict.fromkeys(rules, True), dict.fromkeys(rules, False)
    results = [
        tolerance_rules.Result("a", "broken", yes, yes, op="normalization"),
        tolerance_rules.Result("b", "broken", {**yes, "tokamax": False}, yes, op="ragged_dot"),
        tolerance_rules.Result("c", "broken", {**yes, "tokamax": False}, {**yes, "tokamax": False}),
        tolerance_rules.Result("d", "shipped", {**no, "tokamax": True}, yes, op="attention"),
        tolerance_rules.Result("e", "shipped", no, {**yes, "tokamax": False}),
        tolerance_rules.Result("f", "tokamax", {**no, "tokamax": True}, yes, op="attention"),
    ]
    tk = tolerance_rules.summary(results)["tokamax"]
    assert (tk["kills"], tk["misses"], tk["variants_applied"], tk["variants"]) == (1, 1, 2, 3)
    assert (tk["false_alarms"], tk["shipped_applied"], tk["shipped"]) == (1, 1, 2)  # the Tokamax group is apart
    by_op = tolerance_rules.tokamax_by_op(results)
    assert by_op["n/a"]["applied"] == 0 and by_op["attention"]["false_alarms"] == 1
    assert [r["tokamax_fails_what_we_pass"] for r in tolerance_rules.tokamax_rows(results)] == [True]


def test_fp8_rules_judge_fp8_kernels_only() -> None:
    """DeepGEMM's calc_diff and Transformer Engine's FP8 tolerance judge FP8 kernels
    (by the FP8 operands' dtype, or the format a quantiser writes) and nothing else;
    torch judges a quantiser's float8 output by exact equality."""
    assert tolerance_rules._applies("calc_diff", None, "float8_e4m3fn")
    assert not tolerance_rules._applies("transformer_engine", None, "bfloat16")
    fp8 = np.ones((2, 2)).astype(ml_dtypes.float8_e4m3fn)
    assert tolerance_rules.fp8_format(Case({"x": fp8}, {})) == "float8_e4m3fn"
    assert tolerance_rules.fp8_format(Case({"a": np.ones(2, np.float32)}, {"format": "float8_e5m2"})) == "float8_e5m2"
    assert tolerance_rules.fp8_format(Case({"x": np.ones(2, np.float32)}, {})) is None
    assert tolerance_rules.TORCH_RTOL_ATOL["float8_e5m2"] == (0.0, 0.0)


def test_calc_diff_is_global() -> None:
    """One element of 10^4 off by 100% moves calc_diff by about 1e-6 (its share of
    sum(y^2)): a pass that every elementwise rule fails; every element 10% off fails it
    (1 - 2 (1.1) / (1 + 1.21) = 4.5e-3)."""
    y = np.random.default_rng(0).standard_normal(10_000)
    one_wrong = y.copy()
    one_wrong[0] *= 2.0
    assert tolerance_rules.calc_diff_used(one_wrong, y) < 1.0
    assert tolerance_rules.calc_diff_used(1.1 * y, y) > 1.0
    assert tolerance_rules.calc_diff_used(np.zeros(3), np.zeros(3)) == 0.0
    assert tolerance_rules.calc_diff_used(np.array([np.nan]), np.array([1.0])) == np.inf
