"""What a failed check says at its worst element: the inputs there and the element
kinds drawn, overflow named where one side is infinite, plain float reprs; and the
name of the file that keeps the failing case."""

from __future__ import annotations

import numpy as np
from hypothesis import find
from hypothesis import strategies as st

from pallascheck.properties import checks, runner, strategies
from pallascheck.properties.spec import Case


def test_an_infinite_kernel_value_against_a_finite_oracle_is_called_an_overflow() -> None:
    outcome = checks.compare(np.array([1.0, np.inf]), np.array([1.0, 3e38]), np.array([1e-7, 1e30]))
    assert not outcome.passed and "overflow: the kernel's inf where the exact result 3e+38 is finite" in outcome.detail
    assert outcome.worst is not None and outcome.worst.kernel == np.inf and outcome.worst.oracle == 3e38
    clamped = checks.compare(np.array([-3.4e38]), np.array([-np.inf]), np.array([1.0]))
    assert "the exact result is -inf where the kernel's -3.4e+38 is finite" in clamped.detail, clamped.detail
    not_a_number = checks.compare(np.array([np.nan]), np.array([2.0]), np.array([1.0]))
    assert "the kernel's nan where the exact result 2 is finite" in not_a_number.detail, not_a_number.detail
    # a finite miss says neither, and the values print as plain floats
    plain = checks.compare(np.array([1.5]), np.array([1.0]), np.array([0.1]))
    assert "kernel=1.5 oracle=1.0 " in plain.detail and "overflow" not in plain.detail, plain.detail
    # an infinite result the bound allows (it may overflow there) passes without a story
    allowed = checks.compare(np.array([np.inf]), np.array([3e38]), np.array([np.inf]))
    assert allowed.passed and "overflow" not in allowed.detail


def test_the_inputs_at_the_worst_element_follow_the_axes_they_share_with_the_output() -> None:
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    a = np.full((4, 64), 2.0, np.float32)
    a[1, 0], a[1, 1], a[1, 2] = 1e-40, np.inf, 0.0  # subnormal in float32, inf, zero
    b = np.ones((64, 8), np.float32)
    bias = np.array([0.5, -0.25], np.float32)
    case = Case({"x": x, "a": a, "b": b, "bias": bias}, {}, kinds=("large", "normal"))
    worst = checks.Worst("out", (1, 3), (4, 8))
    said = runner.inputs_at(case, worst)
    assert said.splitlines() == [
        "inputs at out[1, 3] (element kinds drawn: large, normal):",
        "    x[1, 3]: 11",  # the output's shape: the same element
        "    a[1, :]: 64 values, |x| from 0 to 2, 1 subnormal, 1 zero, 1 inf",  # the row it shares
        "    b[:, :]: 512 values, |x| from 1 to 1",  # no axis shared: the whole input
        "    bias[:]: [0.5, -0.25]",  # few values: each one
    ], said


def test_a_drawn_case_carries_the_element_kinds_chosen_for_it() -> None:
    @st.composite
    def cases(draw: st.DrawFn) -> Case:
        kind = draw(strategies.element_kinds(("large", "subnormal")))
        return Case({"x": strategies.elements(0, (4,), "float32", kind)}, {})

    case = find(strategies.with_drawn_kinds(cases()), lambda c: True)
    assert case.kinds in (("large",), ("subnormal",))
    with strategies.pinned_element_kind("subnormal"):
        assert find(strategies.with_drawn_kinds(cases()), lambda c: True).kinds == ("subnormal",)


def test_a_saved_case_keeps_its_kinds(tmp_path) -> None:
    path = str(tmp_path / "case.npz")
    Case({"x": np.ones(3, np.float32)}, {"k": 1}, kinds=("offset_rows",)).save(path)
    assert Case.load(path).kinds == ("offset_rows",)


def test_a_saved_failure_is_named_without_colons(tmp_path) -> None:
    path = runner.failure_path(str(tmp_path), "my_specs:BIAS_GELU", "bfloat16", "values")
    assert path == str(tmp_path / "my_specs_BIAS_GELU-bfloat16-values.npz")
