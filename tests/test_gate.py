"""The gate's pieces without running kernels: task validation, a task's contract, the
jaxpr's anatomy, the verdict's JSON and the command's errors."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallascheck.bench.gate import integrity, probes, units
from pallascheck.bench.gate.candidate import Candidate, load_candidate
from pallascheck.bench.gate.task import Arg, Task, load_task, shipped_tasks
from pallascheck.bench.gate.verdict import Reason, Verdict
from pallascheck.cli import main
from pallascheck.kernels.backends import get_backend
from pallascheck.oracles import derive
from pallascheck.oracles.tolerance import GPU, arithmetic_for
from pallascheck.properties import checks, strategies
from pallascheck.properties.spec import Case


def test_at_least_twelve_tasks_ship_and_load() -> None:
    names = shipped_tasks()
    assert len(names) >= 12, names
    for name in names:
        task = load_task(name)
        assert task.name == name
        assert task.draw_dims(0, 2), f"{name}: its domain holds no size beyond the shown one"


def test_a_task_names_the_rule_it_breaks() -> None:
    with pytest.raises(ValueError, match="shape names"):
        Task("t", jnp.sin, {"x": Arg(("n",))}, dims={"m": (1,)}, shown={"m": 1}, signature="")
    with pytest.raises(ValueError, match="not among"):
        Task("t", jnp.sin, {"x": Arg(("n",))}, dims={"n": (1, 2)}, shown={"n": 3}, signature="")
    with pytest.raises(ValueError, match="neither a .py file nor a shipped task"):
        load_task("no_such_task")


def test_costly_work_is_counted_outside_pallas_only() -> None:
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    plain = integrity.anatomy(integrity.trace(lambda a: jnp.exp(a) @ a.T, x))
    assert plain.pallas_calls == 0
    assert plain.outside == {"exp": 128.0, "dot_general": 2.0 * 8 * 8 * 16}


def test_a_mosaic_gpu_kernel_counts_as_pallas() -> None:
    """Mosaic GPU kernels (``plgpu.kernel``) trace to core_map/mpmd_map, not pallas_call:
    their work is Pallas work, and none of it is counted outside."""
    from pallascheck.kernels.matmul import matmul

    x = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    mosaic = integrity.anatomy(integrity.trace(lambda a, b: matmul(a, b, backend="mosaic_gpu_interpret"), x, x))
    assert mosaic.pallas_calls >= 1 and "dot_general" not in mosaic.outside


def test_a_verdict_in_some_of_the_tasks_dtypes(capsys) -> None:
    task = load_task("softmax")
    assert task.only_dtypes(["bfloat16"]).dtypes == ("bfloat16",)
    with pytest.raises(ValueError, match=r"each must be one of task softmax's dtypes \(float32, bfloat16\)"):
        task.only_dtypes(["float16"])
    with pytest.raises(SystemExit) as stop:
        main(["gate", "softmax", "m:f", "--dtype", "f16"])
    assert stop.value.code == 2
    assert "--dtype 'float16' is not among task softmax's dtypes" in capsys.readouterr().err


def test_an_input_wrong_in_either_order_is_a_wrong_value_not_state(tmp_path) -> None:
    """Hidden state needs a contrast: B wrong after A, and right as a first call. A
    candidate wrong on B in both orders (as an H100 verdict once called a Triton kernel
    wrong at B's values) is left to the values checks."""
    task, backend = load_task("softmax"), get_backend("interpret")
    shown = units.plan(task, 0, 0)[0]
    a, b = units.case(task, shown, 0), units.case(task, shown, 7919)
    xa, xb = float(a.arrays["x"][0, 0]), float(b.arrays["x"][0, 0])
    assert xa != xb
    (tmp_path / "wrong_on_b.py").write_text(
        "import jax.numpy as jnp\n"
        "from tests.gate_corpus.honest import pallas_softmax\n\n\n"
        "def candidate(x, interpret=False):\n"
        "    out = pallas_softmax(x, interpret)\n"
        f"    return jnp.where(x[0, 0] {'>' if xb > xa else '<'} {(xa + xb) / 2!r}, out * 0.5, out).astype(out.dtype)\n"
    )
    candidate = load_candidate(f"{tmp_path}/wrong_on_b.py:candidate")
    spec = units.unit_spec(task, candidate, shown, 0)
    assert probes.judged(spec, a, backend)(probes.run(spec, a, backend)).passed
    assert not probes.judged(spec, b, backend)(probes.run(spec, b, backend)).passed
    finding, both_orders = probes.hidden_state(task, candidate, shown, backend, 0)
    assert both_orders and finding is None


def test_verdict_status_follows_its_reasons() -> None:
    verdict = Verdict("softmax", "c", "interpret", 0)
    assert verdict.status == "pass" and verdict.reward() == 1.0
    verdict.reasons.append(Reason("wrong_values", "off"))
    assert verdict.status == "fail"
    verdict.reasons.append(Reason("wrong_signature", "f32 for bf16"))
    assert json.loads(verdict.dumps())["status"] == "invalid"
    with pytest.raises(ValueError, match="not one of"):
        Reason("made_up", "")


def test_the_command_judges_a_candidate_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "verdict.json"
    code = main(["gate", "softmax", "tests.gate_corpus.gaming:reference_itself", "--json", str(out)])
    assert code == 1
    saved = json.loads(out.read_text())
    assert saved["status"] == "fail" and saved["reasons"][0]["name"] == "no_pallas_call"
    assert "FAIL" in capsys.readouterr().out


def test_the_command_refuses_an_unknown_task(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["gate", "no_such_task", "m:f"])
    assert stop.value.code == 2
    assert "shipped task" in capsys.readouterr().err


def _cross_entropy_case() -> tuple[Case, np.ndarray]:
    """Seed 50 of the shown sizes' domain, and the f32 gradient ``g (p - onehot)`` of a
    fused kernel with p correctly rounded (IEEE f32 steps: the same on every machine)."""
    tokens, vocab = 8, 256
    logits = strategies.elements(50, (tokens, vocab), "float32", "normal", reduction=vocab)
    labels = np.random.default_rng(50).integers(0, vocab, tokens).astype(np.int32)
    g = strategies.elements(59, (tokens,), "float32", "normal")
    z = logits.astype(np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    p = (e / e.sum(-1, keepdims=True)).astype(np.float32)
    onehot = (np.arange(vocab)[None, :] == labels[:, None]).astype(np.float32)
    return Case({"logits": logits, "labels": labels, "cotangent": g}, {}), g[:, None] * (p - onehot)


def _fused_with_p_in(dtype: str, case: Case) -> np.ndarray:
    """The fused gradient with its p rounded to ``dtype`` first."""
    logits, labels, g = case.arrays["logits"], case.arrays["labels"], case.arrays["cotangent"]
    z = logits.astype(np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    p = (e / e.sum(-1, keepdims=True)).astype(strategies.np_dtype(dtype)).astype(np.float32)
    onehot = (np.arange(z.shape[-1])[None, :] == labels[:, None]).astype(np.float32)
    return (g[:, None] * (p - onehot)).astype(np.float64)


def test_the_cross_entropy_contract_admits_the_fused_order_and_no_lower_precision() -> None:
    task = load_task("cross_entropy")
    case, fused = _cross_entropy_case()
    spec = units.unit_spec(task, Candidate(lambda *a: None, ""), units.Unit("shown", task.shown, {}, "float32"), 0)
    assert spec.gradients is not None
    ref, arith = spec.oracle(case), arithmetic_for(get_backend("interpret"))
    contract = spec.gradients.bound(case, ref, {}, task.facts, arith)["dlogits"]
    args = (case.arrays["logits"], case.arrays["labels"], case.arrays["cotangent"])
    own = derive.derive(derive.vjp_function(task.reference, (0,)), args, facts=task.facts, arith=arith)
    error = np.abs(fused.astype(np.float64) - own.values[0])
    assert np.nanmax(error / own.bounds[0]) > 1.0, "the reference's own order rejects the fused kernel's here"
    assert np.nanmax(error / contract) <= 1.0
    # p rounded to bf16 first: a lower precision than declared stays outside the contract
    low = _fused_with_p_in("bfloat16", case)
    assert np.nanmax(np.abs(low - own.values[0]) / contract) > 1.0


def test_a_formulation_of_another_op_is_refused() -> None:
    task = load_task("softmax")
    wrong = dataclasses.replace(task, formulations=(lambda x: task.reference(x) * 2.0,))
    x = strategies.elements(0, (8, 128), "float32", "normal", reduction=128)
    spec = units.unit_spec(wrong, Candidate(lambda *a: None, ""), units.Unit("shown", task.shown, {}, "float32"), 0)
    case = Case({"x": x}, {})
    with pytest.raises(ValueError, match="formulations.0. is not the reference's op"):
        spec.bound(case, spec.oracle(case), task.facts, arithmetic_for(get_backend("interpret")))


def _near_tie_row() -> np.ndarray:
    """The H100 verdict's input of fake_quantize (drawn rows=1,d=128, positive): x[0, 37]
    = 0.787478 in a row of max 0.9951214, so 127 x / max = 100.500007, a rounding
    near-tie; the other elements keep away from ties."""
    row = np.full((1, 128), 0.25, np.float32)  # 127 * 0.25 / max = 31.9: no tie
    row[0, 37], row[0, 100] = np.float32(0.787478), np.float32(0.9951214)
    return row


def test_a_rounding_near_tie_is_bounded_by_both_sides_of_the_decision() -> None:
    """The H100's fake_quantize rejection: the round there was unverifiable (its operand
    within error of k + 1/2, on the CPU's arithmetic as on the GPU's). Either side is
    right, so the bound is one quantization step there: the kernel's output, one f32 ulp
    from the oracle's side, passes; a value past both sides still fails."""
    task = load_task("fake_quantize")
    unit = units.Unit("drawn", {"rows": 1, "d": 128}, {}, "float32")
    tally = units.Unverifiable()
    spec = units.unit_spec(task, Candidate(lambda x: x, ""), unit, 0, tally)
    case = Case({"x": _near_tie_row()}, {})
    ref = spec.oracle(case)
    bound = spec.bound(case, ref, task.facts, GPU)
    assert (tally.unverifiable, tally.elements) == (0, 128)
    step = 0.9951214 / 127
    assert step <= bound[0, 37] < 1.01 * step, bound[0, 37]  # one step, no more
    assert np.all(np.delete(bound, 37) < 1e-6)  # elsewhere a few ulps
    expected = np.asarray(spec.expected(ref))
    near = expected.astype(np.float32)
    near[0, 37] = np.float32(0.7913957238197327)  # the H100's output there
    assert checks.compare(near, expected, bound).passed
    other = expected.astype(np.float32)
    other[0, 37] = np.float32(100 * np.float32(np.float32(0.9951214) / np.float32(127)))  # the tie's other side
    assert checks.compare(other, expected, bound).passed
    for wrong in (expected[0, 37] + 1.5 * step, expected[0, 37] - 2.5 * step):  # beyond either side
        off = expected.astype(np.float32)
        off[0, 37] = np.float32(wrong)
        assert not checks.compare(off, expected, bound).passed


def test_a_unit_mostly_unverifiable_checked_little() -> None:
    tally = units.Unverifiable()
    tally.add("out", np.array([np.nan, np.nan, 1.0]), lambda at: "div")
    assert tally.checked_little and tally.first == "out[0] (div)"
    tally.add("out", np.ones(3), lambda at: "div")
    assert tally.share == pytest.approx(2 / 6) and not tally.checked_little


def test_softcap_attentions_rows_are_unverifiable_on_the_gpu_arithmetic_only() -> None:
    """The H100's softcap_attention rejection (shown t=32,d=16 f32, "large" inputs, a row
    dominated by the softmax's div): on the GPU arithmetic the reference's f32 dots at
    default precision are derived as tf32, the logits' error exceeds the cap's range and
    the softmax's sum may reach 0; the CPU's f32 dots leave every element verifiable."""
    task = load_task("softcap_attention")
    unit = units.Unit("shown", {"t": 32, "d": 16}, {}, "float32")
    q, k, v = (strategies.elements(i, (32, 16), "float32", "large", reduction=r) for i, r in enumerate((16, 16, 1)))
    case = Case({"q": q, "k": k, "v": v}, {})
    counts = {}
    for arith in (GPU, arithmetic_for(get_backend("interpret"))):
        tally = units.Unverifiable()
        spec = units.unit_spec(task, Candidate(lambda *a: a[0], ""), unit, 0, tally)
        ref = spec.oracle(case)
        bound = spec.bound(case, ref, task.facts, arith)
        counts[arith.name] = tally.unverifiable
        assert int(np.isinf(bound).sum()) == tally.unverifiable  # no bound there: not compared
        if tally.unverifiable:
            assert tally.unverifiable % 16 == 0 and "div at" in tally.first, tally.first  # whole rows of d=16
            # the probabilistic bound and xla_reference's are not the checks' own: not counted again
            spec.bound(case, ref, task.facts, arith.with_probabilistic())
            spec.bound(case, ref, None, arith)
            assert tally.unverifiable == counts[arith.name]
    assert counts["cpu"] == 0 and counts["gpu"] > 0, counts
