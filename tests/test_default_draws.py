"""What verify's default budget (runner.EXAMPLES per spec and dtype, seed 0) draws, and
what the suite's properties in the callback interpreters draw with one case per
example (kinds and configs in turn: runner.CALLBACK_CASES_PER_LAYOUT).

A mutant of a code path that no case reaches cannot die, so the draws are part of
the checks' strength (docs/mutation.md): each dtype must draw its own layouts, and
the optional operands must be drawn given somewhere in every spec's default run.
Only the draws are recorded here; no kernel runs."""

from __future__ import annotations

import hypothesis
import pytest
from hypothesis import strategies as st

from pallascheck.kernels import backends
from pallascheck.kernels.backends import Backend
from pallascheck.properties import checks, runner, strategies
from pallascheck.properties.outside import jax_bundled
from pallascheck.properties.outside import tokamax as tokamax_client
from pallascheck.properties.registry import get_spec, registry

VERIFY_EXAMPLES = runner.EXAMPLES  # verify's --examples


def _draws(monkeypatch, name: str) -> dict[str, list[tuple]]:
    """Per dtype, each case's (array shapes, params) as verify's default run draws them."""
    drawn: dict[str, list[tuple]] = {}

    def record(spec, case, config, backend, *, context, selected, tally=None):
        shapes = tuple(sorted((k, v.shape) for k, v in case.arrays.items()))
        drawn.setdefault(context.dtype, []).append((shapes, tuple(sorted(case.params.items()))))
        return tally or runner.Tally()

    monkeypatch.setattr(runner, "check_case", record)
    spec, backend = get_spec(name), Backend("interpret")
    for dtype in spec.dtypes_for(backend):
        runner.run_property(spec, dtype, backend, examples=VERIFY_EXAMPLES, seed=0)
    return drawn


def test_each_dtype_draws_its_own_layouts(monkeypatch) -> None:
    drawn = _draws(monkeypatch, "layer_norm")
    assert drawn["bfloat16"] != drawn["float16"]
    assert len({case[0] for cases in drawn.values() for case in cases}) > VERIFY_EXAMPLES


@pytest.mark.parametrize(
    "name, operand",
    [
        ("layer_norm", "scale"),
        ("layer_norm", "offset"),
        ("rms_norm", "scale"),
        ("attention", "bias"),
        ("attention", "mask"),
    ],
)
def test_verify_draws_each_optional_operand_given_and_not(monkeypatch, name: str, operand: str) -> None:
    cases = [dict(shapes) for cases in _draws(monkeypatch, name).values() for shapes, _ in cases]
    assert any(operand in c for c in cases) and any(operand not in c for c in cases)


# One case per example in the interpreters that call back into Python
# (runner.CALLBACK_CASES_PER_LAYOUT): the suite's properties there, as the suite runs
# them (ci profile: runner.EXAMPLES per dtype, seed 0).
CI_EXAMPLES = runner.EXAMPLES


def _callback_properties() -> list[tuple[str, str]]:
    mosaic = [
        (name, "mosaic_gpu_interpret")
        for name, spec in registry().items()
        if spec.runs_on(Backend("mosaic_gpu_interpret"))
    ]  # test_kernel_properties' CPU session
    outside = []  # test_bundled_kernels, test_tokamax: each kernel in its own interpreter
    for name in sorted(jax_bundled.BUNDLED) + sorted(tokamax_client.TOKAMAX):
        interpreter = next((b for b in get_spec(name).backends if Backend(b).is_interpreted), None)
        if interpreter in backends.CALLBACK_INTERPRETERS and name != "jax:gpu.attention_mgpu":
            outside.append((name, interpreter))
    return mosaic + outside


def _kinds_and_configs(monkeypatch, name: str, backend_name: str, cases_per_layout: int | None):
    """Over every dtype: the (offered kinds, kind) pairs drawn and the configs checked."""
    kinds: set[tuple[tuple[str, ...], str]] = set()
    configs: set[str] = set()
    offer = strategies.element_kinds

    def recorded(allowed=strategies.ELEMENT_KINDS):
        allowed = tuple(allowed)
        return offer(allowed).map(lambda kind: (kinds.add((allowed, kind)), kind)[1])

    def record(spec, case, config, backend, *, context, selected, tally=None):
        configs.add(repr(config))
        return tally or runner.Tally()

    monkeypatch.setattr(strategies, "element_kinds", recorded)
    monkeypatch.setattr(runner, "check_case", record)
    spec, backend = get_spec(name), Backend(backend_name)
    for dtype in spec.dtypes_for(backend):
        runner.run_property(spec, dtype, backend, examples=CI_EXAMPLES, seed=0, cases_per_layout=cases_per_layout)
    return kinds, configs


def _drawn_from(kinds: set[tuple[tuple[str, ...], str]], offered: tuple[str, ...]) -> set[str]:
    """The kinds drawn from ``offered`` or from a set that contains it or that it
    contains (matmul offers its kinds without "large" under gelu_tanh)."""
    return {k for allowed, k in kinds if set(allowed) <= set(offered) or set(offered) <= set(allowed)}


