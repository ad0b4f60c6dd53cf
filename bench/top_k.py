"""``pallascheck bench --op top_k``: the exact blockwise top-k against ``jax.lax.top_k``
(exact) and ``jax.lax.approx_max_k`` (approximate, recall 0.95 by default: not the
same contract, listed as the speed an approximate answer buys).

Shapes follow the notebook: tokens 32 and 2048, vocab 201088, k 64, bf16 logits, for
two inputs: N(0, 1) logits (the superset kernel stops at its first stage) and the
worst case (every 128th logit 1, the rest 0: every stage runs). Times are medians
(bench/timing.median_seconds); the kernel is timed with its default config and with
the fastest of its config space, and every kernel result is checked bit for bit
against ``lax.top_k`` (values) before it is timed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.bench.timing import best_config, median_seconds
from pallascheck.kernels import top_k
from pallascheck.kernels.backends import Backend

TOKENS = (32, 2048)
VOCAB = 201088
K = 64


def _inputs(tokens: int, dtype: str) -> dict[str, jax.Array]:
    normal = jax.random.normal(jax.random.key(0), (tokens, VOCAB), jnp.float32).astype(dtype)
    worst = jnp.zeros((tokens, VOCAB), dtype).at[:, ::128].set(1)
    return {"normal": normal, "worst_case": worst}


def bench_top_k(backend: Backend, dtype: str = "bfloat16") -> list[dict]:

    rows = []
    exact = jax.jit(jax.lax.top_k, static_argnames=("k",))
    approx = jax.jit(jax.lax.approx_max_k, static_argnames=("k",))
    for tokens in TOKENS:
        for name, x in _inputs(tokens, dtype).items():
            ref_values, ref_indices = exact(x, k=K)
            values, indices = top_k.top_k(x, K, backend=backend)
            same = bool(np.array_equal(np.asarray(values).view(np.uint16), np.asarray(ref_values).view(np.uint16)))
            # ties: lowest index first in both (measured on CPU and H200); checked, not assumed
            same_indices = bool(np.array_equal(np.asarray(indices), np.asarray(ref_indices)))
            t_exact = median_seconds(lambda: exact(x, k=K))
            t_approx = median_seconds(lambda: approx(x, k=K))
            t_default = median_seconds(lambda: top_k.top_k(x, K, backend=backend))
            make = lambda c: functools.partial(top_k.top_k, x, K, config=c, backend=backend)  # noqa: E731
            t_best, cfg = best_config(make, top_k.configs(tokens, VOCAB, K, backend))
            rows.append(
                {
                    "op": "top_k",
                    "shape": f"{tokens}x{VOCAB} k={K} {name}",
                    "dtype": dtype,
                    "values_match_lax_top_k": same,
                    "indices_match_lax_top_k": same_indices,
                    "lax_top_k_ms": t_exact * 1e3,
                    "approx_max_k_ms": t_approx * 1e3,
                    "kernel_default_ms": t_default * 1e3,
                    "kernel_best_ms": t_best * 1e3,
                    "best_config": str(cfg),
                    "speed_vs_lax_top_k": t_exact / t_best,
                    "speed_vs_approx_max_k": t_approx / t_best,
                }
            )
    return rows
