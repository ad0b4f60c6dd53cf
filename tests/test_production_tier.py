"""The production shape tier (properties/production.py): named layouts of real
models, drawn in the spec's own domain, and a memory rule that skips, saying so, the
layouts whose oracle would not fit the device."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pallascheck.kernels.backends import Backend
from pallascheck.properties import production, runner
from pallascheck.properties.device import compilation
from pallascheck.properties.registry import get_spec
from pallascheck.properties.spec import Case


def _drawn(strategy: st.SearchStrategy[Case], examples: int) -> list[Case]:
    """The cases of ``examples`` Hypothesis examples of ``strategy``."""
    cases = []

    @settings(
        max_examples=examples,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def draw(data: st.DataObject) -> None:
        cases.append(data.draw(strategy))

    draw()
    return cases


def test_production_cases_have_the_layouts_shapes() -> None:
    strategy = get_spec("attention").production("bfloat16", Backend("interpret"), layout="BERT-large")
    seen = [(c.arrays["q"].shape, c.arrays["k"].shape, c.params["causal"]) for c in _drawn(strategy, 1)]
    assert seen == [((4, 2048, 16, 64), (4, 2048, 16, 64), False)]


def test_layouts_that_do_not_fit_are_skipped_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(production, "memory_limit", lambda backend: 20 * 2**30)
    plan = production.plan(get_spec("attention").production_layouts, Backend("interpret"))
    assert any(l.name.startswith("llama-3 8B:") for l in plan.fitting)
    skipped = [line for line in plan.skipped if line.startswith("llama-3.1 8B 128k")]
    assert skipped and "its check needs" in skipped[0] and "allows 20 GiB" in skipped[0], plan.skipped
    monkeypatch.setattr(production, "memory_limit", lambda backend: 2**20)
    with pytest.raises(ValueError, match="no production layout of matmul fits"):
        get_spec("matmul").production("bfloat16", Backend("interpret"))


def test_a_kernel_with_no_layout_that_fits_is_left_out_of_a_run_saying_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    # A 6 GiB share: matmul's decode layouts fit, none of the GLU's (its smallest,
    # decode batch 16, needs 7.7 GiB). Before, every GLU task of a production fuzz whose
    # share fit none died drawing its first case and was booked as the kernel's failure.
    monkeypatch.setattr(production, "memory_limit", lambda backend: 6 * 2**30)
    monkeypatch.setenv(production.SHARING_ENV_VAR, "3")
    kept, lines, skipped = production.planned(
        {n: get_spec(n) for n in ("matmul", "gated_linear_unit", "top_k")}, Backend("interpret")
    )
    assert kept == ["matmul", "top_k"], lines
    # each layout skipped is booked as not checked, with its kernel
    assert {family for family, _ in skipped} == {"matmul", "gated_linear_unit"}, skipped
    assert len(skipped) == sum("skipped by the memory rule" in line for line in lines)
    assert lines[-1] == (
        "not checked: gated_linear_unit: no production layout fits (fewer --jobs give each process a larger share)"
    ), lines
    assert any("skipped by the memory rule: llama-3 8B, decode batch 16" in line for line in lines), lines
    from pallascheck.cli import _common

    with pytest.raises(SystemExit, match="nothing to check: no selected kernel has a production layout that fits"):
        _common.fitting(["gated_linear_unit"], Backend("interpret"))
    assert "not checked: gated_linear_unit" in capsys.readouterr().out


def test_a_resumed_production_campaign_keeps_to_the_memory_rule(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``fuzz --resume`` takes the tier and kernels from the saved campaign, so the rule
    above applies to it too: before, a resumed production GLU campaign on 3 jobs skipped
    it (the command line's tier is the default, small) and booked the kernel as crashed."""
    import json

    from pallascheck import cli
    from pallascheck.cli import fuzz as fuzz_command
    from pallascheck.fuzz import corpus, plan

    (tmp_path / corpus.STATE).write_text(
        json.dumps({"shapes": "production", "targets": ["gated_linear_unit"], "backend": "mosaic_gpu"})
    )
    monkeypatch.setattr(production, "memory_limit", lambda backend: 6 * 2**30)  # a share no GLU layout fits
    monkeypatch.setenv(production.SHARING_ENV_VAR, "1")  # restored after: the CLI sets it
    monkeypatch.setattr(fuzz_command, "available_backend", lambda name: Backend("mosaic_gpu"))
    monkeypatch.setattr(plan, "gpu_devices", lambda backend: 1)
    with pytest.raises(SystemExit, match="nothing to check"):
        cli.main(["fuzz", "--resume", "--corpus", str(tmp_path), "--jobs", "3", "--minutes", "1"])
    assert "not checked: gated_linear_unit: no production layout fits" in capsys.readouterr().out


