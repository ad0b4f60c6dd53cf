"""``elementwise_like`` (properties/families/elementwise.py) on user Pallas kernels written
here: a correct one passes every check in f32, bf16 and f16 (xla_reference within
its bound included); broken ones fail the check that should catch them, in the
dtypes where the bug shows; and the bounds are sound on every finite bf16 and f16
input.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallascheck.kernels.activations import ACTIVATIONS
from pallascheck.kernels.backends import Backend
from pallascheck.oracles.tolerance import CPU
from pallascheck.properties import runner, strategies
from pallascheck.properties.families import elementwise as elementwise_spec
from pallascheck.properties.families.elementwise import Compute, elementwise_like
from pallascheck.properties.spec import Case, KernelSpec

INTERPRET = Backend("interpret")
# A broken kernel is drawn a fixed number of examples (its catch must not depend on
# --examples) of one shape with 1024 elements: a case then misses the regime where
# its bug shows only if its whole array is subnormal or saturated. Measured: seeds
# 0-19 all caught with 2 examples; with the default shapes, (1,) and (7,) draws let
# 2 to 3 seeds in 10 through.
BROKEN_EXAMPLES = 2
BROKEN_SHAPES = ((8, 128),)


def user_kernel(act: Callable[[jax.Array], jax.Array], *, upcast: bool = True) -> Callable[..., jax.Array]:
    """A user's elementwise kernel: ``act`` on the whole array in one block, in f32
    (``upcast``) or, the bug, in x's own dtype; its VJP is a second pallas_call
    computing act'(x) g (pallas_call has no autodiff of its own)."""

    def compute(x: jax.Array) -> jax.Array:
        return x.astype(jnp.float32) if upcast else x

    def forward(x_ref, y_ref):
        y_ref[...] = act(compute(x_ref[...])).astype(y_ref.dtype)

    def backward(x_ref, g_ref, dx_ref):
        x = compute(x_ref[...])
        _, pullback = jax.vjp(act, x)
        (dx,) = pullback(g_ref[...].astype(x.dtype))
        dx_ref[...] = dx.astype(dx_ref.dtype)

    def call(body, x, *operands, interpret):
        return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, *operands)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def kernel(x, interpret):
        return call(forward, x, interpret=interpret)

    kernel.defvjp(
        lambda x, interpret: (kernel(x, interpret), x),
        lambda interpret, x, g: (call(backward, x, g, interpret=interpret),),
    )
    return lambda x, *, interpret=False: kernel(x, interpret)


def interpreted(fn: Callable[..., jax.Array], activation: str, **options) -> KernelSpec:
    return elementwise_like(
        fn, name=f"user_{activation}", activation=activation, backends=("interpret",), interpret="interpret", **options
    )


GELU = interpreted(user_kernel(functools.partial(jax.nn.gelu, approximate=False)), "gelu")
GELU_TANH = functools.partial(jax.nn.gelu, approximate=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_user_kernel_passes_every_check(dtype: str, examples: int) -> None:
    """Values, contract, xla_reference within its bound, gradients, determinism and both
    relations, each on every case drawn."""
    tally = runner.run_property(GELU, dtype, INTERPRET, examples=examples, seed=0)
    assert not tally.failure, tally.failure
    cases = examples * runner.CASES_PER_LAYOUT
    ran = {check: outcome.examples for check, outcome in tally.outcomes.items()}
    assert ran == {
        "values": cases,
        "reference": cases,
        "gradients": cases,
        "contract": cases,
        "deterministic": cases,
        "metamorphic": 2 * cases,
    }, ran


def _values(spec: KernelSpec, dtype: str, selected: tuple[str, ...] = ("values",)) -> runner.Tally:
    return runner.run_property(spec, dtype, INTERPRET, examples=BROKEN_EXAMPLES, seed=0, selected=selected)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_kernel_computing_in_its_input_dtype_fails_values(dtype: str) -> None:
    """gelu_tanh without the upcast rounds each of its operations to bf16/f16 (XLA:CPU
    does not keep them in f32: elementwise_spec.bound's docstring): the values check
    fails, not a crash; the same kernel with the upcast passes the same draws."""
    broken = _values(interpreted(user_kernel(GELU_TANH, upcast=False), "gelu_tanh", shapes=BROKEN_SHAPES), dtype)
    assert broken.failure.startswith("[values]"), broken.failure or "not caught"
    assert not broken.outcomes["values"].passed and "crash" not in broken.outcomes
    good = _values(interpreted(user_kernel(GELU_TANH), "gelu_tanh", shapes=BROKEN_SHAPES), dtype)
    assert not good.failure, good.failure


def test_wrong_constant_fails_values_in_float32() -> None:
    """gelu_tanh with 0.0447 for 0.044715 errs by ~5e-6 relative near |x| = 2, 12x the
    f32 bound; in bf16/f16 that is far below half an ulp (the bound explains it:
    measured budget 0.8), so f32 is the dtype where it must fail."""

    def typo(x: jax.Array) -> jax.Array:
        return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.0447 * x * x * x)))

    tally = _values(interpreted(user_kernel(typo), "gelu_tanh", shapes=BROKEN_SHAPES), "float32")
    assert tally.failure.startswith("[values]"), tally.failure or "not caught"
    assert "crash" not in tally.outcomes


