"""What verify's default budget (3 examples per spec and dtype, seed 0) draws.

A mutant of a code path that no case reaches cannot die, so the draws are part of
the checks' strength (docs/mutation.md): each dtype must draw its own layouts, and
the optional operands must be drawn given somewhere in every spec's default run.
Only the draws are recorded here; no kernel runs."""
from __future__ import annotations

import pytest

from pallascheck.kernels.backends import Backend
from pallascheck.properties import runner
from pallascheck.properties.spec import get_spec

VERIFY_EXAMPLES = 3  # fuzz/cli.py: verify's --examples


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


@pytest.mark.parametrize("name, operand", [("layer_norm", "scale"), ("layer_norm", "offset"), ("rms_norm", "scale"),
                                           ("attention", "bias"), ("attention", "mask")])
def test_verify_draws_each_optional_operand_given_and_not(monkeypatch, name: str, operand: str) -> None:
    cases = [dict(shapes) for cases in _draws(monkeypatch, name).values() for shapes, _ in cases]
    assert any(operand in c for c in cases) and any(operand not in c for c in cases)
