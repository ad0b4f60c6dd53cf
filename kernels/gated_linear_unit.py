"""Gated linear unit ``activation(x @ W[:, 0]) * (x @ W[:, 1])`` (SwiGLU, GeGLU, ...).

Semantics (Tokamax's ``gated_linear_unit``): x is [..., d], weights is [d, 2, f]
with the gate projection at ``weights[:, 0]`` and the up projection at
``weights[:, 1]``; the result is [..., f] in x's dtype. Activations: "silu" (alias
"swish"), "gelu" (exact, erf), "gelu_tanh", "relu", "sigmoid" and None/"none" (the
bilinear unit). Pallas' Triton lowering and jax 0.11.2's Mosaic GPU lowering have no
erf, so exact "gelu" is refused there (triton, mosaic_gpu, mosaic_gpu_interpret) with
a ValueError (use "gelu_tanh"), as in kernels/matmul.py.

Forward: one program per (block_m rows, block_n features) tile runs a single K loop
over d that loads one x tile and the matching gate and up tiles of the weights and
feeds two f32 accumulators (x is read once for both products). The epilogue
evaluates the activation in f32, multiplies by the up projection in f32 and rounds
once to the output dtype. With gradients it also stores both f32 accumulators.

Backward (custom_vjp), with dz = [dgate, dup] of shape [T, 2, f]:
    dgate = act'(gate) * (g * up),   dup = g * act(gate)    (f32, XLA elementwise)
rounded to x's dtype, then two Pallas matmuls (kernels/matmul.py) on the weights
viewed as [d, 2f] (a free reshape): dx = dz @ W^T (2f terms) and dW = x^T @ dz
(T terms). Rows and features past the edges are masked as in kernels/matmul.py.

On the ``mosaic_gpu`` and ``mosaic_gpu_interpret`` backends the forward runs the
Hopper kernel of kernels/mosaic_gpu_glu.py (one TMA pipeline feeding two wgmma
accumulators; bf16/f16 only) and the two backward products run
kernels/mosaic_gpu_matmul.py, with the same cotangents as above. Its tiles are a
``mosaic_gpu_glu.Config`` (passed as ``config=``, listed by ``configs(...,
backend=...)``); this module's ``Config`` stays the Pallas-generic kernel's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels import (
    block_io,
    matmul,
    mosaic_gpu_glu,
    mosaic_gpu_matmul,
    tiling,
    validation,
)
from pallascheck.kernels.activations import get_activation
from pallascheck.kernels.backends import Backend, get_backend, resolve_config

ALIASES = {None: "none", "swish": "silu"}


@dataclasses.dataclass(frozen=True)
class Config(matmul.Config):
    """Forward tiles: block_m rows x block_n features, block_k the step over d.
    The backward matmuls use the same tiles."""


def configs(
    tokens: int, f: int, d: int, backend: str | Backend | None = None, itemsize: int = 4
) -> list[Config] | list[mosaic_gpu_glu.Config]:
    """kernels/matmul.py's space for [tokens, d] @ [d, f], keeping on the GPU only
    tiles whose pipelined x, gate and up tiles fit in shared memory
    (``mosaic_gpu_glu.configs`` on the Mosaic GPU backends)."""
    be = get_backend(backend)
    if be.is_mosaic_gpu:
        return mosaic_gpu_glu.configs(tokens, f, d, itemsize, be)
    return [
        Config(**dataclasses.asdict(c))
        for c in cast(list[matmul.Config], matmul.configs(tokens, f, d, be, itemsize))  # not Mosaic GPU's
        if not be.is_triton
        or c.num_stages * (c.block_m + 2 * c.block_n) * c.block_k * itemsize <= tiling.GPU_SHARED_MEMORY_BYTES
    ]


def canonical_activation(activation: str | None) -> str:
    """The kernels/activations.py name of ``activation`` (None -> "none", swish -> silu)."""
    name = ALIASES.get(activation, activation)
    if name is None:  # ALIASES names None
        raise ValueError("activation None has no name")
    get_activation(name)
    return name


def _forward_kernel(
    x_ref,
    w_ref,
    *out_refs,
    m_size: int,
    n_size: int,
    k_size: int,
    block_k: int,
    activation: str,
    masked_io: bool,
):
    block_m, block_n = x_ref.shape[0], w_ref.shape[2]
    num_k_tiles = x_ref.shape[1] // block_k
    rows = pl.program_id(0) * block_m + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    cols = pl.program_id(1) * block_n + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    row_ok, col_ok = rows < m_size, cols < n_size

    def k_step(i, accs):
        gate_acc, up_acc = accs
        start = pl.multiple_of(i * block_k, block_k)
        kx = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        kw = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        x = block_io.load(x_ref.at[:, pl.ds(start, block_k)], row_ok & (kx < k_size), masked_io=masked_io)
        w_ok = (kw < k_size) & col_ok
        w_gate = block_io.load(w_ref.at[pl.ds(start, block_k), 0, :], w_ok, masked_io=masked_io)
        w_up = block_io.load(w_ref.at[pl.ds(start, block_k), 1, :], w_ok, masked_io=masked_io)
        return (
            gate_acc + jnp.dot(x, w_gate, preferred_element_type=jnp.float32),
            up_acc + jnp.dot(x, w_up, preferred_element_type=jnp.float32),
        )

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    gate, up = lax.fori_loop(0, num_k_tiles, k_step, (zeros, zeros))
    ok = row_ok & col_ok
    block_io.store(out_refs[0], get_activation(activation)(gate) * up, ok, masked_io=masked_io)
    if len(out_refs) == 3:  # f32 residuals for the backward pass
        block_io.store(out_refs[1], gate, ok, masked_io=masked_io)
        block_io.store(out_refs[2], up, ok, masked_io=masked_io)


def fused_call(
    x: jax.Array,
    weights: jax.Array,
    *,
    activation: str,
    save_residuals: bool,
    config: Config | mosaic_gpu_glu.Config,
    backend: Backend,
    body: Any = _forward_kernel,
) -> Any:
    """The forward kernel on x [T, d]; ``body`` is swappable for test variants.
    On the Mosaic GPU backends the default body is kernels/mosaic_gpu_glu.py's."""
    if backend.is_mosaic_gpu and body is _forward_kernel:
        return mosaic_gpu_glu.fused_call(
            x,
            weights,
            activation=activation,
            save_residuals=save_residuals,
            config=cast(mosaic_gpu_glu.Config, config),  # resolve_config's for Mosaic GPU
            backend=backend,
        )
    config = cast(Config, config)  # resolve_config's for the Pallas backends (or a test variant's)
    (t, d), f = x.shape, weights.shape[2]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    d_padded = pl.cdiv(d, bk) * bk
    n_out = 3 if save_residuals else 1
    dtypes = [x.dtype] + [jnp.float32] * (n_out - 1)
    call = backend.pallas_call(
        functools.partial(
            body, m_size=t, n_size=f, k_size=d, block_k=bk, activation=activation, masked_io=backend.is_triton
        ),
        grid=(pl.cdiv(t, bm), pl.cdiv(f, bn)),
        in_specs=[
            pl.BlockSpec((bm, d_padded), lambda i, j: (i, 0)),
            pl.BlockSpec((d_padded, 2, bn), lambda i, j: (0, 0, j)),
        ],
        out_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j))] * n_out,
        out_shape=[jax.ShapeDtypeStruct((t, f), dt) for dt in dtypes],
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        dimension_semantics=("parallel", "parallel"),
        name="pallascheck_gated_linear_unit",
    )
    outs = call(x, weights)
    return outs if save_residuals else outs[0]


