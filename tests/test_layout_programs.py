"""Kernel-side calls compiled once per layout on hardware (properties/device/layout_programs.py).
A hardware backend's name is enough here: the function under test is plain jax.numpy."""

from __future__ import annotations

import jax
import numpy as np

from pallascheck.kernels.backends import Backend
from pallascheck.oracles import numeric
from pallascheck.properties.device import layout_programs
from pallascheck.properties.spec import Case

HARDWARE, INTERPRETER = Backend("mosaic_gpu"), Backend("interpret")


def _case(seed: int, n: int = 8, scale: float = 2.0) -> Case:
    return Case({"x": np.random.default_rng(seed).standard_normal(n).astype(np.float32)}, {"scale": scale})


def test_a_layout_is_traced_once_and_every_case_runs_its_program() -> None:
    traces = []

    def scaled(case: Case, shift: float):
        traces.append(case.arrays["x"].shape)
        return case.arrays["x"] * case.params["scale"] + shift

    for seed in range(3):  # one layout: one trace
        case = _case(seed)
        np.testing.assert_array_equal(
            np.asarray(layout_programs.call(scaled, HARDWARE, case, 1.0)),
            case.arrays["x"] * np.float32(2.0) + np.float32(1.0),
        )
    assert len(traces) == 1
    layout_programs.call(scaled, HARDWARE, _case(0, n=5), 1.0)  # new shapes
    layout_programs.call(scaled, HARDWARE, _case(0, scale=3.0), 1.0)  # new parameters
    layout_programs.call(scaled, HARDWARE, _case(0), 2.0)  # new statics (config, backend)
    assert len(traces) == 4


def test_a_function_that_reads_values_on_the_host_runs_eagerly() -> None:
    def host_sum(case: Case):
        return float(np.asarray(case.arrays["x"]).sum())

    case = _case(0)
    assert layout_programs.call(host_sum, HARDWARE, case) == float(case.arrays["x"].sum())
    assert host_sum in layout_programs._eager


def test_a_function_run_eagerly_on_hardware_gets_its_inputs_placed_too() -> None:
    # each of its operations would otherwise copy the numpy inputs itself, the copies
    # that the runtime fault of numeric.placed corrupted
    given = []

    def host_max(case: Case, oracle: dict):
        given.append((type(case.arrays["x"]), type(oracle["y"])))
        return float(np.asarray(case.arrays["x"]).max() + np.asarray(oracle["y"]).max())

    case = _case(0)
    oracle = {"y": np.ones(2, np.float32)}
    for place_inputs in (True, False):
        got = layout_programs.compiled(host_max, case, oracle, place_inputs=place_inputs)
        assert got == float(case.arrays["x"].max() + np.float32(1))
    assert host_max in layout_programs._eager
    # the first call traced (tracers), then ran eagerly placed; the second as handed
    assert [tuple(issubclass(t, jax.Array) for t in g) for g in given[1:]] == [(True, True), (False, False)], given


def test_the_interpreters_call_eagerly() -> None:
    calls = []

    def identity(case: Case):
        calls.append(1)
        return case.arrays["x"]

    for seed in range(2):
        assert isinstance(layout_programs.call(identity, INTERPRETER, _case(seed)), np.ndarray)
    assert len(calls) == 2


def test_on_hardware_the_vjp_runs_on_a_thread_beside_the_forward_and_a_wrong_one_still_fails() -> None:
    """runner._check_case starts the kernel VJP (and xla_reference) on a thread; what
    it returns is judged as before. A plain-jnp silu with a custom VJP stands in for a
    kernel: a hardware backend's name (one such a spec runs on) is enough to take that
    path on the CPU."""
    hardware = Backend("triton")
    import threading

    import jax

    from pallascheck.properties import runner
    from pallascheck.specs import from_reference

    traced_on = []

    def silu(wrong_backward: bool):
        @jax.custom_vjp
        def f(x):
            return x * jax.nn.sigmoid(x)

        def backward(x, g):
            traced_on.append(threading.current_thread().name)
            s = jax.nn.sigmoid(x)
            return (g * (s if wrong_backward else s * (1.0 + x * (1.0 - s))),)

        f.defvjp(lambda x: (f(x), x), backward)
        return lambda x, interpret=False: f(x)

    def spec(wrong_backward: bool):
        return from_reference(
            silu(wrong_backward),
            lambda x: x * jax.nn.sigmoid(x),
            name="silu",
            inputs={"x": (8, 32)},
            dtypes=("float32",),
            differentiable=True,
        )

    good = runner.run_property(spec(False), "float32", hardware, examples=1, seed=0, cases_per_layout=3)
    assert not good.failure, good.failure
    assert good.outcomes["gradients"].examples == 3
    assert traced_on and all(name.startswith("pallascheck-kernel") for name in traced_on), traced_on
    bad = runner.run_property(spec(True), "float32", hardware, examples=1, seed=0, cases_per_layout=3)
    assert bad.failure.startswith("[gradients]") and "dx: worst element" in bad.failure, bad.failure


def test_a_programs_numpy_inputs_are_copied_to_the_device_before_it_is_called(monkeypatch) -> None:
    # handed numpy inputs itself, a program on an H100 sometimes read a corrupted copy
    # (numeric.placed); the copies are made, and waited for, first
    placed = numeric.placed(({"x": np.ones(3, np.float32)}, (2.5,)))
    assert isinstance(placed[0]["x"], jax.Array) and placed[0]["x"].is_ready() and placed[1] == (2.5,)
    seen = []
    real = numeric.placed
    monkeypatch.setattr(numeric, "placed", lambda tree: seen.append(tree) or real(tree))

    def doubled(case: Case):
        return case.arrays["x"] * 2

    for place_inputs in (True, False):
        case = _case(0)
        np.testing.assert_array_equal(
            np.asarray(layout_programs.call(doubled, HARDWARE, case, place_inputs=place_inputs)), case.arrays["x"] * 2
        )
    assert len(seen) == 1 and isinstance(seen[0][0]["x"], np.ndarray)
