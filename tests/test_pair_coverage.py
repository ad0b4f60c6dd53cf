"""Pairs by rule: every pair of values of a spec's declared discrete parameters is met
in one checked case, the pairs the budgeted draws missed drawn for (greedily: one
example meets as many open pairs as it can); a pair no draw meets is reported not
met, never counted. Most tests record the draws (the runner's check replaced by a
recorder): no kernel runs."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import pytest

from pallascheck import cli
from pallascheck.cli import verify as verify_command
from pallascheck.fuzz import verify
from pallascheck.kernels.backends import Backend
from pallascheck.properties import pairs, registry, runner
from pallascheck.properties.families.elementwise import SHAPES, X_KINDS
from pallascheck.properties.spec import Case, Parameter
from pallascheck.specs import elementwise_like

INTERPRET = Backend("interpret")
RANKS = tuple(sorted({len(s) for s in SHAPES}))  # 1, 2, 3
RANK = Parameter("rank", RANKS, lambda case, config: (case.arrays["x"].ndim,))
KIND = Parameter("input kind", X_KINDS, lambda case, config: case.kinds, element_kind=True)


def _relu(x, interpret=None):
    return jnp.maximum(x, jnp.zeros((), x.dtype))


def _wrong_on_3d_large(x, interpret=None):
    """A relu with a bug where two parameters meet: a 3-d input of large values."""
    y = _relu(x)
    return -y if x.ndim == 3 and float(jnp.max(jnp.abs(x))) > 1e10 else y


def _spec(fn, parameters=()):
    spec = elementwise_like(
        fn, name=fn.__name__, activation="relu", dtypes=("float32",), differentiable=False, interpret="interpret"
    )
    return dataclasses.replace(spec, parameters=parameters)


def _recorded(monkeypatch, spec, examples: int = 1) -> tuple[runner.Tally, list[Case]]:
    """The tally of a run whose checks only record the cases they were given."""
    checked: list[Case] = []

    def record(spec_, case, config, backend, *, context, selected, tally=None):
        checked.append(case)
        return tally or runner.Tally()

    monkeypatch.setattr(runner, "check_case", record)
    return runner.run_property(spec, "float32", INTERPRET, examples=examples, cover_pairs=True), checked


@pytest.mark.quick
def test_the_declared_pairs_are_every_pair_of_values_of_two_parameters() -> None:
    flag = Parameter("flag", (False, True), lambda case, config: (True,))
    declared = pairs.declared([RANK, flag, KIND])
    assert len(declared) == len(set(declared)) == 3 * 2 + 3 * len(X_KINDS) + 2 * len(X_KINDS)
    assert (("rank", 3), ("input kind", "large")) in declared
    assert pairs.label((("rank", 3), ("flag", True))) == "rank=3 & flag=True"
    with pytest.raises(ValueError, match="distinct names"):
        pairs.declared([RANK, RANK])


@pytest.mark.quick
def test_a_case_meets_the_pairs_of_the_values_it_takes_and_an_undeclared_value_is_refused() -> None:
    case = Case({"x": jnp.zeros((2, 3, 4))}, {}, kinds=("large", "normal"))
    assert pairs.met([RANK, KIND], case, None) == {
        (("rank", 3), ("input kind", "large")),
        (("rank", 3), ("input kind", "normal")),
    }
    four_d = Case({"x": jnp.zeros((1, 2, 3, 4))}, {}, kinds=("large",))
    with pytest.raises(ValueError, match="parameter 'rank' took \\['4'\\], not among its declared values"):
        pairs.met([RANK, KIND], four_d, None)


def test_the_pairs_the_budget_missed_are_drawn_for_until_every_pair_is_met(monkeypatch) -> None:
    before, budgeted = _recorded(monkeypatch, _spec(_relu))
    # the premise: one example (two cases) meets two of the 21 pairs at most
    assert len({pairs.label(p) for c in budgeted for p in pairs.met([RANK, KIND], c, None)}) <= 2
    tally, checked = _recorded(monkeypatch, _spec(_relu, (RANK, KIND)))
    assert set(tally.pairs) == set(tally.pairs_declared) and len(tally.pairs_declared) == 3 * len(X_KINDS)
    assert checked[: len(budgeted)] == budgeted  # the budgeted draws are unchanged
    # greedy, with the kind pinned: the lower bound is one pair a case (one rank, one kind)
    assert len(checked) <= 2 * len(tally.pairs_declared)


def test_a_bug_where_two_parameters_meet_is_found_by_the_example_drawn_for_the_pair() -> None:
    three_d = Parameter("3-d", (False, True), lambda case, config: (case.arrays["x"].ndim == 3,))
    # the premise: the budgeted draws of one example miss the pair
    assert not runner.run_property(_spec(_wrong_on_3d_large), "float32", INTERPRET, examples=1).failure
    spec = _spec(_wrong_on_3d_large, (three_d, LARGE))
    # the suite's spec tests count the pairs and do not draw for them
    assert not runner.run_property(spec, "float32", INTERPRET, examples=1).failure
    tally = runner.run_property(spec, "float32", INTERPRET, examples=1, cover_pairs=True)
    assert "[values]" in tally.failure, tally.failure


# Draws tried for a pair before it is given up on: fewer than the runner's, which
# changes how long an impossible pair is searched for, not whether it is met
FEW_DRAWS = 40
LARGE = Parameter("large input", (False, True), lambda case, config: ("large" in case.kinds,))
WITH_RANK_5 = Parameter("rank", (*RANKS, 5), RANK.of)


def test_a_pair_no_draw_meets_is_reported_not_met(monkeypatch) -> None:
    monkeypatch.setattr(runner, "PATH_DRAWS", FEW_DRAWS)
    tally, _ = _recorded(monkeypatch, _spec(_relu, (WITH_RANK_5, LARGE)))
    never = {"rank=5 & large input=False", "rank=5 & large input=True"}
    assert set(tally.pairs_declared) - set(tally.pairs) == never
    row = verify.Row("relu", "float32", "values", True, 2, 0.1, None, 0.0)
    row.pairs_declared, row.pairs = tally.pairs_declared, tally.pairs
    assert {p for _, _, p in verify.unmet_pairs([row])} == never
    assert set(verify.as_json(row)["pairs_not_met"]) == never


def test_verify_prints_the_pairs_covered_and_strict_fails_on_a_pair_not_met(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(runner, "PATH_DRAWS", FEW_DRAWS)
    spec = dataclasses.replace(_spec(_relu, (WITH_RANK_5, LARGE)), name="relu_with_pairs")
    monkeypatch.setitem(registry._REGISTRY, spec.name, spec)
    monkeypatch.chdir(tmp_path)
    argv = ["verify", "--kernel", spec.name, "--examples", "1", "--jobs", "1", "--failures", "", "--json", "v.json"]
    # without --cover-pairs the budget's draws alone: the pairs they missed are counted as not checked
    assert cli.main([*argv, "--strict"]) == verify_command.STRICT_EXIT
    out = capsys.readouterr().out
    assert "parameter pairs not met (--cover-pairs draws for them)" in out, out
    # drawn for: every check passed; --strict fails on the pairs no draw can meet
    assert cli.main([*argv, "--strict", "--cover-pairs"]) == verify_command.STRICT_EXIT
    out = capsys.readouterr().out
    assert "pairs covered" in out and " 6/8 " in out, out
    assert "relu_with_pairs float32: parameter pair not met: rank=5 & large input=False" in out, out
    report = json.loads((tmp_path / "v.json").read_text())
    (first,) = [r for r in report["rows"] if r["pairs_declared"]]
    assert sorted(first["pairs_not_met"]) == ["rank=5 & large input=False", "rank=5 & large input=True"]
