"""The oracles and bounds computed in JAX float64 on a device (oracles/numeric.py)
are the host's numpy ones: the same code path, checked here on the CPU device, which
is what runs on a GPU backend. The oracle's own error (XLA may fuse a multiply-add
or sum in another order than numpy) must stay far below the smallest bound it is
compared with: here below 1e-6 of it, elementwise."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from pallascheck.kernels.backends import Backend
from pallascheck.oracles import numeric
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties.registry import get_spec

# the families with a Mosaic GPU kernel: their oracles are written against numeric.xp
DEVICE_SPECS = ("attention", "matmul", "ragged_dot", "gated_linear_unit")
ORACLE_OWN_ERROR = 1e-6  # of the bound: float64 reorderings are ~2^-53 n, bounds >= 2^-24 n


def _evaluate(spec, case, config, arith):
    ref = spec.oracle(case)
    out = {"out": spec.expected(ref)}
    bounds = {"out": spec.bound(case, ref, config, arith)}
    if spec.gradients is not None:
        exact = spec.gradients.oracle_vjp(case, ref)
        grad_bounds = spec.gradients.bound(case, ref, exact, config, arith)
        out.update({k: exact[k] for k in grad_bounds})
        bounds.update(grad_bounds)
    return (
        {k: np.asarray(v, dtype=np.float64) for k, v in out.items()},
        {k: np.asarray(np.broadcast_to(v, np.shape(out[k])), dtype=np.float64) for k, v in bounds.items()},
    )


@pytest.mark.parametrize("name", DEVICE_SPECS)
def test_device_oracles_match_the_host(name: str) -> None:
    spec = get_spec(name)
    backend = Backend("interpret")
    arith = arithmetic_for(backend)
    cpu = jax.devices("cpu")[0]
    seen = []

    @settings(max_examples=3, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(spec.cases("bfloat16" if "bfloat16" in spec.dtypes else spec.dtypes[0], backend))
    def compare(case):
        config = spec.default_config_for(backend)
        host_out, host_bound = _evaluate(spec, case, config, arith)
        with numeric.on_device(cpu):
            device_out, device_bound = _evaluate(spec, case, config, arith)
        assert not jax.config.jax_enable_x64  # float64 was enabled for the block only
        for key in host_out:
            finite = np.isfinite(host_out[key])
            np.testing.assert_array_equal(finite, np.isfinite(device_out[key]), err_msg=key)
            gap = np.abs(np.where(finite, host_out[key] - device_out[key], 0.0))
            assert np.all(gap <= ORACLE_OWN_ERROR * host_bound[key]), (key, float(np.max(gap)))
            np.testing.assert_allclose(device_bound[key], host_bound[key], rtol=1e-9, err_msg=key)
        seen.append(case)

    compare()
    assert len(seen) == 3


def _attention_case(bias_shape: tuple[int, ...] | None):
    """b2, 4 q heads on 2 kv heads, causal and masked: sliced by batch and kv head."""
    import ml_dtypes

    from pallascheck.properties.spec import Case

    rng = np.random.default_rng(0)
    bf16 = ml_dtypes.bfloat16
    arrays = {
        "q": rng.standard_normal((2, 33, 4, 16)),
        "k": rng.standard_normal((2, 40, 2, 16)),
        "v": rng.standard_normal((2, 40, 2, 16)),
        "cotangent": rng.standard_normal((2, 33, 4, 16)),
    }
    arrays = {k: v.astype(bf16) for k, v in arrays.items()} | {"mask": rng.random((2, 4, 33, 40)) < 0.7}
    if bias_shape:
        arrays["bias"] = rng.standard_normal(bias_shape).astype(bf16)
    return Case(arrays, {"causal": True, "sm_scale": None})


# no bias: sliced by batch and kv head; a per-key bias: by batch only; a bias shared by
# the batch: by kv head only
@pytest.mark.parametrize("bias_shape", [None, (2, 1, 1, 40), (1, 4, 33, 40)])
def test_sliced_attention_oracle_is_the_whole_one(bias_shape, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large attention case is computed on the device one (batch, kv head) slice at a
    time (properties/families/attention_slices.py): the same values and bounds as the whole."""
    from pallascheck.properties.families import attention_slices

    spec, arith = get_spec("attention"), arithmetic_for(Backend("interpret"))
    case = _attention_case(bias_shape)
    results, kinds = [], []
    for threshold in (2**62, 1):  # never sliced, always sliced
        monkeypatch.setattr(attention_slices, "SLICE_ELEMENTS", threshold)
        with numeric.on_device(jax.devices("cpu")[0]):
            kinds.append(type(spec.oracle(case)).__name__)
            results.append(_evaluate(spec, case, spec.default_config, arith))
    assert kinds == ["AttentionOracle", "Sliced"]
    (whole_out, whole_bound), (sliced_out, sliced_bound) = results
    for key in whole_out:
        np.testing.assert_allclose(sliced_bound[key], whole_bound[key], rtol=1e-9, err_msg=key)
        gap = np.abs(np.where(np.isfinite(whole_out[key]), whole_out[key] - sliced_out[key], 0.0))
        assert np.all(gap <= ORACLE_OWN_ERROR * whole_bound[key]), (key, float(np.max(gap)))


