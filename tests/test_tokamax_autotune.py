"""``studies/tokamax_autotune.py`` on the CPU: Tokamax's autotuner on its XLA attention
(one config, Tokamax's NullConfig), then every config it timed through our gate. On
a GPU, ``python -m studies.tokamax_autotune`` does the same for its Mosaic GPU
attention and ragged dot (README, "Tokamax as a client")."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import pytest

from pallascheck.kernels.backends import Backend
from pallascheck.properties import strategies
from pallascheck.properties.outside import tokamax as tokamax_client
from pallascheck.properties.spec import KernelSpec

tokamax = pytest.importorskip("tokamax", reason=f"Tokamax is not installed: {tokamax_client.PIP}")
from studies import tokamax_autotune  # noqa: E402 - imports Tokamax's ops

SHAPE = (1, 64, 2, 32)


@pytest.fixture(autouse=True)
def _on_the_cpu(backend: Backend) -> None:
    # Seen on an H200: Tokamax's XLA attention takes its dot precision from JAX's default
    # backend, TF32 on a GPU host, which XLA:CPU refuses ("The precision
    # 'TF32_TF32_F32' is not supported by dot_general on CPU").
    if not backend.is_interpreted:
        pytest.skip(f"a CPU check (Tokamax's XLA attention on XLA:CPU): run without --backend, not with {backend}")


def _workload(spec_for: Any) -> tokamax_autotune.Workload:
    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(tokamax.dot_product_attention(q, k, v, implementation="xla").astype(jnp.float32))

    return tokamax_autotune.Workload(
        "attention xla",
        jax.grad(loss, argnums=(0, 1, 2)),
        lambda: [jnp.asarray(tokamax_autotune._normal(i, SHAPE, "float32")) for i in range(3)],
        spec_for,
        lambda: tokamax_client.attention_xla("xla"),
        lambda: {n: tokamax_autotune._normal(10 + i, SHAPE, "float32") for i, n in enumerate("qkv")},
        {"causal": False, "sm_scale": None},
    )


def _configs(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for op in result["ops"] for row in op["configs"]]


def test_every_timed_config_is_gated() -> None:
    result = tokamax_autotune.check_workload(
        _workload(lambda ba, config: tokamax_client.attention_xla("xla")),
        Backend("interpret"),
        strategies.ELEMENT_KINDS,
        progress=lambda line: None,
    )
    rows = _configs(result)
    assert rows and all(row["verdict"] == "valid" and 0 < row["budget"] <= 1 for row in rows), rows
    assert result["gate_cases"] > 1  # the own inputs and the adversarial logits


def test_a_config_outside_the_bound_is_rejected_and_named() -> None:
    """A pinned spec whose output is 1% off (a stand-in for a config with broken
    numerics) is rejected by the values check; Tokamax's pick is then flagged."""

    def off_by_one_percent(bound_args: Any, config: Any) -> KernelSpec:
        spec = tokamax_client.attention_xla("xla")
        return dataclasses.replace(spec, kernel=lambda case, cfg, backend: spec.kernel(case, cfg, backend) * 1.01)

    result = tokamax_autotune.check_workload(
        _workload(off_by_one_percent), Backend("interpret"), (), progress=lambda line: None
    )
    rows = _configs(result)
    assert rows and all(
        row["verdict"] == "rejected" and row["reason"].startswith("numerics: [values]") for row in rows
    ), rows
    timed = [op for op in result["ops"] if op["tokamax_pick"] is not None]
    assert timed and all(op["pick_rejected"] for op in timed)


def test_resumed_run_keeps_earlier_verdicts(tmp_path: Any) -> None:
    """A run resumed from the JSON of an earlier one takes the verdicts it holds and
    gates nothing again (its spec is never built)."""
    first = tokamax_autotune.check_workload(
        _workload(lambda ba, config: tokamax_client.attention_xla("xla")),
        Backend("interpret"),
        (),
        progress=lambda line: None,
    )
    path = tmp_path / "autotune.json"
    path.write_text(json.dumps({"results": [first]}, default=str))

    def must_not_gate(bound_args: Any, config: Any) -> KernelSpec:
        raise AssertionError("a config of the earlier run was gated again")

    resumed = tokamax_autotune.check_workload(
        _workload(must_not_gate),
        Backend("interpret"),
        (),
        progress=lambda line: None,
        gated_before=tokamax_autotune.earlier_verdicts(str(path), first["workload"]),
    )
    rows = _configs(resumed)
    assert rows and all(row["from_earlier_run"] for row in rows)
    assert [(r["verdict"], r["budget"]) for r in rows] == [(r["verdict"], r["budget"]) for r in _configs(first)]
