"""The collectives on real GPUs, over a 1-D mesh of every visible GPU.

``python -m pallascheck.bench.collectives`` checks the ``xla_reference`` collectives
(lax collectives, NCCL on GPUs) against the float64 oracle under the GPU arithmetic
model, then times them; with ``--ring`` (two or more Hopper GPUs) it times the Mosaic
GPU ring kernels (kernels/mosaic_gpu_collectives.py) against the same operation in
XLA (NCCL) and against JAX's bundled ``collective_matmul_mgpu``, interleaved, each
with its spread (:func:`ring_rows`). Limit the GPUs with CUDA_VISIBLE_DEVICES; NVLink
multicast stays off (NCCL_NVLS_ENABLE=0 is set here before JAX starts).
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallascheck.bench.timing import interleaved_samples, median_seconds, print_row
from pallascheck.kernels import collectives
from pallascheck.kernels import mosaic_gpu_collectives as mgc
from pallascheck.kernels.backends import Backend
from pallascheck.oracles import collectives as oracle
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import strategies
from pallascheck.properties.device.multidevice import NO_MULTICAST_ENV
from pallascheck.properties.families import collectives as family

SHAPES = ((1024, 1024, 1024), (4096, 4096, 4096))  # m, k, n
CHECK_SHAPE = (256, 512, 256)


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()), ("x",))


def check(dtype: str = "bfloat16") -> list[str]:
    """Values of the three xla_reference collectives on the visible devices; returns
    the failures (empty when all pass)."""
    mesh, arith, failures = _mesh(), arithmetic_for(Backend("triton")), []
    p = mesh.shape["x"]
    m, k, n = CHECK_SHAPE
    x = strategies.elements(0, (m, k), dtype, "normal", reduction=k)
    w = strategies.elements(1, (k, n), dtype, "normal", reduction=k)
    gathered = np.asarray(
        collectives.xla_reference_all_gather(collectives.sharded(x, mesh, P("x")), mesh=mesh, axis="x")
    )
    if not np.array_equal(gathered.view(np.uint8), x.view(np.uint8)):
        failures.append("all_gather is not bit-exact")
    ref = oracle.all_gather_matmul_oracle(x, w)
    out = collectives.xla_reference_all_gather_matmul(
        collectives.sharded(x, mesh, P("x", None)), collectives.sharded(w, mesh, P(None, "x")), mesh=mesh, axis="x"
    )
    bound = oracle.all_gather_matmul_bound(ref, operand_dtype=x.dtype, out_dtype=x.dtype, arith=arith)
    if np.any(np.abs(np.asarray(out, np.float64) - ref.out) > bound):
        failures.append("all_gather_matmul outside its bound")
    parts = oracle.partials_oracle(x, w, p)
    out = collectives.xla_reference_matmul_reduce_scatter(
        collectives.sharded(x, mesh, P(None, "x")), collectives.sharded(w, mesh, P("x", None)), mesh=mesh, axis="x"
    )
    bound = oracle.matmul_reduce_scatter_bound(
        parts, operand_dtype=x.dtype, out_dtype=x.dtype, partial_dtype=x.dtype, arith=arith
    )
    if np.any(np.abs(np.asarray(out, np.float64) - parts.out) > bound):
        failures.append("matmul_reduce_scatter outside its bound")
    return failures


def bench_collectives(backend: Backend) -> list[dict]:
    """Sharded collective matmuls against one unsharded dot of the same product."""
    del backend  # the xla_reference path is the same on every backend
    mesh, rows = _mesh(), []
    p = mesh.shape["x"]
    for dtype in ("bfloat16", "float32"):
        for m, k, n in SHAPES:
            x = jax.random.normal(jax.random.key(0), (m, k), dtype)
            w = jax.random.normal(jax.random.key(1), (k, n), dtype)
            dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
            t_dot = median_seconds(lambda: dot(x, w))
            ag = (collectives.sharded(x, mesh, P("x", None)), collectives.sharded(w, mesh, P(None, "x")))
            rs = (collectives.sharded(x, mesh, P(None, "x")), collectives.sharded(w, mesh, P("x", None)))
            # jitted once here: the functions build their shard_map per call, which would time tracing
            ag_fn = jax.jit(functools.partial(collectives.xla_reference_all_gather_matmul, mesh=mesh, axis="x"))
            rs_fn = jax.jit(functools.partial(collectives.xla_reference_matmul_reduce_scatter, mesh=mesh, axis="x"))
            t_ag = median_seconds(lambda: ag_fn(*ag))
            t_rs = median_seconds(lambda: rs_fn(*rs))
            rows.append(
                {
                    "op": "collectives",
                    "shape": f"{m}x{k}x{n}/{p}dev",
                    "dtype": dtype,
                    "dot_ms": t_dot * 1e3,
                    "all_gather_matmul_ms": t_ag * 1e3,
                    "matmul_reduce_scatter_ms": t_rs * 1e3,
                    "all_gather_matmul_speed_vs_dot": t_dot / t_ag,
                    "matmul_reduce_scatter_speed_vs_dot": t_dot / t_rs,
                }
            )
    return rows


def _spread(samples: list[float]) -> tuple[float, float]:
    """Median seconds and the interquartile range as a fraction of it."""
    q = statistics.quantiles(samples, n=4)
    return statistics.median(samples), (q[2] - q[0]) / statistics.median(samples)


def _timed(thunks: dict[str, Callable[[], Any]], repeats: int, burst: int) -> dict[str, Any]:
    """Each thunk's median microseconds and spread, timed together
    (``interleaved_samples``); a thunk that fails is recorded with its error."""
    samples, errors = interleaved_samples(thunks, repeats, burst)
    row: dict[str, Any] = {f"{name}_error": err for name, err in errors.items()}
    for name, times in samples.items():
        median, iqr = _spread(times)
        row[f"{name}_us"], row[f"{name}_iqr"] = round(median * 1e6, 1), round(iqr, 3)
    return row


GATHER_MIB = (16, 64, 256)  # gathered bytes
RING_SIZES = (4096, 8192)  # per-GPU matmul work size^3


def ring_rows(repeats: int = 10) -> list[dict]:
    """The Mosaic GPU ring kernels against XLA (NCCL) and JAX's collective matmul,
    on every visible GPU, bf16. all_gather: algorithm bandwidth (gathered bytes / time)
    and NCCL's bus bandwidth ((p-1)/p of it). The matmuls: each GPU computes a
    size^3 product (all_gather_matmul: x (size, size) gathered from p row blocks,
    w's size columns on each GPU; matmul_reduce_scatter: each GPU's K block is size)."""
    mesh, rows, bf16 = _mesh(), [], jnp.bfloat16
    p, gpu = mesh.shape["x"], Backend("mosaic_gpu")
    for mib in GATHER_MIB:
        per_device = mib * 2**20 // (2 * 8192 * p)
        x = collectives.sharded(jnp.ones((p * per_device, 8192), bf16), mesh, P("x"))
        ours = jax.jit(functools.partial(collectives.all_gather, mesh=mesh, axis="x", backend=gpu))
        nccl = jax.jit(functools.partial(collectives.xla_reference_all_gather, mesh=mesh, axis="x"))
        row = {"op": "all_gather", "gpus": p, "gathered_MiB": mib} | _timed(
            {"ring": lambda: ours(x), "nccl": lambda: nccl(x)}, repeats, 4
        )
        for name in ("ring", "nccl"):
            if f"{name}_us" in row:
                row[f"{name}_busbw_GBps"] = round(mib * 2**20 / (row[f"{name}_us"] * 1e-6) * (p - 1) / p / 1e9, 1)
        rows.append(row)
    for size in RING_SIZES:
        x = collectives.sharded(jax.random.normal(jax.random.key(0), (size, size), bf16), mesh, P("x", None))
        w = collectives.sharded(jax.random.normal(jax.random.key(1), (size, p * size), bf16), mesh, P(None, "x"))
        one = mgc.Config(consumers=1)
        ours = jax.jit(functools.partial(collectives.all_gather_matmul, mesh=mesh, axis="x", config=one, backend=gpu))
        ws = jax.jit(functools.partial(collectives.all_gather_matmul, mesh=mesh, axis="x", backend=gpu))
        xla = jax.jit(functools.partial(collectives.xla_reference_all_gather_matmul, mesh=mesh, axis="x"))
        bundled = family.bundled_collective_matmul(mesh, family.bundled_tuning_space()[0], bf16)
        row = {"op": "all_gather_matmul", "gpus": p, "per_gpu": f"{size}^3"}
        thunks = {"ring": lambda: ours(x, w), "ring_ws": lambda: ws(x, w), "xla": lambda: xla(x, w)}
        row |= _timed(thunks | {"jax_bundled": lambda: bundled(x, w)}, repeats, 2)
        for name, thunk in thunks.items():  # the rings against XLA's result, elementwise
            diff = jnp.abs(thunk().astype(jnp.float32) - xla(x, w).astype(jnp.float32))
            row[f"{name}_minus_xla_max_abs"] = float(jnp.max(diff))
        rows.append(row)
        xk = collectives.sharded(jax.random.normal(jax.random.key(2), (size, p * size), bf16), mesh, P(None, "x"))
        wk = collectives.sharded(jax.random.normal(jax.random.key(3), (p * size, size), bf16), mesh, P("x", None))
        ours_rs = jax.jit(functools.partial(collectives.matmul_reduce_scatter, mesh=mesh, axis="x", backend=gpu))
        xla_rs = jax.jit(functools.partial(collectives.xla_reference_matmul_reduce_scatter, mesh=mesh, axis="x"))
        row = {"op": "matmul_reduce_scatter", "gpus": p, "per_gpu": f"{size}^3"}
        row |= _timed({"ring": lambda: ours_rs(xk, wk), "xla": lambda: xla_rs(xk, wk)}, repeats, 2)
        rows.append(row)
    return rows


if __name__ == "__main__":
    os.environ.update(NO_MULTICAST_ENV)
    print(f"devices: {jax.devices()}")
    if "--ring" in sys.argv:
        for row in ring_rows():
            print_row(row)
        sys.exit(0)
    problems = [f"{dtype}: {f}" for dtype in ("bfloat16", "float32") for f in check(dtype)]
    print("\n".join(problems) or "xla_reference collectives: all within their bounds (all_gather bit-exact)")
    for row in bench_collectives(Backend("triton")):
        print_row(row)
    sys.exit(1 if problems else 0)
