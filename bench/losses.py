"""``pallascheck bench --op losses``: cross-entropy kernels against what users write.

Rows (per dtype and size):
- ``cross_entropy``: forward and forward+backward time of the fused kernel (best
  config of its space) vs ``cross_entropy.xla_reference`` (f32 logsumexp in XLA);
- ``linear_softmax_cross_entropy``: forward+backward time and peak memory vs the
  naive ``x @ w`` (f32 logits materialised) then cross-entropy.
Peak memory is XLA's compiled memory analysis of the jitted forward+backward:
argument + output + temporary bytes (``peak_bytes``). Ratios above 1 favour the kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallascheck.bench.timing import best_config, median_seconds, peak_bytes
from pallascheck.kernels import cross_entropy as ce
from pallascheck.kernels import linear_cross_entropy as lce
from pallascheck.kernels.backends import Backend

CE_SHAPES = ((8192, 50257), (8192, 128256), (4096, 201088))  # tokens, vocab
LINEAR_SHAPES = ((8192, 4096, 128256), (4096, 2048, 50257))  # tokens, hidden, vocab
DTYPES = ("bfloat16", "float32")


def _fwd_bwd(loss: Callable[..., jax.Array], argnums: tuple[int, ...]) -> Callable[..., Any]:
    return lambda *args: jax.value_and_grad(loss, argnums)(*args)


def linear_memory(
    tokens: int, hidden: int, vocab: int, dtype: str, backend: Backend, config: lce.Config | None = None
) -> dict[str, float]:
    """Peak bytes of forward+backward: fused kernel vs naive x @ w then cross-entropy."""
    x = jax.ShapeDtypeStruct((tokens, hidden), dtype)
    w = jax.ShapeDtypeStruct((hidden, vocab), dtype)
    y = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    fused = peak_bytes(
        _fwd_bwd(lambda a, b, t: lce.linear_softmax_cross_entropy(a, b, t, config=config, backend=backend), (0, 1)),
        x,
        w,
        y,
    )
    naive = peak_bytes(_fwd_bwd(lce.xla_reference, (0, 1)), x, w, y)
    return {"kernel_peak_MiB": fused / 2**20, "naive_peak_MiB": naive / 2**20, "memory_ratio_vs_naive": naive / fused}


def bench_cross_entropy(backend: Backend, dtype: str) -> list[dict]:
    rows = []
    for tokens, vocab in CE_SHAPES:
        logits = jax.random.normal(jax.random.key(0), (tokens, vocab), dtype) * 4
        labels = jax.random.randint(jax.random.key(1), (tokens,), 0, vocab)
        ref = jax.jit(ce.xla_reference)
        ref_fb = jax.jit(_fwd_bwd(ce.xla_reference, (0,)))
        t_ref, t_ref_fb = median_seconds(lambda: ref(logits, labels)), median_seconds(lambda: ref_fb(logits, labels))
        t_best, cfg = best_config(
            lambda c: lambda: ce.cross_entropy(logits, labels, config=c, backend=backend),
            ce.configs(tokens, vocab, backend),
        )
        k_fb = jax.jit(_fwd_bwd(lambda z, y: ce.cross_entropy(z, y, config=cfg, backend=backend), (0,)))
        t_fb = median_seconds(lambda: k_fb(logits, labels))
        k_mem = peak_bytes(k_fb, logits, labels)
        r_mem = peak_bytes(ref_fb, logits, labels)
        rows.append(
            {
                "op": "cross_entropy",
                "shape": f"{tokens}x{vocab}",
                "dtype": dtype,
                "xla_ms": t_ref * 1e3,
                "kernel_best_ms": t_best * 1e3,
                "best_config": str(cfg),
                "speed_vs_xla": t_ref / t_best,
                "xla_fwd_bwd_ms": t_ref_fb * 1e3,
                "kernel_fwd_bwd_ms": t_fb * 1e3,
                "fwd_bwd_speed_vs_xla": t_ref_fb / t_fb,
                "kernel_peak_MiB": k_mem / 2**20,
                "xla_peak_MiB": r_mem / 2**20,
                "memory_ratio_vs_xla": r_mem / k_mem,
            }
        )
    return rows


def bench_linear_cross_entropy(backend: Backend, dtype: str) -> list[dict]:
    rows = []
    for tokens, hidden, vocab in LINEAR_SHAPES:
        kx, kw, ky = jax.random.split(jax.random.key(2), 3)
        x = jax.random.normal(kx, (tokens, hidden), dtype)
        w = jax.random.normal(kw, (hidden, vocab), dtype) / hidden**0.5
        labels = jax.random.randint(ky, (tokens,), 0, vocab)
        naive_fb = jax.jit(_fwd_bwd(lce.xla_reference, (0, 1)))
        t_naive = median_seconds(lambda: naive_fb(x, w, labels), repeats=5)
        t_fwd, cfg = best_config(
            lambda c: lambda: lce.linear_softmax_cross_entropy(x, w, labels, config=c, backend=backend),
            lce.configs(tokens, hidden, vocab, backend),
        )
        k_fb = jax.jit(
            _fwd_bwd(lambda a, b, y: lce.linear_softmax_cross_entropy(a, b, y, config=cfg, backend=backend), (0, 1))
        )
        t_fb = median_seconds(lambda: k_fb(x, w, labels), repeats=5)
        rows.append(
            {
                "op": "linear_softmax_cross_entropy",
                "shape": f"{tokens}x{hidden}x{vocab}",
                "dtype": dtype,
                "kernel_fwd_ms": t_fwd * 1e3,
                "best_config": str(cfg),
                "naive_fwd_bwd_ms": t_naive * 1e3,
                "kernel_fwd_bwd_ms": t_fb * 1e3,
                "fwd_bwd_speed_vs_naive": t_naive / t_fb,
                **linear_memory(tokens, hidden, vocab, dtype, backend, cfg),
            }
        )
    return rows


def bench(backend: Backend) -> list[dict]:
    return [
        row
        for dtype in DTYPES
        for fn in (bench_cross_entropy, bench_linear_cross_entropy)
        for row in fn(backend, dtype)
    ]
