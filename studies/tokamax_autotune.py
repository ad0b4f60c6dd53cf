"""Tokamax's autotuner, checked: ``python -m studies.tokamax_autotune`` (Hopper GPU).

For each workload below, ``tokamax.autotune`` times every config of each Tokamax op
the workload's forward and backward call (the forward op and its VJP op are tuned
apart). Then every config it timed goes through our numerics gate
(``bench.autotune.gate``: values and gradients against the float64 oracle under the
derived bound) with that config pinned, on the gate cases: the workload's own inputs
and the spec's adversarial inputs (attention: each logits kind; ragged dot: each
element kind). The report says, per op, how many configs Tokamax timed, which our
bounds reject and why, and whether the config Tokamax would pick (its fastest) is
one of them.

Shapes: Tokamax tunes at the bench shapes (attention b2 s4096 h16 d128 bf16, ragged
dot m8192 k2048 n2048 with 8 groups, bf16). The attention gate runs at the tuned
sequence length and head size with batch 1 and 2 heads: a config is a tiling of the
sequence (blocks, stages, persistence), which batch and heads do not enter, and the
float64 oracle of the full shape holds 4.3 GB per [b, h, s, s] array.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.bench.autotune import (
    gate,
    gate_cases,
    gate_workers,
    memoised,
    rejection_reason,
)
from pallascheck.kernels.backends import Backend
from pallascheck.properties import runner, strategies
from pallascheck.properties.outside import tokamax as tokamax_client
from pallascheck.properties.spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class Workload:
    """What Tokamax tunes (``tuned(*inputs)``, on the device) and how our gate sees it:
    ``spec_for(bound_args, config)`` the spec with that op's config pinned (None: a
    config our specs cannot pin, reported ungated); ``base`` the spec with Tokamax's
    heuristics; ``gate_arrays``/``gate_params`` the gate's own case."""

    name: str
    tuned: Callable[..., Any]
    inputs: Callable[[], Sequence[jax.Array]]
    spec_for: Callable[[Any, Any], KernelSpec | None]
    base: Callable[[], KernelSpec]
    gate_arrays: Callable[[], dict[str, np.ndarray]]
    gate_params: dict[str, Any]


