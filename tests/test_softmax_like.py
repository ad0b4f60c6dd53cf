"""``softmax_like`` on a user's Pallas softmax with a custom VJP: the correct kernel
passes every check in every dtype; each planted bug is caught by the check it
breaks. (JAX's bundled ``ops.gpu.softmax`` is checked in test_bundled_kernels.py.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallascheck.kernels.backends import Backend
from pallascheck.oracles import softmax as softmax_oracle
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import runner
from pallascheck.properties.families.softmax import softmax_like

EXAMPLES = 3


def _forward_kernel(x_ref, o_ref, *, subtract_max: bool):
    x = x_ref[...].astype(jnp.float32)
    shifted = x - jnp.max(x, axis=-1, keepdims=True) if subtract_max else x
    w = jnp.exp(shifted)
    o_ref[...] = (w / jnp.sum(w, axis=-1, keepdims=True)).astype(o_ref.dtype)


def _forward(x: jax.Array, interpret: bool, subtract_max: bool) -> jax.Array:
    rows = x.reshape(-1, x.shape[-1])
    out = pl.pallas_call(
        functools.partial(_forward_kernel, subtract_max=subtract_max),
        out_shape=jax.ShapeDtypeStruct(rows.shape, x.dtype),
        interpret=interpret,
    )(rows)
    return out.reshape(x.shape)


def make_softmax(*, subtract_max: bool = True, subtract_mean_term: bool = True):
    """A row-at-once Pallas softmax; its backward dx = y (g - sum(g y)) in f32."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def softmax(x: jax.Array, interpret: bool = False) -> jax.Array:
        return _forward(x, interpret, subtract_max)

    def fwd(x, interpret):
        y = _forward(x, interpret, subtract_max)
        return y, y

    def bwd(interpret, y, g):
        y32, g32 = y.astype(jnp.float32), g.astype(jnp.float32)
        c = jnp.sum(g32 * y32, axis=-1, keepdims=True) if subtract_mean_term else 0.0
        return ((y32 * (g32 - c)).astype(y.dtype),)

    softmax.defvjp(fwd, bwd)
    return lambda x, interpret=False: softmax(x, interpret)


def _run(fn, dtype: str, **kw) -> runner.Tally:
    spec = softmax_like(fn, name="my_softmax", interpret="interpret", **kw)
    return runner.run_property(spec, dtype, Backend("interpret"), examples=EXAMPLES, seed=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_correct_softmax_passes_every_check(dtype: str):
    tally = _run(make_softmax(), dtype)
    assert not tally.failure, tally.failure
    assert {"values", "gradients", "contract", "reference", "metamorphic"} <= set(tally.outcomes)


def test_softmax_without_the_max_shift_overflows_and_is_caught():
    """exp(x) of 1e4-scale logits overflows f32: the values check fails."""
    tally = _run(make_softmax(subtract_max=False), "float32")
    assert tally.failure and "values" in tally.failure.split("\n")[0], tally.failure


def test_backward_without_the_mean_term_is_caught():
    tally = _run(make_softmax(subtract_mean_term=False), "float32")
    assert tally.failure and "gradients" in tally.failure.split("\n")[0], tally.failure


def test_gradient_bound_is_unbounded_not_nan_where_an_exact_zero_meets_an_unbounded_error():
    """A row whose forward bound is infinite (its output may have overflowed) makes
    c = sum(g y)'s error infinite; y's exact zero times it is the kernel's 0 * inf,
    NaN, so the bound there is infinite (checks.compare admits anything under it).
    A NaN bound would fail every result there, an exact one included."""
    x = np.array([[0.0, -1e4, 1.0]], np.float32)  # exp(-1e4 - 1) is an exact float64 0
    ref = softmax_oracle.oracle(x)
    assert ref.rows[0, 1] == 0.0
    forward = np.array([[0.0, 0.0, np.inf]])
    bound = softmax_oracle.gradient_bound(
        ref,
        np.ones_like(x),
        forward,
        dtype=np.float32,
        arith=arithmetic_for(Backend("interpret")),
        compute_dtype=np.float32,
    )
    assert not np.isnan(bound).any() and np.isinf(bound[0, 1]), bound
