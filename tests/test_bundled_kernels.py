"""JAX's own Pallas kernels as outside clients (``properties/outside/jax_bundled.py``), checked
with specs the builders made, in the interpreters on the CPU (and with ``--backend
triton`` / ``mosaic_gpu`` on a GPU). A weakness found in them is an expected finding,
kept as a strict xfail that raises only the finding's own exception, so that it flips
when JAX fixes it. Evidence and replay commands: the README's bundled-kernel table.

Findings (jax 0.11.2 and 0.12.0.1):
- layer_norm, rms_norm: the forward saves its row statistics in the input dtype and
  the backward recomputes x_hat from them: in bf16/f16 the gradients leave their
  f32-residual bound (seed 0: layer_norm dscale 23x in bf16, 2.3x in f16; rms_norm
  dx 3.4x in bf16). Forward and f32 pass.
- attention (mha), layer_norm, rms_norm, megablox gmm: bad input computed silently
  (v shorter than k; a scale shorter than the features; fewer group sizes than groups).
- ragged_dot_mgpu, megablox gmm: rows past sum(group_sizes) are not zeroed (NaN /
  leftovers), unlike jax.lax.ragged_dot; their specs state "unwritten" and pass.
- softmax: a zero-length row is not checked: jax 0.11.2's interpreter (and Triton)
  raise ZeroDivisionError, jax 0.12's a gather's TypeError (which counts as refusing).
- paged_attention: each kv split's unnormalised output is stored in the input dtype,
  then rescaled, summed and divided by a denominator rounded to it: bf16 outputs
  leave the contract (seed 0: 1.15x). f32 and f16 pass.
- on Triton (H200, jax 0.11.2, 16 examples): mha, decode_attention and paged_attention
  take their f32 q.k at tf32 (a plain pl.dot): their f32 outputs stay within the
  implementation bound that says so, but leave the IEEE-f32 contract (values 1.68x,
  1.49x, 1.26x; mha's gradients 42x); softmax subtracts the row max in bf16 before
  upcasting: bf16 probabilities 34.6x the contract (the CPU interpreter of jax 0.12
  keeps that difference in f32 and passes).
- attention_mgpu (H200, jax 0.11.2): bf16 inputs fail to lower ("Expected dtypes to
  match but src had type bfloat16 and dst had type float16"); f16 passes every check.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
import pytest

from pallascheck.kernels.backends import Backend
from pallascheck.properties import checks, runner
from pallascheck.properties.families.attention import attention_like
from pallascheck.properties.outside import jax_bundled
from pallascheck.properties.registry import get_spec

INTERPRETED = {
    name: next(b for b in get_spec(name).backends if Backend(b).is_interpreted)
    for name in jax_bundled.BUNDLED
    if name != "jax:gpu.attention_mgpu"
}


class GradientFinding(AssertionError):
    """The documented finding: a gradient outside its bound (not any other failure)."""


class ValuesFinding(AssertionError):
    """The documented finding: outputs outside their bound (not any other failure)."""


class CrashOnBadInput(AssertionError):
    """The documented finding: a bad input crashes with an error that is no refusal."""


class SilentBadInput(AssertionError):
    """The documented finding: a bad input computed without an error."""


class RowsOutsideGroupsFinding(AssertionError):
    """The documented finding: rows in no group are not zero."""


RESIDUALS_IN_INPUT_DTYPE = pytest.mark.xfail(
    strict=True,
    raises=GradientFinding,
    reason="row statistics saved in the input dtype: bf16/f16 gradients leave their bound (module docstring)",
)
PARTIALS_IN_INPUT_DTYPE = pytest.mark.xfail(
    strict=True,
    raises=ValuesFinding,
    reason="unnormalised split outputs kept in the input dtype: bf16 leaves the contract (module docstring)",
)
# jax 0.11's interpreter divides by the zero row length (ZeroDivisionError); jax 0.12's
# fails in a gather with a TypeError, which counts as refusing
ZERO_LENGTH_ROW_CRASH = pytest.mark.xfail(
    condition=tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12),
    strict=True,
    raises=CrashOnBadInput,
    reason="softmax does not check for zero-length rows (module docstring)",
)
NO_VALIDATION = pytest.mark.xfail(strict=True, raises=SilentBadInput, reason="computes on bad input (module docstring)")


def _params(names, marks: dict) -> list:
    return [pytest.param(*n, marks=marks.get(n, ())) for n in names]


PROPERTIES = [(name, dtype) for name in INTERPRETED for dtype in get_spec(name).dtypes]
LOW_PRECISION_NORMS = {
    (f"jax:gpu.{k}", d): RESIDUALS_IN_INPUT_DTYPE for k in ("layer_norm", "rms_norm") for d in ("bfloat16", "float16")
}
FINDINGS = {**LOW_PRECISION_NORMS, ("jax:gpu.paged_attention", "bfloat16"): PARTIALS_IN_INPUT_DTYPE}


@pytest.mark.parametrize(("name", "dtype"), _params(PROPERTIES, FINDINGS))
def test_bundled_kernel(name: str, dtype: str, examples: int) -> None:
    """Every check of the builder-made spec, on the kernel's interpreter."""
    tally = runner.run_property(
        get_spec(name),
        dtype,
        Backend(INTERPRETED[name]),
        examples=examples,
        seed=0,
        replay_hint=f"pallascheck verify --kernel {name} --dtype {dtype} --backend {INTERPRETED[name]}",
    )
    if tally.failure.startswith("[gradients]"):
        raise GradientFinding(tally.failure)
    if tally.failure.startswith(("[values]", "[contract]")):
        raise ValuesFinding(tally.failure)
    assert not tally.failure, tally.failure


