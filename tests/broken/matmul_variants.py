"""Deliberately broken matmuls. Each reuses the real tiling (matmul.tiled_call)
and changes one thing; the sensitivity test requires the checks to catch each."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels import block_io, matmul
from pallascheck.kernels.activations import get_activation
from pallascheck.kernels.backends import get_backend
from pallascheck.properties.families.matmul import make_spec
from pallascheck.properties.strategies import DTYPES


def _body(
    x_ref,
    y_ref,
    *out_refs,
    m_size,
    n_size,
    k_size,
    block_k,
    activation,
    masked_io,
    acc_dtype=jnp.float32,
    tiles=None,
    y_tile=None,
    mask=True,
    act_per_tile=False,
):
    """The real kernel body (kernels/matmul.py) with switches for each bug."""
    num_k_tiles = x_ref.shape[1] // block_k if tiles is None else tiles(k_size, block_k)
    block_m, block_n = x_ref.shape[0], y_ref.shape[1]
    rows = pl.program_id(0) * block_m + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    cols = pl.program_id(1) * block_n + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    row_ok, col_ok = rows < m_size, cols < n_size

    def k_step(i, acc):
        start = i * block_k
        y_start = start if y_tile is None else y_tile(i, num_k_tiles) * block_k
        kx = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        ky = y_start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        x_ok = row_ok & ((kx < k_size) | (not mask))
        y_ok = ((ky < k_size) | (not mask)) & col_ok
        x = block_io.load(x_ref.at[:, pl.ds(start, block_k)], x_ok, masked_io=masked_io)
        y = block_io.load(y_ref.at[pl.ds(y_start, block_k), :], y_ok, masked_io=masked_io)
        part = jnp.dot(x, y, preferred_element_type=acc_dtype)
        if act_per_tile:
            part = get_activation(activation)(part.astype(jnp.float32)).astype(acc_dtype)
        return (acc + part).astype(acc_dtype)

    acc = lax.fori_loop(0, num_k_tiles, k_step, jnp.zeros((block_m, block_n), acc_dtype))
    acc = acc.astype(jnp.float32)
    ok = row_ok & col_ok
    block_io.store(out_refs[0], acc if act_per_tile else get_activation(activation)(acc), ok, masked_io=masked_io)


def _variant(**switches: Any) -> Callable[..., jax.Array]:
    """A forward-only matmul with the public signature and the given bug."""

    def run(x, y, *, activation="none", out_dtype=None, config=None, backend=None):
        return matmul.tiled_call(
            x,
            y,
            out_dtype=x.dtype if out_dtype is None else jnp.dtype(out_dtype),
            activation=activation,
            save_preactivation=False,
            config=config or matmul.Config(),
            backend=get_backend(backend),
            body=functools.partial(_body, **switches),
        )

    return run


def _input_dtype_accumulator(x, y, **kw):
    """Accumulator in the input dtype (bf16/f16 partial sums)."""
    return _variant(acc_dtype=x.dtype)(x, y, **kw)


def _missing_activation_derivative(x, y, *, activation="none", out_dtype=None, config=None, backend=None):
    """Backward uses dz = g, forgetting act'(z)."""
    config, backend = config or matmul.Config(), get_backend(backend)
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)

    @jax.custom_vjp
    def f(x, y):
        return matmul.matmul(x, y, activation=activation, out_dtype=out_dtype, config=config, backend=backend)

    def fwd(x, y):
        return f(x, y), (x, y)

    def bwd(res, g):
        x, y = res
        dz = g.astype(x.dtype)
        return (
            matmul.matmul(dz, y.T, config=config, backend=backend),
            matmul.matmul(x.T, dz.astype(y.dtype), config=config, backend=backend),
        )

    f.defvjp(fwd, bwd)
    return f(x, y)


def unmasked_k_padding_at_largest_block(x, y, *, config=None, **kw):
    """Skips the K-edge mask only with block_k = 32, the largest K block of the
    interpreters' space: right where 32 divides K, garbage past the edge elsewhere (a
    bug only one tile size trips; the autotuning tests' broken config)."""
    config = config or matmul.Config()
    return _variant(mask=config.block_k < 32)(x, y, config=config, **kw)


# name -> (kernel, differentiable). Forward-only variants skip the gradient checks.
_BROKEN: dict[str, tuple[Callable[..., jax.Array], bool]] = {  # name -> (kernel, break is in the backward)
    "input_dtype_accumulator": (_input_dtype_accumulator, False),
    "dropped_last_k_tile": (_variant(tiles=lambda k, bk: k // bk), False),  # floor instead of cdiv
    "y_tile_lags_one_block": (_variant(y_tile=lambda i, n: jnp.maximum(i - 1, 0)), False),  # wrong block index
    "y_tile_wraps": (_variant(y_tile=lambda i, n: (i + 1) % n), False),  # wrong block index, all tiles visited
    "unmasked_k_padding": (_variant(mask=False), False),  # NaN/garbage past K leaks into the sum
    "activation_per_k_tile": (_variant(act_per_tile=True), False),  # act(sum) != sum(act)
    "missing_activation_derivative": (_missing_activation_derivative, True),
}
# An input-dtype accumulator is the real kernel when the input is f32.
_DTYPES = {"input_dtype_accumulator": ("bfloat16", "float16")}
# Enough examples for Hypothesis to reach the triggering shapes (ragged K, an activation).
EXAMPLES = 30

VARIANTS = {
    name: (make_spec(fn, name=f"matmul[{name}]", differentiable=grads), _DTYPES.get(name, DTYPES), EXAMPLES)
    for name, (fn, grads) in _BROKEN.items()
}
