"""``pallascheck bench --op moe``: ragged_dot and gated_linear_unit at mixture-of-experts
sizes, forward and forward+backward, against their XLA references in bf16.

ragged_dot runs against ``jax.lax.ragged_dot`` (f32 accumulation, bf16 output) with
uneven group sizes drawn from a Dirichlet(0.5) split of the rows (some groups get
few or no rows, as a real router produces); the GLU (SwiGLU) against two XLA dots
with the epilogue in f32. Each kernel's forward is timed over its whole config
space; forward+backward is timed with the fastest forward config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.bench.timing import best_config, median_seconds
from pallascheck.kernels import gated_linear_unit as glu
from pallascheck.kernels import ragged_dot as rd
from pallascheck.kernels.backends import Backend

RAGGED_SHAPES = ((8192, 2048, 2048, 8), (8192, 2048, 2048, 64), (8192, 2048, 4096, 64))  # m, k, n, groups
GLU_SHAPES = ((8192, 4096, 14336), (8192, 2048, 5632))  # tokens, d, f
DTYPE = "bfloat16"


def uneven_group_sizes(m: int, groups: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.multinomial(m, rng.dirichlet(np.full(groups, 0.5))).astype(np.int32)


def _fwd_bwd(fn: Callable[..., jax.Array], cotangent: jax.Array) -> Callable[..., Any]:
    return jax.jit(lambda *args: jax.vjp(fn, *args)[1](cotangent))


def bench_ragged_dot(backend: Backend) -> list[dict]:

    rows = []
    for m, k, n, groups in RAGGED_SHAPES:
        keys = jax.random.split(jax.random.key(0), 3)
        lhs = jax.random.normal(keys[0], (m, k), DTYPE)
        rhs = jax.random.normal(keys[1], (groups, k, n), DTYPE)
        g = jax.random.normal(keys[2], (m, n), DTYPE)
        sizes = jnp.asarray(uneven_group_sizes(m, groups))
        ref = jax.jit(rd.xla_reference)
        t_ref = median_seconds(lambda: ref(lhs, rhs, sizes))
        t_best, cfg = best_config(
            lambda c: lambda: rd.ragged_dot(lhs, rhs, sizes, config=c, backend=backend),
            rd.configs(m, n, k, backend, itemsize=lhs.dtype.itemsize, groups=groups),
        )
        ref_fb = _fwd_bwd(lambda a, b: rd.xla_reference(a, b, sizes), g)
        ker_fb = _fwd_bwd(lambda a, b: rd.ragged_dot(a, b, sizes, config=cfg, backend=backend), g)
        t_ref_fb, t_fb = median_seconds(lambda: ref_fb(lhs, rhs)), median_seconds(lambda: ker_fb(lhs, rhs))
        flops = 2.0 * m * k * n
        rows.append(
            {
                "op": "ragged_dot",
                "shape": f"m{m}_k{k}_n{n}_g{groups}",
                "dtype": DTYPE,
                "xla_ms": t_ref * 1e3,
                "kernel_best_ms": t_best * 1e3,
                "best_config": str(cfg),
                "kernel_tflops": flops / t_best / 1e12,
                "xla_tflops": flops / t_ref / 1e12,
                "speed_vs_xla": t_ref / t_best,
                "xla_fwd_bwd_ms": t_ref_fb * 1e3,
                "kernel_fwd_bwd_ms": t_fb * 1e3,
                "fwd_bwd_speed_vs_xla": t_ref_fb / t_fb,
            }
        )
    return rows


def bench_glu(backend: Backend, activation: str = "silu") -> list[dict]:

    rows = []
    for tokens, d, f in GLU_SHAPES:
        keys = jax.random.split(jax.random.key(1), 3)
        x = jax.random.normal(keys[0], (tokens, d), DTYPE)
        w = (jax.random.normal(keys[1], (d, 2, f), DTYPE) / np.sqrt(d)).astype(DTYPE)
        g = jax.random.normal(keys[2], (tokens, f), DTYPE)
        ref = jax.jit(lambda a, b: glu.xla_reference(a, b, activation=activation))
        t_ref = median_seconds(lambda: ref(x, w))
        t_best, cfg = best_config(
            lambda c: lambda: glu.gated_linear_unit(x, w, activation=activation, config=c, backend=backend),
            glu.configs(tokens, f, d, backend, itemsize=x.dtype.itemsize),
        )
        ref_fb = _fwd_bwd(lambda a, b: glu.xla_reference(a, b, activation=activation), g)
        ker_fb = _fwd_bwd(
            lambda a, b: glu.gated_linear_unit(a, b, activation=activation, config=cfg, backend=backend), g
        )
        t_ref_fb, t_fb = median_seconds(lambda: ref_fb(x, w)), median_seconds(lambda: ker_fb(x, w))
        flops = 2.0 * tokens * d * 2 * f
        rows.append(
            {
                "op": f"gated_linear_unit[{activation}]",
                "shape": f"t{tokens}_d{d}_f{f}",
                "dtype": DTYPE,
                "xla_ms": t_ref * 1e3,
                "kernel_best_ms": t_best * 1e3,
                "best_config": str(cfg),
                "kernel_tflops": flops / t_best / 1e12,
                "xla_tflops": flops / t_ref / 1e12,
                "speed_vs_xla": t_ref / t_best,
                "xla_fwd_bwd_ms": t_ref_fb * 1e3,
                "kernel_fwd_bwd_ms": t_fb * 1e3,
                "fwd_bwd_speed_vs_xla": t_ref_fb / t_fb,
            }
        )
    return rows


def run(backend: Backend) -> list[dict]:
    return bench_ragged_dot(backend) + bench_glu(backend)
