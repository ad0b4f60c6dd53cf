"""Tiled matmul ``act(x @ y)`` with an f32 accumulator and an in-kernel K loop.

Grid: one program per (block_m, block_n) output tile. Each program loops over K in
steps of block_k, multiplying (block_m, block_k) x (block_k, block_n) tiles with
``preferred_element_type=f32`` and adding into an f32 accumulator, then applies the
activation in f32 and rounds once to the output dtype.

Shapes need not be multiples of the blocks:
- rows and columns past M and N live in the padding of the edge blocks; they are
  masked on load and store (kernels/block_io.py) and never mix with valid ones;
- the K range is padded to a multiple of block_k and the padding is *masked* to
  zero on both operands (padding may hold NaN in interpret mode, and 0 * NaN would
  leak), so it adds exact zeros to the sum.

The fused ``gelu_tanh`` is accurate for ``|x @ y| <= GELU_TANH_RANGE``; beyond it
its f32 intermediate z**3 overflows and its gradient becomes NaN, as
``jax.nn.gelu(approximate=True)``'s does. The other activations have no such limit.

Batched matmul: ``jax.vmap(matmul)`` (pallas_call adds a grid dimension).
Gradients: ``custom_vjp``; the backward pass runs the same Pallas kernel on
``dz @ y.T`` and ``x.T @ dz`` with ``dz = g * act'(z)`` rounded to the input dtype.

On the ``mosaic_gpu`` and ``mosaic_gpu_interpret`` backends the forward and both
backward products run the Hopper kernel of kernels/mosaic_gpu_matmul.py instead
(TMA pipeline, wgmma; bf16/f16 inputs only; its docstring states its arithmetic
and edge handling). Its tiles are a ``mosaic_gpu_matmul.Config``, passed as
``config=`` and listed by ``configs(..., backend=...)``; this module's ``Config``
stays the one of the Pallas-generic kernel above.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels import block_io, mosaic_gpu_matmul, tiling, validation
from pallascheck.kernels.activations import ACTIVATIONS, get_activation
from pallascheck.kernels.backends import Backend, get_backend, resolve_config

GELU_TANH_RANGE = 1e12  # (1e12)**3 = 1e36 < f32 max 3.4e38


@dataclasses.dataclass(frozen=True)
class Config:
    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4  # GPU only
    num_stages: int = 2  # GPU only

    def __post_init__(self) -> None:
        # 16 is the smallest tile Triton's tensor-core dot accepts.
        for field in ("block_m", "block_n", "block_k"):
            validation.require_positive_power_of_two(f"config.{field}", getattr(self, field), 16)
        validation.require_positive_power_of_two("config.num_warps", self.num_warps)
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"config.num_stages must be an int >= 1, got {self.num_stages!r}")


def configs(
    m: int,
    n: int,
    k: int,
    backend: str | Backend | None = None,
    itemsize: int = 4,
    out_itemsize: int | None = None,
) -> list[Config] | list[mosaic_gpu_matmul.Config]:
    """The autotuning space for an (m, k) @ (k, n) product of ``itemsize``-byte inputs
    and ``out_itemsize``-byte outputs, default the inputs' (``mosaic_gpu_matmul.Config``s
    on the Mosaic GPU backends, whose SMEM holds an output tile)."""
    be = get_backend(backend)
    if be.is_mosaic_gpu:
        return mosaic_gpu_matmul.configs(m, n, k, itemsize, be, out_itemsize)
    mn: tuple[int, ...]
    kk: tuple[int, ...]
    warps: tuple[int, ...]
    stages: tuple[int, ...]
    if be.is_triton:
        mn, kk, warps, stages = (64, 128), (32, 64), (4, 8), (3, 4)
    else:  # interpreters: keep the space small, every config costs a compile
        mn, kk, warps, stages = (16, 32, 64), (16, 32), (4,), (2,)
    return [
        Config(bm, bn, bk, w, s)
        for bm, bn, bk, w, s in itertools.product(
            tiling.blocks_for(m, mn), tiling.blocks_for(n, mn), tiling.blocks_for(k, kk), warps, stages
        )
        if not be.is_triton or s * (bm + bn) * bk * itemsize <= tiling.GPU_SHARED_MEMORY_BYTES
    ]


def supported_activations(backend: str | Backend | None = None) -> tuple[str, ...]:
    """Exact gelu needs erf, which Pallas' Triton lowering and jax 0.11.2's Mosaic GPU
    lowering lack, so it is offered on neither (nor the Mosaic GPU interpreter)."""
    be = get_backend(backend)
    if be.is_mosaic_gpu:
        return mosaic_gpu_matmul.supported_activations()
    names = tuple(sorted(ACTIVATIONS))
    return tuple(a for a in names if a != "gelu") if be.is_triton else names


def _matmul_kernel(
    x_ref,
    y_ref,
    *out_refs,
    m_size: int,
    n_size: int,
    k_size: int,
    block_k: int,
    activation: str,
    masked_io: bool,
):
    block_m = x_ref.shape[0]
    block_n = y_ref.shape[1]
    num_k_tiles = x_ref.shape[1] // block_k
    rows = pl.program_id(0) * block_m + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    cols = pl.program_id(1) * block_n + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    row_ok, col_ok = rows < m_size, cols < n_size

    def k_step(i, acc):
        start = pl.multiple_of(i * block_k, block_k)
        kx = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        ky = start + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        # Zero the padding past K (and, on the GPU, never read past M or N).
        x = block_io.load(x_ref.at[:, pl.ds(start, block_k)], row_ok & (kx < k_size), masked_io=masked_io)
        y = block_io.load(y_ref.at[pl.ds(start, block_k), :], (ky < k_size) & col_ok, masked_io=masked_io)
        return acc + jnp.dot(x, y, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, num_k_tiles, k_step, jnp.zeros((block_m, block_n), jnp.float32))
    ok = row_ok & col_ok
    block_io.store(out_refs[0], get_activation(activation)(acc), ok, masked_io=masked_io)
    if len(out_refs) == 2:  # pre-activation residual for the backward pass
        block_io.store(out_refs[1], acc, ok, masked_io=masked_io)


KernelBody = Callable[..., None]


def tiled_call(
    x: jax.Array,
    y: jax.Array,
    *,
    out_dtype: Any,
    activation: str,
    save_preactivation: bool,
    config: Config,
    backend: Backend,
    body: KernelBody = _matmul_kernel,
) -> Any:
    """Run ``body`` over the (M/bm, N/bn) grid; ``body`` is swappable so that test
    variants reuse the tiling and change only the arithmetic."""
    (m, k), n = x.shape, y.shape[1]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    k_padded = pl.cdiv(k, bk) * bk
    out_shape = [jax.ShapeDtypeStruct((m, n), out_dtype)]
    out_specs = [pl.BlockSpec((bm, bn), lambda i, j: (i, j))]
    if save_preactivation:
        out_shape.append(jax.ShapeDtypeStruct((m, n), jnp.float32))
        out_specs.append(pl.BlockSpec((bm, bn), lambda i, j: (i, j)))
    call = backend.pallas_call(
        functools.partial(
            body,
            m_size=m,
            n_size=n,
            k_size=k,
            block_k=bk,
            activation=activation,
            masked_io=backend.is_triton,
        ),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
        in_specs=[
            pl.BlockSpec((bm, k_padded), lambda i, j: (i, 0)),
            pl.BlockSpec((k_padded, bn), lambda i, j: (0, j)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        dimension_semantics=("parallel", "parallel"),
        name="pallascheck_matmul",
    )
    outs = call(x, y)
    return outs if save_preactivation else outs[0]


def kernel_call(x: jax.Array, y: jax.Array, **kwargs: Any) -> Any:
    """The backend's kernel: Mosaic GPU's for its backends, the Pallas-generic one otherwise."""
    call = mosaic_gpu_matmul.tiled_call if kwargs["backend"].is_mosaic_gpu else tiled_call
    return call(x, y, **kwargs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _matmul(x, y, activation, out_dtype, config, backend):
    return kernel_call(
        x,
        y,
        out_dtype=out_dtype,
        activation=activation,
        save_preactivation=False,
        config=config,
        backend=backend,
    )


def _matmul_fwd(x, y, activation, out_dtype, config, backend):
    if activation == "none":
        out = _matmul(x, y, activation, out_dtype, config, backend)
        return out, (x, y, None)
    out, z = kernel_call(
        x,
        y,
        out_dtype=out_dtype,
        activation=activation,
        save_preactivation=True,
        config=config,
        backend=backend,
    )
    return out, (x, y, z)


def _matmul_bwd(activation, out_dtype, config, backend, residuals, g):
    x, y, z = residuals
    dz = g.astype(jnp.float32)
    if z is not None:
        _, act_vjp = jax.vjp(get_activation(activation), z)
        (dz,) = act_vjp(dz)

    def product(a, b, dtype):
        return kernel_call(
            a,
            b,
            out_dtype=dtype,
            activation="none",
            save_preactivation=False,
            config=config,
            backend=backend,
        )

    dx = product(dz.astype(x.dtype), y.T, x.dtype)
    dy = product(x.T, dz.astype(y.dtype), y.dtype)
    return dx, dy


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
# jit so that repeated calls with the same shapes and config reuse the compiled kernel.
_matmul_jit = jax.jit(_matmul, static_argnums=(2, 3, 4, 5))


def _validate(x: Any, y: Any, out_dtype: Any) -> None:
    validation.require_array("x", x)
    validation.require_array("y", y)
    vmap_hint = "; use jax.vmap(matmul) for batched products"
    validation.require_rank("x", x, 2, vmap_hint)
    validation.require_rank("y", y, 2, vmap_hint)
    validation.require_float_dtype("x", x.dtype)
    validation.require_float_dtype("y", y.dtype)
    if x.dtype != y.dtype:
        raise TypeError(f"x and y must have the same dtype, got {x.dtype} and {y.dtype}")
    if x.shape[1] != y.shape[0]:
        raise ValueError(f"contracting dimensions must match: x.shape[1]={x.shape[1]} != y.shape[0]={y.shape[0]}")
    validation.require_nonempty("x", tuple(x.shape))
    validation.require_nonempty("y", tuple(y.shape))
    validation.require_float_dtype("out_dtype", out_dtype)


def matmul(
    x: jax.Array,
    y: jax.Array,
    *,
    activation: str = "none",
    out_dtype: Any = None,
    config: Config | mosaic_gpu_matmul.Config | None = None,
    backend: str | Backend | None = None,
) -> jax.Array:
    """``activation(x @ y)`` for x: [M, K], y: [K, N] in f32, bf16 or f16 (bf16 or
    f16 on the Mosaic GPU backends, which take a ``mosaic_gpu_matmul.Config``).

    Accumulates in f32 and rounds once to ``out_dtype`` (default: the input dtype).
    Any M, N, K are accepted (see the module docstring for how edges are handled).
    """
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    _validate(x, y, out_dtype)
    get_activation(activation)
    backend = get_backend(backend)
    config = resolve_config(
        config,
        backend,
        Config,
        mosaic_gpu_matmul.Config,
        kernel="matmul",
        arrays={"x": x, "y": y},
        options={"activation": activation, "out_dtype": jnp.dtype(out_dtype).name},
    )
    if backend.is_mosaic_gpu:
        mosaic_gpu_matmul.check_input_dtype(x.dtype)
    if activation not in supported_activations(backend):
        raise ValueError(
            f"activation {activation!r} is not supported on backend {backend}: its Pallas "
            f"lowering has no erf; use 'gelu_tanh' (supported there: {supported_activations(backend)})"
        )
    return _matmul_jit(x, y, activation, jnp.dtype(out_dtype), config, backend)


@functools.partial(jax.jit, static_argnames=("activation", "out_dtype"))
def xla_reference(x: jax.Array, y: jax.Array, *, activation: str = "none", out_dtype: Any = None) -> jax.Array:
    """What a user writes instead: one XLA dot accumulating in f32, activation in f32."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    z = jnp.dot(x, y, preferred_element_type=jnp.float32)
    return get_activation(activation)(z).astype(out_dtype)
