"""JAX's own Pallas kernels as outside clients, checked with our specs in interpret
mode. A weakness found in them is an expected finding, kept as a strict xfail with
its evidence, so that it flips when JAX fixes it.

``jax.experimental.pallas.ops.gpu.layer_norm`` (Triton-style; deprecated by JAX in
favour of Tokamax) under the layer-norm spec: every check, contract included.
Finding: its forward saves the row mean and rstd in the input dtype
(``ShapeDtypeStruct(shape=(), dtype=x.dtype)``) and its backward recomputes
``x_hat = (x - mean) * rstd`` from them, so in bf16/f16 ``dx`` carries the residuals'
rounding, amplified by the backward's cancellation. Measured with seed 0, 4 examples:
dx off by 152x (bf16) and 17.5x (f16) the f32-residual bound; the forward and every
f32 check pass (budget 0.26). Replay:
``pytest 'tests/test_bundled_kernels.py::test_jax_bundled_layer_norm[bfloat16]'``.
"""
from __future__ import annotations

import warnings

import jax.numpy as jnp
import pytest

from pallascheck.kernels.backends import Backend
from pallascheck.properties import runner
from pallascheck.properties.norms_spec import make_spec

with warnings.catch_warnings():  # the module warns that it is deprecated, on import
    warnings.simplefilter("ignore", DeprecationWarning)
    bundled = pytest.importorskip("jax.experimental.pallas.ops.gpu.layer_norm", reason="no longer shipped by JAX")


def bundled_layer_norm(x, scale=None, offset=None, *, eps=1e-5, config=None, backend=None):
    """JAX's bundled layer norm with the shipped layer_norm's signature, in interpret
    mode (its kernels take [batch, seq, features]; config and backend do not apply)."""
    del config, backend
    d = x.shape[-1]
    weight = jnp.ones((d,), x.dtype) if scale is None else scale.astype(x.dtype)
    bias = jnp.zeros((d,), x.dtype) if offset is None else offset.astype(x.dtype)
    return bundled.layer_norm(x.reshape(1, -1, d), weight, bias, eps=eps, interpret=True).reshape(x.shape)


SPEC = make_spec("layer_norm", bundled_layer_norm, name="jax_bundled_layer_norm")


class ResidualPrecisionFinding(AssertionError):
    """The documented finding: dx outside its bound (not any other failure)."""


RESIDUALS_IN_INPUT_DTYPE = pytest.mark.xfail(
    strict=True, raises=ResidualPrecisionFinding,
    reason="mean and rstd are saved in the input dtype: dx in bf16/f16 is off by 17-152x the f32-residual "
           "bound (module docstring)")


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=RESIDUALS_IN_INPUT_DTYPE),
                                   pytest.param("float16", marks=RESIDUALS_IN_INPUT_DTYPE)])
def test_jax_bundled_layer_norm(dtype: str, examples: int) -> None:
    tally = runner.run_property(SPEC, dtype, Backend("interpret"), examples=examples, seed=0)
    if tally.failure.startswith("[gradients]") and "\n  dx:" in tally.failure:
        raise ResidualPrecisionFinding(tally.failure)
    assert not tally.failure, tally.failure


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_jax_bundled_layer_norm_forward(dtype: str, examples: int) -> None:
    """Without the backward pass, the low-precision residuals do not matter."""
    checks = ("values", "contract", "reference", "deterministic", "metamorphic")
    tally = runner.run_property(SPEC, dtype, Backend("interpret"), examples=examples, seed=0, selected=checks)
    assert not tally.failure, tally.failure