def test_a_spec_without_a_production_tier_says_so() -> None:
    with pytest.raises(ValueError, match="top_k has no production shape tier"):
        runner.tier_cases(get_spec("top_k"), "production")
    with pytest.raises(ValueError, match="shapes must be one of"):
        runner.tier_cases(get_spec("top_k"), "huge")


@pytest.mark.parametrize("fan_in", [False, True])
def test_production_glu_weights_keep_float16_outputs_in_range(fan_in: bool) -> None:
    """At d 4096 the gate and up dots of "positive" entries are each about d/4: their
    product overflows float16 unless the weights are drawn at a model's 1/sqrt(d)
    scale, as the production tier draws them."""
    from pallascheck.properties import strategies
    from pallascheck.properties.families import gated_linear_unit as glu_spec

    domain = glu_spec.Domain(leading=((16,),), d=(4096,), f=(32,), fan_in_weights=fan_in)
    strategy = glu_spec.cases("float16", Backend("interpret"), domain=domain)
    with strategies.pinned_element_kind("positive"):
        cases = _drawn(strategy, 2)
    for case in cases:  # as the kernel requires
        assert {a.dtype for a in case.arrays.values()} == {np.dtype(np.float16)}, case.describe()
    largest = [float(abs(get_spec("gated_linear_unit").oracle(case).out).max()) for case in cases]
    assert (max(largest) < 65504.0) == fan_in, largest


def test_processes_sharing_a_device_must_be_counted_in_whole_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(production.SHARING_ENV_VAR, "half")
    with pytest.raises(ValueError, match="PALLASCHECK_PROCESSES_PER_DEVICE must be a positive integer"):
        compilation.processes_per_device()


@pytest.mark.parametrize("kernel_takes_a_bias", [True, False])
def test_attention_bias_layouts_draw_only_biases_the_device_oracle_slices(kernel_takes_a_bias: bool) -> None:
    """Every case of a bias layout holds a bias of b x h x s x s elements (a broadcast
    one keeps the oracle from slicing, and unsliced it does not fit a GPU); a kernel
    whose domain takes no bias gets none. Drawn at the layout's fields with tiny sizes."""
    import dataclasses

    from pallascheck.properties.families import attention as attention_spec

    (layout,) = [l for l in get_spec("attention").production_layouts if l.name.startswith("per-head bias")]
    tiny = dict(heads=((1, 4, 2),), seq_q=(8,), head_dims=(16,))
    domain = dataclasses.replace(attention_spec.DOMAIN, bias=kernel_takes_a_bias)
    domain = dataclasses.replace(domain, **{**layout.fields, **tiny})
    cases = _drawn(attention_spec.cases("float32", Backend("interpret"), domain=domain), 6)
    shapes = {c.arrays["bias"].shape if "bias" in c.arrays else None for c in cases}
    assert shapes == ({(1, 4, 8, 8)} if kernel_takes_a_bias else {None}), shapes
    plain = [l for l in get_spec("attention").production_layouts if "bias" not in l.name]
    assert plain and all(l.fields["bias"] is False for l in plain)


def test_a_worker_held_to_its_share_plans_with_jax_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose allocator is held to its share (compilation.configure) plans with
    JAX's limit, which is that share already; another divides the device's."""
    monkeypatch.setattr(production, "device_memory", lambda backend: 40 * 2**30)
    monkeypatch.setenv(production.SHARING_ENV_VAR, "2")
    monkeypatch.delenv(compilation.CAPPED_ENV_VAR, raising=False)
    assert production.memory_limit(Backend("mosaic_gpu")) == 20 * 2**30
    monkeypatch.setenv(compilation.CAPPED_ENV_VAR, "2")
    assert production.memory_limit(Backend("mosaic_gpu")) == 40 * 2**30
    assert production.memory_limit(Backend("interpret")) == 40 * 2**30  # the host's memory is not shared out