def gate_and_up_cotangents(g: jax.Array, gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
    """dz [T, 2, f] in f32: [act'(gate) * (g * up), g * act(gate)]."""
    g = g.astype(jnp.float32)
    act_value, act_vjp = jax.vjp(get_activation(activation), gate)
    (dgate,) = act_vjp(g * up)
    return jnp.stack([dgate, g * act_value], axis=1)


def _matmul(a: jax.Array, b: jax.Array, config: Config, backend: Backend) -> jax.Array:
    return matmul.kernel_call(
        a, b, out_dtype=a.dtype, activation="none", save_preactivation=False, config=config, backend=backend
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _glu(x, weights, activation, config, backend):
    return fused_call(x, weights, activation=activation, save_residuals=False, config=config, backend=backend)


def _glu_fwd(x, weights, activation, config, backend):
    out, gate, up = fused_call(x, weights, activation=activation, save_residuals=True, config=config, backend=backend)
    return out, (x, weights, gate, up)


def _glu_bwd(activation, config, backend, residuals, g):
    x, weights, gate, up = residuals
    (t, d), f = x.shape, weights.shape[2]
    dz = gate_and_up_cotangents(g, gate, up, activation).astype(x.dtype).reshape(t, 2 * f)
    w = weights.reshape(d, 2 * f)
    dx = _matmul(dz, w.T, config, backend)
    dw = _matmul(x.T, dz, config, backend).reshape(d, 2, f)
    return dx, dw


_glu.defvjp(_glu_fwd, _glu_bwd)
_glu_jit = jax.jit(_glu, static_argnums=(2, 3, 4))


def _validate(x: Any, weights: Any) -> None:
    validation.require_array("x", x)
    validation.require_array("weights", weights)
    if x.ndim < 1:
        raise ValueError(f"x must have rank >= 1 ([..., d]), got shape {tuple(x.shape)}")
    validation.require_rank("weights", weights, 3, " ([d, 2, f])")
    validation.require_float_dtype("x", x.dtype)
    validation.require_float_dtype("weights", weights.dtype)
    if x.dtype != weights.dtype:
        raise TypeError(f"x and weights must have the same dtype, got {x.dtype} and {weights.dtype}")
    if weights.shape[1] != 2:
        raise ValueError(f"weights.shape[1] must be 2 (gate, up), got shape {tuple(weights.shape)}")
    if x.shape[-1] != weights.shape[0]:
        raise ValueError(
            f"contracting dimensions must match: x.shape[-1]={x.shape[-1]} != weights.shape[0]={weights.shape[0]}"
        )
    validation.require_nonempty("x", tuple(x.shape))
    validation.require_nonempty("weights", tuple(weights.shape))


def gated_linear_unit(
    x: jax.Array,
    weights: jax.Array,
    *,
    activation: str | None = None,
    config: Config | mosaic_gpu_glu.Config | None = None,
    backend: str | Backend | None = None,
) -> jax.Array:
    """``activation(x @ weights[:, 0]) * (x @ weights[:, 1])`` for x [..., d] and
    weights [d, 2, f] in f32, bf16 or f16 (bf16 or f16 on the Mosaic GPU backends,
    which take a ``mosaic_gpu_glu.Config``); f32 accumulation, result in x's dtype."""
    _validate(x, weights)
    name = canonical_activation(activation)
    backend = get_backend(backend)
    config = resolve_config(
        config,
        backend,
        Config,
        mosaic_gpu_glu.Config,
        kernel="gated_linear_unit",
        arrays={"x": x, "weights": weights},
        options={"activation": name},
    )
    if backend.is_mosaic_gpu:
        mosaic_gpu_matmul.check_input_dtype(x.dtype)
    if name not in matmul.supported_activations(backend):
        raise ValueError(
            f"activation {activation!r} is not supported on backend {backend}: its Pallas lowering "
            f"has no erf; use 'gelu_tanh' (supported there: {matmul.supported_activations(backend)})"
        )
    lead, d, f = x.shape[:-1], x.shape[-1], weights.shape[2]
    out = _glu_jit(x.reshape(-1, d), weights, name, config, backend)
    return out.reshape(*lead, f)


@functools.partial(jax.jit, static_argnames=("activation",))
def xla_reference(x: jax.Array, weights: jax.Array, *, activation: str | None = None) -> jax.Array:
    """What a user writes instead: two XLA dots accumulating in f32, the gate's
    activation and the product in f32, one rounding to x's dtype."""
    act = get_activation(canonical_activation(activation))
    gate = jnp.dot(x, weights[:, 0, :], preferred_element_type=jnp.float32)
    up = jnp.dot(x, weights[:, 1, :], preferred_element_type=jnp.float32)
    return (act(gate) * up).astype(x.dtype)
