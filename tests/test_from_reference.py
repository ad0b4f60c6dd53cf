"""``from_reference`` beyond the examples: the gradient checks (a Pallas kernel with a
custom VJP, checked against the derivation over its reference's VJP; a backward
kernel with a wrong derivative fails them), bad inputs, the message of an
unverifiable element, and the refusal of a kernel that returns the wrong dtype."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallascheck.kernels.backends import Backend
from pallascheck.properties import checks, runner
from pallascheck.specs import Input, from_reference

INTERPRET = Backend("interpret")


def silu_reference(x):
    return x * jax.nn.sigmoid(x)


def silu_kernel(wrong_backward: bool = False):
    """silu in one block in f32, with a backward kernel for its custom VJP."""

    def forward(x_ref, o_ref):
        x = x_ref[...].astype(jnp.float32)
        o_ref[...] = (x * jax.nn.sigmoid(x)).astype(o_ref.dtype)

    def backward(x_ref, g_ref, dx_ref):
        x = x_ref[...].astype(jnp.float32)
        s = jax.nn.sigmoid(x)
        slope = s if wrong_backward else s * (1.0 + x * (1.0 - s))  # the bug: silu' taken as sigmoid
        dx_ref[...] = (slope * g_ref[...].astype(jnp.float32)).astype(dx_ref.dtype)

    def call(body, x, *more, interpret):
        return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, *more)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def silu(x, interpret):
        return call(forward, x, interpret=interpret)

    silu.defvjp(
        lambda x, interpret: (silu(x, interpret), x),
        lambda interpret, x, g: (call(backward, x, g, interpret=interpret),),
    )
    return lambda x, interpret=False: silu(x, interpret)


def _spec(kernel, **kw):
    return from_reference(
        kernel, silu_reference, name="silu", inputs={"x": (8, 32)}, dtypes=("float32",), differentiable=True, **kw
    )


def test_gradients_are_checked_against_the_derived_vjp() -> None:
    good = runner.run_property(_spec(silu_kernel()), "float32", INTERPRET, examples=1, seed=0)
    assert not good.failure, good.failure
    assert good.outcomes["gradients"].examples == runner.CASES_PER_LAYOUT
    bad = runner.run_property(_spec(silu_kernel(wrong_backward=True)), "float32", INTERPRET, examples=1, seed=0)
    assert bad.failure.startswith("[gradients]") and "dx: worst element" in bad.failure, bad.failure
    assert "derived bound: facts" in bad.failure


def test_bad_inputs_must_be_refused() -> None:
    kernel = silu_kernel()
    spec = _spec(kernel, bad_inputs={"rank 3": lambda: kernel(jnp.ones((2, 8, 32)), interpret=True)})
    outcome = runner.run_errors(spec, context=checks.Context(kernel="silu"))
    assert not outcome.passed and "rank 3" in outcome.detail  # the kernel accepts rank 3: reported


def test_an_unverifiable_element_fails_with_its_cause() -> None:
    """A decision as the output: where x*y is within its error of 1 no bound exists."""

    def reference(x, y):
        return (x * y > 1.0).astype(x.dtype) + x

    def kernel(x, y, interpret=False):
        return jax.jit(reference)(x, y)

    third = Input((4,), values=lambda rng, shape, dtype: np.full(shape, 3.0))
    other = Input((4,), values=lambda rng, shape, dtype: np.full(shape, 1 / 3))
    spec = from_reference(kernel, reference, name="kink", inputs={"x": third, "y": other}, dtypes=("float32",))
    tally = runner.run_property(spec, "float32", INTERPRET, examples=1, seed=0, cases_per_layout=1)
    assert "the element is unverifiable" in tally.failure and "gt at" in tally.failure, tally.failure


def test_a_result_of_another_dtype_is_refused() -> None:
    spec = from_reference(
        lambda x, interpret=False: x.astype(jnp.float16),
        silu_reference,
        name="cast",
        inputs={"x": (4,)},
        dtypes=("float32",),
    )
    tally = runner.run_property(spec, "float32", INTERPRET, examples=1, seed=0)
    assert "must return one array of shape (4,) and dtype float32" in tally.failure, tally.failure


def test_an_overflowing_kernel_is_told_as_an_overflow_and_a_looser_fit_warns_of_hiding_a_bug() -> None:
    def reference(x):
        return jnp.exp(x - jnp.max(x)) * 2.0

    def overflows(x, interpret=False):  # exp without its max subtracted, in f32: inf past ~88
        return jnp.exp(x * 100.0) ** 0.01 * jnp.exp(-jnp.max(x)) * 2.0

    big = Input((8,), values=lambda rng, shape, dtype: rng.uniform(1.0, 2.0, shape))
    spec = from_reference(overflows, reference, name="unshifted", inputs={"x": big}, dtypes=("float32",))
    tally = runner.run_property(spec, "float32", INTERPRET, examples=1, seed=0, cases_per_layout=1)
    assert "overflow: the kernel's" in tally.failure and "not a matter of precision or order" in tally.failure
    assert "computes something else" not in tally.failure and "inputs at out[" in tally.failure, tally.failure

    def in_f32(x):  # the reference computes in f32 and rounds once to bf16
        return reference(x.astype(jnp.float32)).astype(x.dtype)

    def in_bf16(x, interpret=False):  # the kernel computes in bf16: within the looser facts' bound
        return reference(x)

    normal = Input((64,), values=lambda rng, shape, dtype: rng.standard_normal(shape))
    spec = from_reference(in_bf16, in_f32, name="in_bf16", inputs={"x": normal}, dtypes=("bfloat16",))
    tally = runner.run_property(spec, "bfloat16", INTERPRET, examples=1, seed=0, cases_per_layout=1)
    assert "within the bound for looser facts" in tally.failure, tally.failure
    assert "could hide a real bug of this size" in tally.failure, tally.failure
