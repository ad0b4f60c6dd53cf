"""The gate's pieces without running kernels: task validation, the jaxpr's anatomy, the
verdict's JSON and the command's errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from pallascheck.bench.gate import integrity
from pallascheck.bench.gate.task import Arg, Task, load_task, shipped_tasks
from pallascheck.bench.gate.verdict import Reason, Verdict
from pallascheck.cli import main


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
