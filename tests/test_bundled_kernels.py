"""JAX's own Pallas kernels as outside clients, checked with our specs in interpret
mode. A weakness found in them is an expected finding, kept as a strict xfail with
its evidence, so that it flips when JAX fixes it.

``jax.experimental.pallas.ops.gpu.layer_norm`` and ``.rms_norm`` (Triton-style;
layer_norm deprecated by JAX in favour of Tokamax) under our layer-norm and RMS-norm
specs: every check, contract included. The bundled rms_norm also adds a bias; the
adapter passes zeros, which our RMS norm has.
Finding (both): the forward saves its row statistics (mean and rstd; rstd) in the
input dtype (``ShapeDtypeStruct(shape=(), dtype=x.dtype)``) and the backward
recomputes ``x_hat`` from them, so in bf16/f16 ``dx`` carries the residuals'
rounding, amplified by the backward's cancellation. Measured with seed 0, 4 examples:
layer_norm dx off by 152x (bf16) and 17.5x (f16) the f32-residual bound, rms_norm dx
by 4.4x and 3.1x; the forward and every f32 check pass (worst budget 0.26 and 0.84).
Replay: ``pytest 'tests/test_bundled_kernels.py::test_jax_bundled_norm[layer_norm-bfloat16]'``.
"""
from __future__ import annotations

import warnings

import jax.numpy as jnp
import pytest

from pallascheck.kernels.backends import Backend
from pallascheck.properties import runner
from pallascheck.properties.norms_spec import make_spec



def _bundled(kind: str):
    with warnings.catch_warnings():  # layer_norm warns that it is deprecated, on import
        warnings.simplefilter("ignore", DeprecationWarning)
        return pytest.importorskip(f"jax.experimental.pallas.ops.gpu.{kind}", reason="no longer shipped by JAX")


def bundled_norm(kind: str):
    """JAX's bundled ``kind`` with the shipped norm's signature, in interpret mode (its
    kernels take [batch, seq, features], a weight and a bias; config and backend do
    not apply)."""
    bundled = getattr(_bundled(kind), kind)

    def call(x, scale, offset, eps):
        d = x.shape[-1]
        weight = jnp.ones((d,), x.dtype) if scale is None else scale.astype(x.dtype)
        bias = jnp.zeros((d,), x.dtype) if offset is None else offset.astype(x.dtype)
        return bundled(x.reshape(1, -1, d), weight, bias, eps=eps, interpret=True).reshape(x.shape)

    def layer_norm(x, scale=None, offset=None, *, eps, config=None, backend=None):
        del config, backend
        return call(x, scale, offset, eps)

    def rms_norm(x, scale=None, *, eps, config=None, backend=None):
        del config, backend
        return call(x, scale, None, eps)  # the bundled rms_norm's bias: zeros

    return layer_norm if kind == "layer_norm" else rms_norm


SPECS = {kind: make_spec(kind, bundled_norm(kind), name=f"jax_bundled_{kind}") for kind in ("layer_norm", "rms_norm")}


class ResidualPrecisionFinding(AssertionError):
    """The documented finding: dx outside its bound (not any other failure)."""


RESIDUALS_IN_INPUT_DTYPE = pytest.mark.xfail(
    strict=True, raises=ResidualPrecisionFinding,
    reason="row statistics are saved in the input dtype: dx in bf16/f16 is off by 3-152x the f32-residual "
           "bound (module docstring)")


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=RESIDUALS_IN_INPUT_DTYPE),
                                   pytest.param("float16", marks=RESIDUALS_IN_INPUT_DTYPE)])
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_jax_bundled_norm(kind: str, dtype: str, examples: int) -> None:
    tally = runner.run_property(SPECS[kind], dtype, Backend("interpret"), examples=examples, seed=0)
    if tally.failure.startswith("[gradients]") and "\n  dx:" in tally.failure:
        raise ResidualPrecisionFinding(tally.failure)
    assert not tally.failure, tally.failure


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", sorted(SPECS))
def test_jax_bundled_norm_forward(kind: str, dtype: str, examples: int) -> None:
    """Without the backward pass, the low-precision residuals do not matter."""
    checks = ("values", "contract", "reference", "deterministic", "metamorphic")
    tally = runner.run_property(SPECS[kind], dtype, Backend("interpret"), examples=examples, seed=0, selected=checks)
    assert not tally.failure, tally.failure
