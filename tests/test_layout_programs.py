"""Kernel-side calls compiled once per layout on hardware (properties/layout_programs.py).
A hardware backend's name is enough here: the function under test is plain jax.numpy."""
from __future__ import annotations

import numpy as np

from pallascheck.kernels.backends import Backend
from pallascheck.properties import layout_programs
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
        np.testing.assert_array_equal(np.asarray(layout_programs.call(scaled, HARDWARE, case, 1.0)),
                                      case.arrays["x"] * np.float32(2.0) + np.float32(1.0))
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


def test_the_interpreters_call_eagerly() -> None:
    calls = []

    def identity(case: Case):
        calls.append(1)
        return case.arrays["x"]

    for seed in range(2):
        assert isinstance(layout_programs.call(identity, INTERPRETER, _case(seed)), np.ndarray)
    assert len(calls) == 2
