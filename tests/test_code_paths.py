"""Code paths by rule: a declared path that the budgeted draws missed is drawn for and
checked, so a bug on a path that random draws of this budget miss is found; a path no
draw reaches is reported, never passed."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallascheck.fuzz import verify
from pallascheck.kernels.backends import Backend
from pallascheck.properties import runner
from pallascheck.properties.spec import CodePath
from pallascheck.specs import elementwise_like

INTERPRET = Backend("interpret")


def _relu(x, interpret=None):
    return jnp.maximum(x, jnp.zeros((), x.dtype))


def _wrong_on_3d(x, interpret=None):
    """A relu with a bug on its 3-d path only (one shape of the five the builder draws)."""
    y = _relu(x)
    return -y if x.ndim == 3 else y


def _spec(fn, paths=()):
    spec = elementwise_like(
        fn, name=fn.__name__, activation="relu", dtypes=("float32",), differentiable=False, interpret="interpret"
    )
    return dataclasses.replace(spec, paths=paths)


THREE_D = CodePath("a 3-d input", lambda case, config: case.arrays["x"].ndim == 3)


def test_random_draws_of_one_example_miss_the_path_and_the_drawn_for_example_reaches_it() -> None:
    # the premise: one random example (one shape) at this seed is not the 3-d one
    assert not runner.run_property(_spec(_wrong_on_3d), "float32", INTERPRET, examples=1).failure
    tally = runner.run_property(_spec(_wrong_on_3d, (THREE_D,)), "float32", INTERPRET, examples=1)
    assert "[values]" in tally.failure, tally.failure
    assert tally.paths.get(THREE_D.name), tally.paths


def test_a_path_the_budget_reached_costs_no_extra_example() -> None:
    budgeted = runner.run_property(_spec(_relu), "float32", INTERPRET, examples=2)
    tally = runner.run_property(_spec(_relu, (THREE_D,)), "float32", INTERPRET, examples=2)
    assert not tally.failure and tally.paths[THREE_D.name] >= 1
    per_example = runner.layout_cases(INTERPRET, "small")
    # the budgeted draws are the same with or without the path; one example more at most
    assert budgeted.outcomes["values"].examples == 2 * per_example
    assert tally.outcomes["values"].examples in (2 * per_example, 3 * per_example)


def test_a_path_no_draw_reaches_is_reported_not_reached() -> None:
    never = CodePath("a 5-d input", lambda case, config: case.arrays["x"].ndim == 5)
    tally = runner.run_property(_spec(_relu, (THREE_D, never)), "float32", INTERPRET, examples=1)
    assert not tally.failure and tally.paths_declared == (THREE_D.name, never.name)
    assert never.name not in tally.paths
    row = verify.Row("relu", "float32", "values", True, 2, 0.1, None, 0.0)
    row.paths_declared, row.paths = tally.paths_declared, tally.paths
    assert verify.unreached([row]) == [("relu", "float32", never.name)]


def test_a_saved_failure_names_the_paths_its_case_reaches(tmp_path) -> None:
    from pallascheck.properties.spec import Case

    runner.run_property(_spec(_wrong_on_3d, (THREE_D,)), "float32", INTERPRET, examples=1, failure_dir=str(tmp_path))
    (saved,) = tmp_path.iterdir()
    assert Case.load(str(saved)).params["__failure__"]["paths"] == [THREE_D.name]


def test_a_builder_infers_only_the_paths_its_declared_sizes_reach() -> None:
    # A kernel that takes multiples of its block has no partial tile: a ragged-tail path
    # declared for it could never be reached, and would stand under NOT CHECKED forever.
    from pallascheck.specs import AttentionBlocks, MatmulBlocks, attention_like, matmul_like

    def names(spec) -> set[str]:
        assert all(not p.required for p in spec.paths)  # inferred: never required
        return {p.name for p in spec.paths}

    def attention(q, k, v, causal=False):
        return q

    def matmul(x, y):
        return x @ y

    multiples = dict(seq_q=(128,), seq_kv=(128, 256), blocks=AttentionBlocks(128, 128, 128))
    assert names(attention_like(attention, name="a", **multiples)) == {"several kv blocks: online softmax rescales"}
    # causal and aligned top-left: square cases only, so 128 queries never meet two kv blocks
    square = dict(multiples, causal=(False, True), causal_alignment="top_left")
    assert "causal over several kv blocks" not in names(attention_like(attention, name="a", **square))
    square["seq_q"] = (128, 256)
    assert "causal over several kv blocks" in names(attention_like(attention, name="a", **square))
    ragged = dict(multiples, seq_kv=(128, 200))
    assert "a ragged last kv block" in names(attention_like(attention, name="a", **ragged))

    k_tail = "several K tiles and a ragged last one"
    assert names(matmul_like(matmul, name="m", k=(64, 192), blocks=MatmulBlocks(block_k=64))) == set()
    assert names(matmul_like(matmul, name="m", k=(64, 100), blocks=MatmulBlocks(block_k=64))) == {k_tail}