@pytest.mark.parametrize(
    "name",
    _params(
        [(n,) for n in INTERPRETED],
        {
            ("jax:gpu.attention",): NO_VALIDATION,
            ("jax:gpu.layer_norm",): NO_VALIDATION,
            ("jax:gpu.rms_norm",): NO_VALIDATION,
            ("jax:tpu.megablox.gmm",): NO_VALIDATION,
            ("jax:gpu.softmax",): ZERO_LENGTH_ROW_CRASH,
        },
    ),
)
def test_bundled_kernel_refuses_bad_input(name: str) -> None:
    outcome = runner.run_errors(get_spec(name), context=checks.Context(kernel=name))
    if not outcome.passed and "nothing was raised" in outcome.detail:
        raise SilentBadInput(outcome.detail)
    if not outcome.passed and ", got " in outcome.detail:
        raise CrashOnBadInput(outcome.detail)
    assert outcome.passed, outcome.detail


@pytest.mark.xfail(strict=True, raises=RowsOutsideGroupsFinding, reason="rows past sum(group_sizes) not zeroed")
@pytest.mark.parametrize("name", ["jax:gpu.ragged_dot_mgpu", "jax:tpu.megablox.gmm"])
def test_grouped_matmuls_under_ragged_dot_semantics(name: str, examples: int) -> None:
    """Under jax.lax.ragged_dot's promise (rows in no group are 0)."""
    factory = {
        "jax:gpu.ragged_dot_mgpu": jax_bundled.gpu_ragged_dot_mgpu,
        "jax:tpu.megablox.gmm": jax_bundled.tpu_megablox_gmm,
    }[name]
    spec = factory(rows_outside_groups="zero")
    tally = runner.run_property(
        spec, spec.dtypes[-1], Backend(INTERPRETED[name]), examples=examples, seed=0, selected=("values",)
    )
    if tally.failure.startswith("[values]") and "oracle=0.0 " in tally.failure:
        raise RowsOutsideGroupsFinding(tally.failure)
    assert not tally.failure, tally.failure


@contextlib.contextmanager
def causal_loop_one_block_short():
    """A broken copy of the bundled flash attention, made without copying it: its causal
    kv loop bound ``lax.div(block_q * (start_q + 1) + block_k - 1, block_k)`` one block
    short (every ``lax.div`` of the module minus one: the forward's loop bound and
    the backward's causal lower bound). Compiled executables of the good kernel are
    dropped before and after."""
    module = jax_bundled._module("gpu.attention")
    lax = module.lax
    short = mock.Mock(wraps=lax, div=lambda a, b: lax.div(a, b) - 1)
    jax.clear_caches()
    try:
        with mock.patch.object(module, "lax", short):
            yield
    finally:
        jax.clear_caches()


