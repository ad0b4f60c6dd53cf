"""On hardware a failing output is computed again from the same inputs before the
failure is reported (runner.RERUNS_ON_FAILURE): an output that changes from run to run
(a race, a runtime fault) is told from a steady failure, and the failure stands either
way. A hardware backend's name is enough to take that path on the CPU (the kernels
here are plain jax.numpy); the interpreters report as before."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import io_callback

from pallascheck.kernels.backends import Backend
from pallascheck.properties import checks, runner
from pallascheck.properties.device import identity as device_identity
from pallascheck.properties.spec import Case, KernelSpec
from pallascheck.specs import from_reference


def _silu_spec(factor: Callable[[], float]) -> KernelSpec:
    """silu whose output is scaled by ``factor()``, read from the host at each run of
    the compiled program: a kernel whose output may change between runs."""

    def kernel(x, interpret=False):
        scale = io_callback(lambda: np.float32(factor()), jax.ShapeDtypeStruct((), jnp.float32))
        return x * jax.nn.sigmoid(x) * scale

    return from_reference(
        kernel, lambda x: x * jax.nn.sigmoid(x), name="silu", inputs={"x": (8, 32)}, dtypes=("float32",)
    )


def _values_failure(factor: Callable[[], float], backend: Backend) -> str:
    spec = _silu_spec(factor)
    case = Case({"x": np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)}, {})
    context = checks.Context("silu", "float32", str(backend))
    with pytest.raises(checks.CheckFailure) as failure:
        runner.check_case(spec, case, spec.default_config_for(backend), backend, context=context, selected=("values",))
    return str(failure.value)


def test_a_failure_whose_reruns_pass_says_the_output_changes_and_still_fails() -> None:
    scales = itertools.chain([1.5], itertools.repeat(1.0))  # wrong once, right from then on
    message = _values_failure(lambda: next(scales), Backend("triton"))
    assert message.startswith("[values]")
    assert (
        "run 2 more times on the same inputs: 256 of 256 elements differ from the failing run's bits, passes; "
        "256 of 256 elements differ from the failing run's bits, passes." in message
    ), message
    assert "changes from run to run" in message


def test_a_steady_failure_says_so() -> None:
    message = _values_failure(lambda: 1.5, Backend("triton"))
    assert (
        "run 2 more times on the same inputs: 0 of 256 elements differ from the failing run's bits, fails; "
        "0 of 256 elements differ from the failing run's bits, fails (a steady failure)" in message
    ), message


def test_the_interpreters_do_not_rerun() -> None:
    calls = []
    message = _values_failure(lambda: calls.append(1) or 1.5, Backend("interpret"))
    assert "more times on the same inputs" not in message and len(calls) == 1


def test_changed_elements_compares_bits() -> None:
    a = np.array([0.0, 1.0, np.nan, 2.0], ml_dtypes.bfloat16)
    b = np.array([-0.0, 1.0, np.nan, 3.0], ml_dtypes.bfloat16)
    assert checks.changed_elements(a, b) == 2  # -0.0 and 3.0; the same NaN bits are the same
    assert checks.changed_elements(a, b[:3]) == 4  # another shape: every element


def test_a_rerun_that_raises_is_reported_not_hidden() -> None:
    note = checks.rerun_note(
        np.zeros(3), [np.zeros(3), RuntimeError("device lost")], lambda out: checks.Outcome("values", False, 2.0, "")
    )
    assert "0 of 3 elements differ from the failing run's bits, fails; raised RuntimeError: device lost" in note
    assert "steady" not in note


def test_an_output_that_changes_names_the_gpu_it_ran_on() -> None:
    # Faults of one device show as failures that gather on its UUID and pass elsewhere.
    gpu = "NVIDIA H100 80GB HBM3 GPU-5ca491d2-4aa1-2703-e315-0520c4bbe0f8 at PCI 0000:00:06.0"

    def judge(out):
        return checks.Outcome("values", bool(np.all(out == 1)), 0.0, "")

    note = checks.rerun_note(np.zeros(3), [np.ones(3), np.ones(3)], judge, device=gpu)
    assert f"It ran on {gpu}: failures like this one that gather on one GPU" in note
    assert gpu not in checks.rerun_note(np.zeros(3), [np.zeros(3)], judge, device=gpu)  # steady: not the device's
    assert device_identity.describe(jax.devices("cpu")[0]) is None  # no GPU: nothing to name