def test_compare_on_the_device_is_compare_on_the_host() -> None:
    """checks.compare of a device oracle runs there and says the same: budget, worst
    element, message (NaN and infinite oracles included)."""
    from pallascheck.properties import checks

    rng = np.random.default_rng(1)
    expected = rng.standard_normal((6, 7))
    expected[0, 0], expected[1, 1] = np.nan, np.inf
    actual = (expected + rng.standard_normal((6, 7)) * 1e-3).astype(np.float32)
    actual[1, 1] = np.inf
    bound = np.full((6, 7), 2e-3)
    bound[3, 4] = 1e-9  # the planted failure
    host = checks.compare(actual, expected, bound)
    with numeric.on_device(jax.devices("cpu")[0]):
        device = checks.compare(actual, numeric.f64(expected), numeric.f64(bound))
    assert (device.passed, device.budget_used, device.detail, device.worst) == (
        host.passed,
        host.budget_used,
        host.detail,
        host.worst,
    )
    assert not host.passed and host.worst.index == (3, 4)


@pytest.mark.parametrize("planted", [[(3, 4)], [(4, 5), (2, 1)], [(0, 2)]])
def test_compare_of_results_held_on_the_host_is_compare_on_the_host(planted, monkeypatch: pytest.MonkeyPatch) -> None:
    """Results the device oracles hold on the host (a chunked attention case) are
    compared on the device a block at a time: the same budget, worst element and
    message as the whole comparison, the first of equal worst elements where they fall
    in different blocks, a NaN and an infinite oracle included."""
    from pallascheck.properties import checks

    monkeypatch.setattr(checks, "HELD_BLOCK", 5)  # 42 elements: 9 blocks
    rng = np.random.default_rng(2)
    expected = rng.standard_normal((6, 7))
    expected[0, 0], expected[1, 1] = np.nan, np.inf
    actual = (expected + 1e-3).astype(np.float32)
    actual[1, 1] = np.inf
    bound = np.full((6, 7), 2e-3)
    for where in planted:  # budgets of exactly 8, equal where two are planted
        expected[where], actual[where], bound[where] = 0.5, 1.5, 0.125
    host = checks.compare(actual, expected, bound)
    with numeric.on_device(jax.devices("cpu")[0]):
        held = checks.compare(actual, expected, bound)
    assert (held.passed, held.budget_used, held.detail, held.worst) == (
        host.passed,
        host.budget_used,
        host.detail,
        host.worst,
    )
    assert not host.passed and host.worst.index == min(planted)


