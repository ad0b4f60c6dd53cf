"""Errors a user can act on: each names what to change."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallascheck.kernels.backends import Backend
from pallascheck.properties import runner
from pallascheck.specs import elementwise_like


def _forward_only_relu(x, interpret=False):
    def body(x_ref, o_ref):
        o_ref[...] = jnp.maximum(x_ref[...], 0)
    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x)


def test_forward_only_kernel_with_default_differentiable_names_the_option() -> None:
    spec = elementwise_like(_forward_only_relu, name="forward_only_relu", activation="relu", dtypes=("float32",),
                            interpret="interpret")
    tally = runner.run_property(spec, "float32", Backend("interpret"), examples=1, selected=("gradients",))
    assert "this kernel has no VJP: pass differentiable=False" in tally.failure, tally.failure
    forward_only = elementwise_like(_forward_only_relu, name="forward_only_relu", activation="relu",
                                    dtypes=("float32",), interpret="interpret", differentiable=False)
    assert not runner.run_property(forward_only, "float32", Backend("interpret"), examples=1).failure
