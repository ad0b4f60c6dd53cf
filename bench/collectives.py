"""The collectives on real GPUs: their ``xla_reference`` (lax collectives, NCCL on
GPUs) over a 1-D mesh of every visible device (1 or 2 GPUs), checked against the
float64 oracle under the GPU arithmetic model, then timed.

The Pallas remote-DMA kernels need TPU semantics and do not run on GPUs; this is
the GPU path of kernels/collectives.py. Run on a GPU machine:

    python -m pallascheck.bench.collectives              # check + time
    pallascheck bench --backend triton --op collectives   # time only (BENCHES)
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from pallascheck.bench.timing import median_seconds, print_row
from pallascheck.kernels import collectives
from pallascheck.kernels.backends import Backend
from pallascheck.oracles import collectives as oracle
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import strategies

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


if __name__ == "__main__":
    print(f"devices: {jax.devices()}")
    problems = [f"{dtype}: {f}" for dtype in ("bfloat16", "float32") for f in check(dtype)]
    print("\n".join(problems) or "xla_reference collectives: all within their bounds (all_gather bit-exact)")
    for row in bench_collectives(Backend("triton")):
        print_row(row)
    sys.exit(1 if problems else 0)