def _budgets(spec, case, config, backend: Backend, oracles: str, monkeypatch: pytest.MonkeyPatch):
    from pallascheck.properties import checks, runner

    monkeypatch.setenv(runner.ORACLES_ENV_VAR, oracles)
    tally = runner.check_case(spec, case, config, backend, context=checks.Context(spec.name, "bfloat16", "interpret"))
    return (
        {k: o.budget_used for k, o in tally.outcomes.items()}
        | {f"contract {k}": b for k, b in tally.contract_budgets.items()}
        | {"probabilistic": tally.probabilistic_budget}
    )


@pytest.mark.parametrize(
    "name, streamed",
    [
        ("attention", None),
        ("attention", "held"),
        ("matmul", None),
        ("matmul", "fits"),
        ("matmul", "held"),
        ("gated_linear_unit", "held"),
        ("ragged_dot", "held"),
    ],
)
def test_a_case_checked_with_device_oracles_is_checked_as_on_the_host(
    name: str, streamed: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With device oracles the runner asks for a case's oracle and bounds from several
    threads at once, compiled together and run one at a time (runner.py,
    properties/device/programs.py): every check sees the budgets the host's numpy
    oracles give. Attention is sliced and chunked, every chunk's programs shared by
    the threads. A chunked attention case, like a streamed dot-like case (many spans:
    oracles/chunks.py), keeps its results on the device where the process's share
    holds them, and else holds them on the host and is compared there a block at a
    time."""
    from pallascheck.oracles import chunks
    from pallascheck.properties import checks
    from pallascheck.properties.families import attention_slices

    spec, backend = get_spec(name), Backend("interpret")
    monkeypatch.setattr(attention_slices, "SLICE_ELEMENTS", 1)
    held = []
    if streamed:
        monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 64)
        monkeypatch.setattr(checks, "HELD_BLOCK", 100)
        real = checks.compare

        def spied(actual, expected, bound, **kw):
            held_there = numeric.active_device() is not None and isinstance(expected, np.ndarray)
            if held_there and isinstance(bound, np.ndarray):  # the device oracle's results, held on the host
                held.append(kw.get("check", "values"))
            return real(actual, expected, bound, **kw)

        monkeypatch.setattr(checks, "compare", spied)
        # more than any share of the device, or less
        spec = dataclasses.replace(spec, results_on_device_bytes=lambda case: 2**62 if streamed == "held" else 1)
    seen = []

    @settings(
        max_examples=1 if streamed else 2,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(spec.cases("bfloat16", backend))
    def compare(drawn):
        case = _attention_case(None) if name == "attention" else drawn
        configs = spec.configs(case, backend)
        config = next((c for c in configs if c != spec.default_config_for(backend)), configs[0])
        host = _budgets(spec, case, config, backend, "host", monkeypatch)
        device = _budgets(spec, case, config, backend, "device", monkeypatch)
        assert not jax.config.jax_enable_x64
        assert set(host) >= {"values", "reference", "gradients", "contract"} and set(device) == set(host)
        for key in host:
            assert device[key] == pytest.approx(host[key], rel=1e-6, abs=1e-12), key
        seen.append(case)

    compare()
    assert len(seen) == (1 if streamed else 2)
    # the oracle's values (values, reference, contract, probabilistic) or gradients compared held, or none
    assert bool({"values", "gradients"} & set(held)) == (streamed == "held"), held


def test_a_sliced_case_serves_each_round_of_its_checks_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner asks a sliced attention case's oracle-side calls in rounds (those of
    the oracle, then those that read the exact gradients: none for attention, whose
    gradient bounds read no exact gradient); each round is one pass over the slices and
    chunks, whatever order its threads ask in (properties/device/programs.py,
    ``SharedPasses``)."""
    import dataclasses

    from pallascheck.properties import checks, runner
    from pallascheck.properties.families import attention_slices

    monkeypatch.setattr(attention_slices, "SLICE_ELEMENTS", 2 * 16 * 40)  # chunks of 16 rows
    monkeypatch.setenv(runner.ORACLES_ENV_VAR, "device")
    spec, backend = get_spec("attention"), Backend("interpret")
    plans = []

    def oracle(case):
        plans.append(spec.oracle(case))
        return plans[-1]

    checked = dataclasses.replace(spec, oracle=oracle)
    case = _attention_case(None)
    selected = ("values", "gradients", "contract")
    tally = runner.check_case(
        checked,
        case,
        spec.default_config,
        backend,
        context=checks.Context("attention", "bfloat16", "interpret"),
        selected=selected,
    )
    assert set(tally.outcomes) == set(selected)
    (plan,) = plans
    assert isinstance(plan, attention_slices.Sliced) and plan.rows == 16
    # expected, the exact gradients, the bound, its probabilistic variant, the contract,
    # the gradient bound and gradient contract: one pass
    assert plan.passes.served == [7]


def test_error_products_stay_unbounded_where_an_unbounded_error_meets_a_zero() -> None:
    """``algebra.matmul`` of error terms: 0 * inf = inf (the kernel's 0 times an
    overflowed inf is NaN), inf * nonzero = inf, a NaN kept, else the plain product;
    the same on the host and on the device."""
    from pallascheck.oracles import algebra

    a = np.array([[np.inf, 1.0], [0.0, 2.0], [np.nan, 0.0]])
    b = np.array([[0.0, 3.0], [1.0, 0.0]])
    finite = np.array([[1.0, 2.0], [3.0, 4.0]])
    want = np.array([[np.inf, np.inf], [2.0, 0.0], [np.nan, np.nan]])
    np.testing.assert_array_equal(algebra.matmul(a, b), want)
    np.testing.assert_array_equal(algebra.times(a[:, :1], b[:1].T[:1]), [[np.inf], [0.0], [np.nan]])
    with numeric.on_device(jax.devices("cpu")[0]):
        on_device = np.asarray(algebra.matmul(numeric.f64(a), numeric.f64(b)))
        jitted = np.asarray(jax.jit(algebra.matmul)(numeric.f64(a), numeric.f64(b)))
        plain = np.asarray(algebra.matmul(numeric.f64(finite), numeric.f64(b)))
    np.testing.assert_array_equal(on_device, want)
    np.testing.assert_array_equal(jitted, want)
    np.testing.assert_array_equal(plain, finite @ b)


def _overflowing_dz(family: str):
    """Inputs of ``family``'s oracle where dz may overflow f32, with exact zeros in x and
    the weights: for GLU up = 1e37 times a cotangent of 100; for matmul a cotangent near
    float32's largest value, which dz = g * act'(z) may round past."""
    x = np.zeros((3, 4), np.float32)
    if family == "gated_linear_unit":
        x[:, 0], x[1, 1] = 1e18, 1.0
        w = np.zeros((4, 2, 6), np.float32)
        w[0, 0], w[0, 1], w[1, 1, 2] = -1e-18, 1e19, 0.5
        return x, w, np.full((3, 6), 100.0, np.float32)
    x[:, 0], x[1, 1] = 2.0, 1.0
    y = np.zeros((4, 5), np.float32)
    y[0], y[1, 2] = 1.0, 0.5
    return x, y, np.full((3, 5), 3.4e38, np.float32)


@pytest.mark.parametrize("family", ["gated_linear_unit", "matmul"])
def test_gradient_bound_stays_a_number_where_dz_may_overflow(family: str) -> None:
    """Where dz may overflow its error is unbounded, and so is every product of it, an
    exact zero's included (0 times an overflowed inf is NaN in the kernel): no gradient
    bound is NaN (a NaN bound fails every kernel)."""
    import importlib

    module = importlib.import_module(f"pallascheck.oracles.{family}")
    x, w, g = _overflowing_dz(family)
    ref = module.oracle(x, w, activation="silu")
    grads = module.oracle_vjp(x, w, g, activation="silu")
    bound = module.gradient_bound(
        ref,
        grads,
        x,
        w,
        g,
        activation="silu",
        operand_dtype=np.float32,
        arith=arithmetic_for(Backend("interpret")),
        block_k=None,
    )
    assert not any(np.isnan(b).any() for b in bound.values()), bound
    assert all(np.isinf(b).any() for b in bound.values())  # the case does reach unbounded errors