def _normal(seed: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return strategies.elements(seed, shape, dtype, "normal")


def _attention() -> Workload:
    import tokamax

    shape = (2, 4096, 16, 128)  # the attention bench shape, [b, s, h, d]

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        out = tokamax.dot_product_attention(q, k, v, implementation="mosaic")
        return jnp.sum(out.astype(jnp.float32))

    def spec_for(bound_args: Any, config: Any) -> KernelSpec:
        if _op_kind(bound_args.op) == "vjp":
            return tokamax_client.attention_mosaic_gpu(vjp_config=config)
        return tokamax_client.attention_mosaic_gpu(config=config)

    gate_shape = (1, shape[1], 2, shape[3])
    return Workload(
        "dot_product_attention b2 s4096 h16 d128",
        jax.grad(loss, argnums=(0, 1, 2)),
        lambda: [jnp.asarray(_normal(i, shape, "bfloat16")) for i in range(3)],
        spec_for,
        tokamax_client.attention_mosaic_gpu,
        lambda: {n: _normal(10 + i, gate_shape, "bfloat16") for i, n in enumerate("qkv")},
        {"causal": False, "sm_scale": None},
    )


def _ragged_dot() -> Workload:
    import tokamax

    m, k, n, groups = 8192, 2048, 2048, 8
    sizes = np.full(groups, m // groups, np.int32)

    def loss(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        out = tokamax.ragged_dot(lhs, rhs, group_sizes, implementation="mosaic")
        return jnp.sum(out.astype(jnp.float32))

    def spec_for(bound_args: Any, config: Any) -> KernelSpec | None:
        # Its VJP is more ragged-dot ops, tuned as calls of their own: a config of one
        # with the forward's operand shapes (dlhs = dout @ rhs^T, as k = n here) is
        # gated pinned on the forward; the others (drhs: a ragged contraction) are not.
        lhs, rhs = bound_args.args[:2]
        if (tuple(lhs.shape), tuple(rhs.shape)) != ((m, k), (groups, k, n)):
            return None
        return tokamax_client.ragged_dot_mosaic_gpu_api(config=config)

    return Workload(
        f"ragged_dot m{m} k{k} n{n} {groups} groups",
        lambda lhs, rhs, group_sizes: jax.grad(loss, argnums=(0, 1))(lhs, rhs, group_sizes),
        lambda: [
            jnp.asarray(_normal(0, (m, k), "bfloat16")),
            jnp.asarray(_normal(1, (groups, k, n), "bfloat16")),
            jnp.asarray(sizes),
        ],
        spec_for,
        tokamax_client.ragged_dot_mosaic_gpu_api,
        lambda: {
            "lhs": _normal(0, (m, k), "bfloat16"),
            "rhs": _normal(1, (groups, k, n), "bfloat16"),
            "group_sizes": sizes,
        },
        {},
    )


WORKLOADS: dict[str, Callable[[], Workload]] = {"dot_product_attention": _attention, "ragged_dot": _ragged_dot}


def _op_kind(op: Any) -> str:
    return "vjp" if "Vjp" in type(op).__name__ else "forward"


def check_workload(
    workload: Workload,
    backend: Backend,
    kinds: Sequence[str],
    progress: Callable[[str], None] = print,
    save: Callable[[dict[str, Any]], None] = lambda partial: None,
    gated_before: Mapping[tuple[str, str], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Tune ``workload`` with ``tokamax.autotune``, then gate every config it timed;
    ``save`` gets the result so far after each config. ``gated_before``: (op, config
    JSON) -> a row of an earlier run on the same gate cases, whose verdict is kept
    (with this run's timing) instead of gating that config again."""
    gated_before = gated_before or {}
    import tokamax

    start = time.perf_counter()
    result = tokamax.autotune(workload.tuned, *workload.inputs(), ignore_cache=True, progress_bar=False)
    tune_seconds = time.perf_counter() - start
    progress(f"{workload.name}: tokamax.autotune took {tune_seconds:.1f} s")
    out: dict[str, Any] = {"workload": workload.name, "tune_seconds": tune_seconds, "ops": []}
    memo: dict[Any, Any] = {}  # oracles and bounds, shared by the specs of every pinned config
    cases = gate_cases(memoised(workload.base(), memo), workload.gate_params, workload.gate_arrays(), backend, kinds)
    out.update(gate_cases=len(cases), gate_shapes={k: list(v.shape) for k, v in cases[0].arrays.items()})

    def gated(bound_args: Any, config: Any, timing: Any) -> dict[str, Any]:
        row: dict[str, Any] = {"config": runner.config_to_json(config)}
        if isinstance(timing, Exception):
            row.update(tokamax_ms=None, tokamax_error=f"{type(timing).__name__}: {str(timing)[:300]}")
        else:
            row["tokamax_ms"] = timing.median_evaluation_time_ms
        earlier = gated_before.get((type(bound_args.op).__name__, _config_key(row["config"])))
        if earlier is not None:
            return {**earlier, **row, "from_earlier_run": True}
        pinned = workload.spec_for(bound_args, config)
        if pinned is None:
            row["verdict"] = "not gated"
            return row
        try:
            spec = memoised(pinned, memo)
            row["budget"] = gate(spec, cases, spec.default_config, backend)["budget"]
            row["verdict"] = "valid"
        except Exception as err:  # noqa: BLE001 - every failure of a config is a reason to reject it
            row["verdict"], row["reason"] = "rejected", rejection_reason(err)
        return row

    # the gates run several at a time (their float64 bounds, in numpy, are the cost)
    with concurrent.futures.ThreadPoolExecutor(max_workers=gate_workers()) as pool:
        for bound_args, data in result.data:
            rows: list[dict[str, Any]] = []
            op: dict[str, Any] = {
                "op": type(bound_args.op).__name__,
                "kind": _op_kind(bound_args.op),
                "shapes": [list(getattr(a, "shape", ())) for a in bound_args.args],
                "configs": rows,
                "tokamax_pick": None,
                "pick_rejected": False,
            }
            out["ops"].append(op)
            progress(f"{workload.name}: {op['op']} ({op['kind']}), {len(data)} configs timed")
            futures = [pool.submit(gated, bound_args, config, timing) for config, timing in data.items()]
            for future in futures:
                row = future.result()
                rows.append(row)
                progress(
                    f"  {row['config']}: {row.get('tokamax_ms')} ms, {row['verdict']} "
                    f"{row.get('budget', row.get('reason', ''))}"
                )
                timed = [r for r in rows if r["tokamax_ms"] is not None]
                pick = min(timed, key=lambda r: r["tokamax_ms"]) if timed else None
                op.update(tokamax_pick=pick, pick_rejected=bool(pick and pick["verdict"] == "rejected"))
                save(out)
    return out


def _config_key(config: Any) -> str:
    return json.dumps(config, sort_keys=True, default=str)


def earlier_verdicts(path: str, workload: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(op, config JSON) -> gated row of ``workload`` in the JSON file of an earlier run
    (a run stopped part-way keeps every row it gated); empty when there is no file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    return {
        (op["op"], _config_key(row["config"])): {k: v for k, v in row.items() if not k.startswith("tokamax_")}
        for result in data["results"]
        if result["workload"] == workload
        for op in result["ops"]
        for row in op["configs"]
        if "verdict" in row
    }


def run(
    backend: Backend,
    only: Sequence[str] | None = None,
    json_path: str | None = None,
    kinds: Sequence[str] = strategies.ELEMENT_KINDS,
    resume: bool = False,
) -> list[dict[str, Any]]:
    """Every workload (or ``only``); the JSON file is rewritten after each config is
    gated, so that a run stopped part-way keeps what it checked, and ``resume`` reads
    it first and does not gate again the configs it already holds. ``kinds=()``: the
    gate on the workload's own inputs only."""
    import tokamax

    if resume and not json_path:
        raise ValueError("resume needs json_path: the file of the run to resume")
    results: list[dict[str, Any]] = []
    header = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "tokamax": tokamax.__version__}

    def save(partial: dict[str, Any]) -> None:
        if json_path:
            with open(json_path, "w") as f:
                json.dump({**header, "results": [*results, partial]}, f, indent=1, default=str)

    for name, make in WORKLOADS.items():
        if not only or name in only:
            workload = make()
            before = earlier_verdicts(json_path, workload.name) if resume else {}
            results.append(check_workload(workload, backend, kinds, save=save, gated_before=before))
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m studies.tokamax_autotune [--backend mosaic_gpu] [--op dot_product_attention|ragged_dot]
    [--json PATH [--resume]]``"""
    import argparse

    from pallascheck.cli._common import available_backend

    parser = argparse.ArgumentParser(
        prog="python -m studies.tokamax_autotune",
        description="run tokamax.autotune on attention and ragged_dot (Hopper GPU) and "
        "check every config it timed with the numerics gate",
    )
    parser.add_argument("--backend", default="mosaic_gpu")
    parser.add_argument("--op", action="append", help="dot_product_attention or ragged_dot (repeatable)")
    parser.add_argument("--json", help="the results file")
    parser.add_argument("--resume", action="store_true", help="keep the verdicts already in --json's file")
    args = parser.parse_args(argv)
    results = run(available_backend(args.backend), args.op, args.json, resume=args.resume)
    return 1 if any(op.get("pick_rejected") for r in results for op in r["ops"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
