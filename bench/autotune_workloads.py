"""What ``pallascheck autotune --workload NAME`` tunes: one function per kernel
family calling the shipped kernel, with its inputs at three sizes ("small" runs in
the CPU interpreters in seconds; "bench" is a GPU size whose float64 oracles and
bounds, computed for every candidate on seven inputs, take seconds, not minutes, on
a 16-core host; "production" is one named layout of the production shape tier,
``PRODUCTION_LAYOUTS``, for the families that have one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallascheck.kernels import attention, cross_entropy, matmul, norms, ragged_dot
from pallascheck.properties.registry import get_spec

SIZES = ("small", "bench", "production")
# The production tier's layout each family's workload takes at --size production
# (each family's ``production_layouts``, properties/families/<op>.py): a layout of each that fits
# an H100 under the memory rule.
PRODUCTION_LAYOUTS = {
    "matmul": "llama-3 8B MLP up, 8k tokens",
    "attention": "MHA b2 4k",
    "ragged_dot": "1024 rows per group",
}


def production_fields(family: str) -> dict[str, Any]:
    """The domain fields of ``family``'s layout in ``PRODUCTION_LAYOUTS``."""
    (layout,) = [l for l in get_spec(family).production_layouts if l.name.startswith(PRODUCTION_LAYOUTS[family] + ":")]
    return layout.fields


def _refuse_production(family: str, size: str) -> None:
    if size == "production":
        raise ValueError(
            f"--size production: {family} has no production layout (properties/production.py has "
            f"{', '.join(PRODUCTION_LAYOUTS)}); use --size bench"
        )


def _normal(i: int, shape: tuple[int, ...], dtype: str) -> jax.Array:
    return jax.random.normal(jax.random.key(i), shape, jnp.float32).astype(dtype)


def _matmul(size: str, dtype: str) -> tuple[Callable[..., Any], tuple]:
    if size == "production":
        f = production_fields("matmul")
        m, k, n = f["m"][0], f["k"][0], f["n"][0]
    else:
        m, k, n = (48, 40, 48) if size == "small" else (1024, 1024, 1024)
    return (lambda x, y: matmul.matmul(x, y)), (_normal(0, (m, k), dtype), _normal(1, (k, n), dtype))


def _norm(kind: str) -> Callable[[str, str], tuple[Callable[..., Any], tuple]]:
    def make(size: str, dtype: str) -> tuple[Callable[..., Any], tuple]:
        _refuse_production(kind, size)
        rows, d = (33, 100) if size == "small" else (4096, 1024)
        fn = getattr(norms, kind)
        return (lambda x, s: fn(x, s)), (_normal(0, (rows, d), dtype), _normal(1, (d,), dtype))

    return make


def _attention(size: str, dtype: str) -> tuple[Callable[..., Any], tuple]:
    if size == "production":  # a multi-head layout: q, k and v share their head count
        f = production_fields("attention")
        (b, h, _), s, d = f["heads"][0], f["seq_q"][0], f["head_dims"][0]
    else:
        b, s, h, d = (1, 48, 2, 32) if size == "small" else (1, 512, 4, 64)
    return (lambda q, k, v: attention.attention(q, k, v, causal=True)), tuple(
        _normal(i, (b, s, h, d), dtype) for i in range(3)
    )


def _cross_entropy(size: str, dtype: str) -> tuple[Callable[..., Any], tuple]:
    _refuse_production("cross_entropy", size)
    t, v = (33, 300) if size == "small" else (1024, 8192)
    labels = jax.random.randint(jax.random.key(2), (t,), 0, v, jnp.int32)
    return (lambda z, y: cross_entropy.cross_entropy(z, y)), (_normal(0, (t, v), dtype), labels)


def _ragged_dot(size: str, dtype: str) -> tuple[Callable[..., Any], tuple]:
    if size == "production":
        f = production_fields("ragged_dot")
        m, k, n, g = f["m"][0], f["k"][0], f["n"][0], f["groups"][0]
    else:
        m, k, n, g = (48, 40, 32, 3) if size == "small" else (2048, 512, 512, 8)
    sizes = jnp.full((g,), m // g, jnp.int32)
    return (lambda a, b, s: ragged_dot.ragged_dot(a, b, s)), (
        _normal(0, (m, k), dtype),
        _normal(1, (g, k, n), dtype),
        sizes,
    )


WORKLOADS: dict[str, Callable[[str, str], tuple[Callable[..., Any], tuple]]] = {
    "matmul": _matmul,
    "layer_norm": _norm("layer_norm"),
    "rms_norm": _norm("rms_norm"),
    "attention": _attention,
    "cross_entropy": _cross_entropy,
    "ragged_dot": _ragged_dot,
}