def test_broken_bundled_attention_is_caught(examples: int) -> None:
    spec = jax_bundled.gpu_attention()
    with causal_loop_one_block_short():
        tally = runner.run_property(spec, "float32", Backend("interpret"), examples=examples, seed=0)
    assert tally.failure.startswith("[values]") or tally.failure.startswith("[gradients]"), (
        tally.failure or "not caught"
    )


def test_bundled_attention_scale_convention_is_told_apart(examples: int) -> None:
    """mha's sm_scale is 1.0 unless passed: the same kernel under the 1/sqrt(d)
    convention fails the values check, under its own it passes (test_bundled_kernel)."""
    mha = jax_bundled._module("gpu.attention").mha
    wrong = attention_like(
        lambda q, k, v, interpret: mha(q, k, v, None, interpret=interpret),
        name="mha_as_1_over_sqrt_d",
        gqa=False,
        seq_q=(32, 64),
        seq_kv=None,
        differentiable=False,
        backends=("interpret",),
        interpret="interpret",
    )
    tally = runner.run_property(wrong, "float32", Backend("interpret"), examples=examples, seed=0, selected=("values",))
    assert tally.failure.startswith("[values]"), "a scale convention that differs went unnoticed"


def test_attention_mgpu_scale_convention(each_backend: Backend, examples: int) -> None:
    """attention_mgpu applies no softmax scale (softmax(q k^T) v): under that convention
    every check passes; under cuDNN's 1/sqrt(d) the values check fails. Hardware only:
    the Mosaic GPU interpreter cannot lower its warp-specialised pipeline."""
    if each_backend.name != "mosaic_gpu":
        pytest.skip("attention_mgpu runs on a Hopper GPU only (--backend mosaic_gpu)")
    tally = runner.run_property(get_spec("jax:gpu.attention_mgpu"), "float16", each_backend, examples=examples, seed=0)
    assert not tally.failure, tally.failure
    mod = jax_bundled._module("gpu.attention_mgpu")
    config = mod.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
    scaled = attention_like(
        lambda q, k, v: mod.attention(q, k, v, config),
        name="attention_mgpu_as_1_over_sqrt_d",
        seq_q=(128,),
        seq_kv=(128,),
        head_dims=(64,),
        dtypes=("float16",),
        differentiable=False,
        backends=("mosaic_gpu",),
    )
    tally = runner.run_property(scaled, "float16", each_backend, examples=examples, seed=0, selected=("values",))
    assert tally.failure.startswith("[values]"), "the 1/sqrt(d) convention was not told apart"


TRITON_FINDINGS = [
    ("jax:gpu.attention", "float32"),
    ("jax:gpu.decode_attention", "float32"),
    ("jax:gpu.paged_attention", "float32"),
    ("jax:gpu.softmax", "bfloat16"),
]


@pytest.mark.xfail(strict=True, raises=ValuesFinding, reason="tf32 q.k / bf16 max shift on Triton (module docstring)")
@pytest.mark.parametrize(("name", "dtype"), TRITON_FINDINGS)
def test_bundled_kernel_findings_on_triton(name: str, dtype: str, each_backend: Backend) -> None:
    """Hardware only: what Triton's arithmetic does to these kernels (tf32 dots, bf16
    subtraction) does not happen in the CPU interpreter."""
    if each_backend.name != "triton":
        pytest.skip("a Triton finding: run with --backend triton on a GPU")
    tally = runner.run_property(
        get_spec(name),
        dtype,
        each_backend,
        examples=16,
        seed=0,
        replay_hint=f"pallascheck verify --kernel {name} --dtype {dtype} --backend triton --examples 16",
    )
    if tally.failure.startswith(("[values]", "[contract]", "[gradients]")):
        raise ValuesFinding(tally.failure)
    assert not tally.failure, tally.failure


@pytest.mark.xfail(strict=True, raises=ValueError, reason="bf16 fails to lower (module docstring)")
def test_attention_mgpu_takes_bfloat16(each_backend: Backend) -> None:
    if each_backend.name != "mosaic_gpu":
        pytest.skip("attention_mgpu runs on a Hopper GPU only (--backend mosaic_gpu)")
    mod = jax_bundled._module("gpu.attention_mgpu")
    q = jax.numpy.ones((1, 128, 1, 64), jax.numpy.bfloat16)
    jax.block_until_ready(mod.attention(q, q, q, mod.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)))