@pytest.mark.parametrize("name, backend", _callback_properties())
def test_one_case_per_example_draws_what_two_random_cases_drew(monkeypatch, name: str, backend: str) -> None:
    """Every input kind of every set offered is drawn, and every config that two
    random cases per example drew (the generic interpreter's draws) is checked."""
    assert runner.layout_cases(Backend(backend)) == runner.CALLBACK_CASES_PER_LAYOUT == 1
    in_turn_kinds, in_turn_configs = _kinds_and_configs(monkeypatch, name, backend, None)
    random_kinds, random_configs = _kinds_and_configs(monkeypatch, name, backend, runner.CASES_PER_LAYOUT)
    for offered in {allowed for allowed, _ in in_turn_kinds | random_kinds}:
        assert set(offered) <= _drawn_from(in_turn_kinds, offered), (offered, _drawn_from(in_turn_kinds, offered))
    assert random_configs <= in_turn_configs, random_configs - in_turn_configs


def test_in_turn_draws_replay_a_failing_example(monkeypatch) -> None:
    """Hypothesis replays a failing example to report it: the replay must draw the
    same case (else Hypothesis reports the test as flaky instead of the failure)."""
    seen = []

    def fail_on_third(spec, case, config, backend, *, context, selected, tally=None):
        seen.append(runner.fingerprint(case))
        if len(seen) >= 3 and seen[-1] == seen[2]:
            raise checks.CheckFailure(checks.Outcome("values", False, 2.0, "planted"), context)
        return tally or runner.Tally()

    monkeypatch.setattr(runner, "check_case", fail_on_third)
    tally = runner.run_property(
        get_spec("matmul"), "bfloat16", Backend("mosaic_gpu_interpret"), examples=CI_EXAMPLES, seed=0
    )
    assert [f.check for f in tally.findings] == ["values"], tally.failure
    assert seen[-1] == seen[2]  # the replay drew the third example's case again


def test_each_layout_key_takes_its_options_in_turn() -> None:
    # one case per example leaves it to chance whether a bucket is drawn at all: the
    # Mosaic GPU ragged dot's m 150, its only size with three row tiles, was not, at
    # verify's runner.EXAMPLES examples per dtype. Two keys with the same options turn apart.
    turn = strategies.InTurn()
    seen: dict[str, list[int]] = {"m": [], "n": []}

    @hypothesis.settings(max_examples=6, derandomize=True, database=None)
    @hypothesis.given(st.data())
    def draw(data: st.DataObject) -> None:
        with strategies.drawing_in_turn(turn):
            for key in seen:
                seen[key].append(data.draw(strategies.layout_choice(f"turns.{key}", (17, 40, 150))))

    draw()
    assert set(seen["m"][:3]) == set(seen["n"][:3]) == {17, 40, 150}, seen


def test_hardware_draws_take_layouts_and_configs_in_turn(monkeypatch) -> None:
    # On hardware an example is one compiled layout of many cases, and verify draws 3
    # per dtype: drawn at random, the Mosaic GPU attention never met its 200-key layout
    # (several kv blocks) or the warp-specialised dk/dv kernel, and mutants there
    # survived on an H100 (docs/mutation.md). No kernel runs: only the draws.
    drawn = []

    def record(spec, case, config, backend, *, context, selected, tally=None):
        drawn.append((case.arrays["k"].shape[1], config.consumers, config.consumers_bwd))
        return tally or runner.Tally()

    monkeypatch.setattr(runner, "check_case", record)
    spec, backend = get_spec("attention"), Backend("mosaic_gpu")
    assert not backend.is_interpreted and runner.layout_cases(backend) > 1
    for dtype in spec.dtypes_for(backend):
        runner.run_property(spec, dtype, backend, examples=VERIFY_EXAMPLES, seed=0)
    assert max(skv for skv, _, _ in drawn) == 200
    assert any(c == 2 for _, c, _ in drawn) and any(c == 2 for _, _, c in drawn)


def test_runs_that_differ_in_their_seed_start_their_turns_apart(monkeypatch) -> None:
    # verify splits a hardware property into parts with seeds of their own, and a
    # campaign's tasks differ in their seed: each beginning its turn at the same
    # option would draw the same few layouts in every part and every task.
    drawn: dict[int, list[tuple]] = {}

    def record(spec, case, config, backend, *, context, selected, tally=None):
        drawn.setdefault(context_seed, []).append((case.arrays["q"].shape[1], case.arrays["k"].shape[1]))
        return tally or runner.Tally()

    monkeypatch.setattr(runner, "check_case", record)
    spec, backend = get_spec("attention"), Backend("mosaic_gpu")
    for context_seed in (0, 1):
        runner.run_property(spec, "bfloat16", backend, examples=2, seed=context_seed)
    assert drawn[0] != drawn[1], drawn
    assert strategies.InTurn(seed=1).next((17, 40, 150)) == 40 and strategies.InTurn().next((17, 40, 150)) == 17
