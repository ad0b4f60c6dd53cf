"""Vocabulary-parallel cross-entropy equals the unsharded one, on N CPU devices.

``sharded_matches_unsharded`` runs inside a child process that sees N CPU devices
(properties/multidevice.run_with_cpu_devices). Each example draws a mesh layout over
all devices (properties/device/sharding.py: 1-D, or 2-D such as 2x2, 2x4, 4x2, with drawn
axis names), shards the last axis of the logits over one of its axes (the logits are
replicated over the other) and checks, inside ``shard_map``:
- the sharded loss and its gradient (differentiated inside the shard_map body) are
  within the sharded bound of the float64 oracle (the bound replays the per-shard
  tiles, the cross-shard rescale and the psum: oracles/cross_entropy.py, ``shards``);
- sharded and unsharded kernels agree within the sum of their two bounds.
Many examples run in one child to amortise its start-up. The result is JSON: the
worst budget used per check and the first failure message, if any.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pallascheck.kernels import compat
from pallascheck.kernels import cross_entropy as ce
from pallascheck.kernels.backends import Backend, get_backend
from pallascheck.oracles import cross_entropy as oracle
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import checks
from pallascheck.properties.device import sharding
from pallascheck.properties.device.multidevice import resolve, run_with_cpu_devices
from pallascheck.properties.families.cross_entropy import IGNORE_INDEX, logits_of
from pallascheck.properties.spec import Case, Relation

KINDS = ("normal", "large", "offset", "one_finite", "few_distinct")
LOCAL_VOCABS = (50, 128)  # per device; 50 leaves a partial tile on every shard
TOKENS = (5, 16)


def sharded_matches_unsharded(
    examples: int,
    seed: int = 0,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    kernel: str = "pallascheck.kernels.cross_entropy:cross_entropy",
    backend: str = "interpret",
) -> dict[str, Any]:
    """Draw ``examples`` cases per dtype and compare the sharded ``kernel`` ("module:name")
    with the oracle and with the unsharded kernel; returns {"devices", "examples", "budget": {...}, "failure"}."""
    fn = resolve(kernel)
    devices = jax.devices()
    shapes = sharding.mesh_shape_choices((len(devices),))
    arith = arithmetic_for(get_backend(backend))
    config = ce.Config(block_t=8, block_v=64)
    rng = np.random.default_rng(seed)
    budget = {"values": 0.0, "gradients": 0.0, "sharded_vs_unsharded": 0.0}
    meshes: set[str] = set()
    compiled: dict[Any, Any] = {}
    for index in range(examples * len(dtypes)):
        dtype = dtypes[index % len(dtypes)]
        shape = shapes[int(rng.integers(len(shapes)))]
        layout = sharding.MeshLayout(shape, tuple(str(n) for n in rng.permutation(sharding.AXIS_NAMES)[: len(shape)]))
        axis = layout.names[int(rng.integers(len(shape)))]
        shards = layout.sizes[axis]
        meshes.add(f"{layout.describe()} vocab on {axis}")
        tokens, local = int(rng.choice(TOKENS)), int(rng.choice(LOCAL_VOCABS))
        vocab = local * shards
        kind = str(rng.choice(KINDS))
        logits, forced = logits_of(int(rng.integers(2**31)), tokens, vocab, dtype, kind)
        labels = forced if forced is not None else rng.integers(0, vocab, tokens)
        labels = np.where(rng.random(tokens) < 0.25, IGNORE_INDEX, labels).astype(np.int32)
        eps = 0.0 if kind == "one_finite" else float(rng.choice([0.0, 0.1, 1.0]))
        reduction = str(rng.choice(ce.REDUCTIONS))
        cotangent = rng.standard_normal(tokens if reduction == "none" else ()).astype(np.float32)
        kw = dict(label_smoothing=eps, ignore_index=IGNORE_INDEX, reduction=reduction, config=config, backend=backend)

        key = (layout, axis, tokens, local, eps, reduction, dtype)
        if key not in compiled:

            def body(z, y, g, kw=kw, axis=axis):
                loss, pullback = jax.vjp(lambda a: fn(a, y, axis_name=axis, **kw), z)
                return loss, pullback(g)[0]

            compiled[key] = jax.jit(
                compat.shard_map_unchecked(
                    body,
                    mesh=sharding.make_mesh(layout),
                    in_specs=(P(None, axis), P(), P()),
                    out_specs=(P(), P(None, axis)),
                )
            )
        loss, dlogits = compiled[key](jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(cotangent))
        plain, pullback = jax.vjp(lambda a: fn(a, jnp.asarray(labels), **kw), jnp.asarray(logits))
        (plain_grad,) = pullback(jnp.asarray(cotangent))

        ref = oracle.oracle(logits, labels, eps=eps, ignore_index=IGNORE_INDEX, reduction=reduction)
        bound = oracle.loss_bound(ref, arith=arith, block_v=config.block_v, shards=shards)
        plain_bound = oracle.loss_bound(ref, arith=arith, block_v=config.block_v)
        exact = oracle.oracle_vjp(ref, cotangent)["dlogits"]
        grad_bound = oracle.gradient_bound(
            ref, cotangent, logits_dtype=logits.dtype, arith=arith, block_v=config.block_v, shards=shards
        )["dlogits"]
        plain_grad_bound = oracle.gradient_bound(
            ref, cotangent, logits_dtype=logits.dtype, arith=arith, block_v=config.block_v
        )["dlogits"]
        outcomes = {
            "values": checks.compare(np.asarray(loss), ref.out, bound, name="loss"),
            "gradients": checks.compare(np.asarray(dlogits), exact, grad_bound, name="dlogits", check="gradients"),
            "sharded_vs_unsharded": checks.compare(
                np.asarray(loss), np.asarray(plain).astype(np.float64), bound + plain_bound, name="loss"
            ).merge(
                checks.compare(
                    np.asarray(dlogits),
                    np.asarray(plain_grad).astype(np.float64),
                    grad_bound + plain_grad_bound,
                    name="dlogits",
                )
            ),
        }
        for name, outcome in outcomes.items():
            budget[name] = max(budget[name], float(outcome.budget_used))
            if not outcome.passed:
                return {
                    "devices": len(devices),
                    "examples": index + 1,
                    "budget": budget,
                    "meshes": sorted(meshes),
                    "failure": (
                        f"[{name}] cross_entropy vocab-parallel on mesh {layout.describe()} over {axis!r} "
                        f"({shards} shards), dtype={dtype}, kind={kind}, "
                        f"T={tokens}, V={vocab}, eps={eps}, reduction={reduction}: {outcome.detail}"
                    ),
                }
    return {
        "devices": len(devices),
        "examples": examples * len(dtypes),
        "budget": budget,
        "meshes": sorted(meshes),
        "failure": "",
    }


def sharded_losses(logits: list[list[float]], labels: list[int]) -> dict[str, list]:
    """Per-token loss and dlogits (cotangent 1) of the vocabulary-parallel f32 kernel,
    the last axis of ``logits`` split over every device of a 1-D mesh."""
    axis = "vocab"
    mesh = sharding.make_mesh(sharding.MeshLayout((len(jax.devices()),), (axis,)))

    def body(z, y):
        loss, pullback = jax.vjp(lambda a: ce.cross_entropy(a, y, reduction="none", axis_name=axis), z)
        return loss, pullback(jnp.ones_like(loss))[0]

    run = jax.jit(
        compat.shard_map_unchecked(body, mesh=mesh, in_specs=(P(None, axis), P()), out_specs=(P(), P(None, axis)))
    )
    loss, dlogits = run(jnp.asarray(logits, jnp.float32), jnp.asarray(labels, jnp.int32))
    return {"loss": np.asarray(loss, np.float64).tolist(), "dlogits": np.asarray(dlogits, np.float64).tolist()}


def relation(kernel: str, import_path: str = "", devices: int = 2, examples: int = 2) -> Relation:
    """A metamorphic relation for specs: the sharded ``kernel`` ("module:name", importable
    with ``import_path`` on the module path) over ``devices`` CPU devices
    (interpret mode, whatever the backend under test) equals the unsharded one and the
    oracle. It runs one child process per case; the relation's "error" is the child's
    worst budget used, its bound 1."""

    def run(case: Case, config: Any, backend: Backend, out: np.ndarray):
        del config, backend, out  # the child uses its own config, in interpret mode on CPU devices
        result = run_with_cpu_devices(
            f"{__name__}:sharded_matches_unsharded",
            devices,
            {
                "examples": examples,
                "seed": int(case.arrays["labels"].size),
                "kernel": kernel,
                "dtypes": [case.arrays["logits"].dtype.name],
                "backend": "interpret",
            },
            import_path=import_path,
        )
        worst = max(result["budget"].values())
        return np.float64(worst if not result["failure"] else np.inf), np.float64(0.0), np.float64(1.0)

    return Relation("sharded_equals_unsharded", run)
