"""Fused RMSNorm + matmul as a Pallas kernel: y = (rmsnorm(x) * g) @ w.

The grid runs over blocks of rows and of output columns; the kernel loops over K in
tiles of ``BLOCK_K`` twice: once for the row's sum of squares, once for the matmul,
normalising each x tile in f32 and casting it to x's dtype before it meets w (what a
tensor-core kernel must do), with an f32 accumulator. Both K loops sum tile by tile:
blocked order, block ``BLOCK_K``. ``bug=True`` plants the fused-norm bug: the
statistics of each K tile alone (the row's mean square taken per tile).

The dot asks for ``HIGHEST`` precision: for f32 inputs it states f32 arithmetic, and
at the default a GPU feeds f32 operands to tensor cores as tf32 (bf16 operands are
unaffected).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BLOCK_M, BLOCK_N, BLOCK_K = 8, 16, 16
EPS = 1e-6


def rmsnorm_matmul_reference(x: jax.Array, g: jax.Array, w: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS) * g.astype(jnp.float32)
    return jnp.dot(normed.astype(x.dtype), w, preferred_element_type=jnp.float32).astype(x.dtype)


def _kernel(x_ref, g_ref, w_ref, o_ref, *, bug: bool):
    k = x_ref.shape[1]
    tiles = k // BLOCK_K

    def tile(ref, t):
        return ref[:, pl.ds(t * BLOCK_K, BLOCK_K)].astype(jnp.float32)

    def squares(t, total):
        x = tile(x_ref, t)
        return total + jnp.sum(x * x, axis=1, keepdims=True)

    total = lax.fori_loop(0, tiles, squares, jnp.zeros((x_ref.shape[0], 1), jnp.float32))
    rstd = lax.rsqrt(total / k + EPS)

    def matmul(t, acc):
        x = tile(x_ref, t)
        scale = lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + EPS) if bug else rstd
        normed = (x * scale * g_ref[:, pl.ds(t * BLOCK_K, BLOCK_K)].astype(jnp.float32)).astype(x_ref.dtype)
        w = w_ref[pl.ds(t * BLOCK_K, BLOCK_K), :]
        return acc + jnp.dot(normed, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, tiles, matmul, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "bug"))
def rmsnorm_matmul(
    x: jax.Array, g: jax.Array, w: jax.Array, *, interpret: bool = False, bug: bool = False
) -> jax.Array:
    (m, k), n = x.shape, w.shape[1]
    if g.shape != (k,) or w.shape[0] != k or m % BLOCK_M or n % BLOCK_N or k % BLOCK_K:
        raise ValueError(
            f"x [M, K], g [K], w [K, N] with M, N, K multiples of {BLOCK_M, BLOCK_N, BLOCK_K}; "
            f"got {x.shape} {g.shape} {w.shape}"
        )
    return pl.pallas_call(
        functools.partial(_kernel, bug=bug),
        grid=(m // BLOCK_M, n // BLOCK_N),
        in_specs=[
            pl.BlockSpec((BLOCK_M, k), lambda i, j: (i, 0)),
            pl.BlockSpec((1, k), lambda i, j: (0, 0)),
            pl.BlockSpec((k, BLOCK_N), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        interpret=interpret,
    )(x, g.reshape(1, k), w)


# ---- check (the whole of it) ----
from pallascheck.specs import Facts, Input, blocked, from_reference  # noqa: E402

WEIGHT_KINDS = ("normal", "large")  # rows of mean 1e4 in g or w overflow f16 whatever the kernel does


def spec(kernel=rmsnorm_matmul):
    g, w = Input((64,), reduction=64, kinds=WEIGHT_KINDS), Input((64, 32), reduction=64 * 8, kinds=WEIGHT_KINDS)
    inputs = {"x": (16, 64), "g": g, "w": w}
    facts = Facts(compute_dtype="float32", order=blocked(BLOCK_K))
    return from_reference(kernel, rmsnorm_matmul_reference, name="example_rmsnorm_matmul", inputs=inputs, facts=facts)


SPEC = spec()  # the kernel as shipped (spec(functools.partial(rmsnorm_matmul, bug=True)): its planted bug)