def test_compute_dtype_is_the_implementation_bound_not_the_contract() -> None:
    """Stated as computing in bf16 (``Compute("bfloat16")``), the kernel without the
    upcast is within its implementation bound (the values check passes: the model of
    bf16 arithmetic is sound), and the f32 contract still fails it."""
    spec = interpreted(
        user_kernel(GELU_TANH, upcast=False), "gelu_tanh", shapes=BROKEN_SHAPES, compute=Compute("bfloat16")
    )
    tally = _values(spec, "bfloat16", selected=("values", "contract"))
    assert tally.failure.startswith("[contract]"), tally.failure or "the contract did not fail"
    assert tally.outcomes["values"].passed and tally.outcomes["values"].examples >= 1


def skipped_first_element(act: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
    """``act`` everywhere but the first element, left as it was."""

    def wrong(x: jax.Array) -> jax.Array:
        return act(x).reshape(-1).at[0].set(x.reshape(-1)[0]).reshape(x.shape)

    return wrong


def sigmoid_without_negative_branch(x: jax.Array) -> jax.Array:
    """The overflow-safe sigmoid with e = exp(-|x|), its x < 0 branch e / (1 + e)
    forgotten: 1 / (1 + e) everywhere, sigma(|x|)."""
    return 1.0 / (1.0 + jnp.exp(-jnp.abs(x)))


@pytest.mark.parametrize(
    ("act", "activation", "relation"),
    [
        (skipped_first_element(jax.nn.silu), "silu", "element_permutation"),
        (sigmoid_without_negative_branch, "sigmoid", "reflection"),
    ],
    ids=["skipped_first_element", "sigmoid_without_negative_branch"],
)
def test_relations_catch_bugs_without_the_oracle(act, activation: str, relation: str) -> None:
    """Only the relations run (no oracle): a result that depends on the element's
    position breaks element_permutation; a wrong branch for x < 0 breaks sigmoid(x) +
    sigmoid(-x) = 1 (it is position-independent: element_permutation passes first)."""
    spec = interpreted(user_kernel(act), activation, shapes=BROKEN_SHAPES, differentiable=False)
    tally = _values(spec, "float32", selected=("metamorphic",))
    assert tally.failure.startswith(f"[metamorphic:{relation}]"), tally.failure or "not caught"


def test_adapter_refuses_results_of_another_dtype() -> None:
    """The bound models the store to x's dtype: a result in f32 for bf16 x is refused
    (a crash of the check, naming the rule), not measured against the wrong model;
    an activation without a model is refused when the spec is built."""
    spec = interpreted(lambda x, *, interpret: jax.nn.relu(x).astype(jnp.float32), "relu")
    tally = runner.run_property(spec, "bfloat16", INTERPRET, examples=1, seed=0, selected=("values",))
    assert tally.failure.startswith("[crash]") and "must return x's shape and dtype" in tally.failure, tally.failure
    with pytest.raises(ValueError, match="activation must be one of"):
        interpreted(jax.nn.relu, "swish")


def _every_finite(dtype: str) -> np.ndarray:
    """Every finite value of a 16-bit dtype."""
    values = np.arange(2**16, dtype=np.uint16).view(strategies.np_dtype(dtype))
    return values[np.isfinite(values.astype(np.float32))]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_bounds_hold_on_every_input(activation: str, dtype: str) -> None:
    """Every finite bf16/f16 x in the drawn range (|x| <= the spec's largest):
    xla_reference within its bound (config None), f in f32 rounded once within the
    contract, and dx = act'(x) g by autodiff in f32 (g ~ N(0, 1)) within its contract."""
    every = _every_finite(dtype)
    x = every[np.abs(every.astype(np.float64)) <= elementwise_spec._largest(dtype, activation)]
    g = np.random.default_rng(0).standard_normal(x.shape).astype(x.dtype)
    case = Case({"x": x, "cotangent": g}, {"activation": activation})
    ref = elementwise_spec.oracle(case)
    act = ACTIVATIONS[activation]

    def in_f32(v, ct):
        y, pullback = jax.vjp(act, v.astype(jnp.float32))
        return y.astype(v.dtype), pullback(ct.astype(jnp.float32))[0].astype(v.dtype)

    reference = np.asarray(jax.jit(act)(jnp.asarray(x)), np.float64)
    y, dx = (np.asarray(a, np.float64) for a in jax.jit(in_f32)(jnp.asarray(x), jnp.asarray(g)))
    grads = elementwise_spec.oracle_vjp(case, ref)
    checks = {
        "reference": (reference, ref.out, elementwise_spec.bound(case, ref, None, CPU)),
        "f32 once": (y, ref.out, elementwise_spec.contract(case, ref, CPU)),
        "dx": (dx, grads["dx"], elementwise_spec.gradient_contract(case, ref, grads, CPU)["dx"]),
    }
    for name, (got, exact, bound) in checks.items():
        over = ~(np.abs(got - exact) <= bound)  # NaN is over
        assert not over.any(), f"{name}: {over.sum()} inputs over, e.g. x = {x[over][:4]}"
