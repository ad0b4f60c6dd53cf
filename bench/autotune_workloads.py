"""What ``pallascheck autotune --workload NAME`` tunes: one function per kernel
family calling the shipped kernel, with its inputs at two sizes ("small" runs in
the CPU interpreters in seconds; "bench" is a GPU size whose float64 oracles and
bounds, computed for every candidate on seven inputs, take seconds, not minutes, on
a 16-core host)."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from pallascheck.kernels import attention, cross_entropy, matmul, norms, ragged_dot

SIZES = ("small", "bench")


def _normal(i: int, shape: tuple[int, ...], dtype: str) -> jax.Array:
    return jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(dtype)


def _matmul(size: str, dtype: str) -> tuple[Callable[..., Any], tuple]:
    m, k, n = (48, 40, 48) if size == "small" else (1024, 1024, 1024)
    return (lambda x, y: matmul.matmul(x, y)), (_normal(0, (m, k), dtype), _normal(1, (k, n), dtype))


def _norm(kind: str) -> Callable[[str, str], tuple[Callable[..., Any], tuple]]:
    def make(size: str, dtype: str) -> tuple[Callable[..., Any], tuple]:
        rows, d = (33, 100) if size == "small" else (4096, 1024)
        fn = getattr(norms, kind)
        return (lambda x, s: fn(x, s)), (_normal(0, (rows, d), dtype), _normal(1, (d,), dtype))
    return make


def _attention(size: str, dtype: str) -> tuple[Callable[..., Any], tuple]:
    b, s, h, d = (1, 48, 2, 32) if size == "small" else (1, 512, 4, 64)
    return (lambda q, k, v: attention.attention(q, k, v, causal=True)), tuple(
        _normal(i, (b, s, h, d), dtype) for i in range(3))


def _cross_entropy(size: str, dtype: str) -> tuple[Callable[..., Any], tuple]:
    t, v = (33, 300) if size == "small" else (1024, 8192)
    labels = jax.random.randint(jax.random.key(2), (t,), 0, v, jnp.int32)
    return (lambda z, y: cross_entropy.cross_entropy(z, y)), (_normal(0, (t, v), dtype), labels)


def _ragged_dot(size: str, dtype: str) -> tuple[Callable[..., Any], tuple]:
    m, k, n, g = (48, 40, 32, 3) if size == "small" else (2048, 512, 512, 8)
    sizes = jnp.full((g,), m // g, jnp.int32)
    return (lambda a, b, s: ragged_dot.ragged_dot(a, b, s)), (_normal(0, (m, k), dtype), _normal(1, (g, k, n), dtype), sizes)


WORKLOADS: dict[str, Callable[[str, str], tuple[Callable[..., Any], tuple]]] = {
    "matmul": _matmul,
    "layer_norm": _norm("layer_norm"),
    "rms_norm": _norm("rms_norm"),
    "attention": _attention,
    "cross_entropy": _cross_entropy,
    "ragged_dot": _ragged_dot,
}
