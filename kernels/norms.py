"""Layer norm and RMS norm over the last axis, with Pallas forward and backward kernels.

``x`` has any rank >= 1; its leading dimensions are flattened to ``rows`` and the last
one holds the ``D`` features that are normalised. ``scale`` / ``offset`` have shape
``(D,)`` (``None`` means 1 / 0); the output has ``x``'s dtype.

Tiling: a 1-D grid over row blocks of ``config.block_rows`` rows. Every program holds
whole rows: its block is ``(block_rows, D_padded)`` with ``D_padded`` the next power of
two >= D (Triton only builds power-of-two tiles). The block is larger than the array:
- columns past D are padding (NaN in interpret mode) and are *masked* to zero with
  ``jnp.where`` before any arithmetic (never multiplied by a mask: 0 * NaN = NaN), so
  every sum below runs over exactly the D valid columns plus exact zeros;
- rows past ``rows`` live in the padding of the last row block; they are loaded as
  zeros, never mix with valid rows, are not stored, and are masked out of the
  parameter-gradient partial sums.
Block I/O goes through ``Tile.load`` / ``Tile.store``: on the interpreters a plain
``ref[...]`` (the interpreter pads blocks and drops out-of-bounds writes); on Triton,
which does not bounds-check a block hanging over the array's edge, masked
``load``/``store`` restricted to the valid rows and columns.

Forward arithmetic, per row, all in f32 (``x`` upcast once on load):
- layer norm (two-pass statistics):
    mean     = sum(x) / D
    centered = x - mean              (0 on padding columns)
    var      = sum(centered**2) / D
    rstd     = lax.rsqrt(var + eps)
    y        = (centered * rstd) * scale + offset
- RMS norm:
    ms       = sum(x**2) / D
    rstd     = lax.rsqrt(ms + eps)
    y        = (x * rstd) * scale
``scale`` and ``offset`` are upcast to f32; ``y`` is rounded once to ``x.dtype``. The
sums are f32 reductions of D terms (plus exact zeros) whose order the compiler picks;
on GPU the multiply-add may be fused. The kernel also writes the f32 residuals ``mean``
(layer norm only) and ``rstd``, shape ``[rows, 1]``.

Backward arithmetic (``custom_vjp``; residuals x, scale, mean, rstd), per row in f32:
    xhat = centered * rstd           (recomputed exactly as in the forward pass)
    gs   = g * scale
    layer norm: dx = rstd * (gs - sum(gs)/D - xhat * (sum(gs * xhat)/D))
    RMS norm:   dx = rstd * (gs - xhat * (sum(gs * xhat)/D))
rounded once to ``x.dtype`` (``g`` is upcast to f32 on load). The parameter gradients
are a two-level f32 reduction over rows:
1. within a row block: the kernel writes per-block partial sums of ``g * xhat``
   (dscale) and ``g`` (doffset) over the ``block_rows`` rows of its block (rows past
   the end masked to zero), shape ``[num_row_blocks, D]``;
2. across blocks: XLA sums the ``num_row_blocks = cdiv(rows, block_rows)`` partials
   over axis 0 in f32 and rounds once to the parameter's dtype.

``xla_reference_layer_norm`` / ``xla_reference_rms_norm`` are what a user writes
instead: plain ``jax.numpy`` in the input dtype (no upcast), differentiated by autodiff.

Kernel bodies are swappable (``forward_call(..., body=)``, ``backward_call(..., body=)``,
``make_norm(kind, forward_body=, backward_body=)``) so test variants reuse the tiling
and the custom_vjp wiring and change only the arithmetic. Bodies receive the static
``Tile`` (masks and masked I/O); ``layer_norm_statistics``, ``rms_statistics``,
``store_output``, ``backward_operands`` and ``store_param_partials`` are the building
blocks of the default bodies.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels import block_io, pinning, validation
from pallascheck.kernels.backends import Backend, get_backend

KINDS = ("layer_norm", "rms_norm")
DEFAULT_EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}


@dataclasses.dataclass(frozen=True)
class Config:
    block_rows: int = 8
    num_warps: int = 4  # GPU only
    num_stages: int = 1  # GPU only (the kernels have no loop to pipeline)

    def __post_init__(self) -> None:
        validation.require_positive_power_of_two("config.block_rows", self.block_rows)
        validation.require_positive_power_of_two("config.num_warps", self.num_warps)
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"config.num_stages must be an int >= 1, got {self.num_stages!r}")


def padded_features(features: int) -> int:
    """D_padded: the next power of two >= D (the width of every block)."""
    return 1 << max(0, (features - 1).bit_length())


def num_row_blocks(rows: int, config: Config) -> int:
    return pl.cdiv(rows, config.block_rows)


# On GPU, keep a block within this many elements: the backward body holds about five
# f32 tiles of the block in registers.
_GPU_MAX_BLOCK_ELEMENTS = 1 << 14


def configs(rows: int, features: int, backend: str | Backend | None = None) -> list[Config]:
    """The autotuning space for normalising ``rows`` rows of ``features`` features."""
    be = get_backend(backend)
    warps: tuple[int, ...]
    if be.is_triton:
        choices, warps, stages = (1, 4, 16), (4, 8), (1,)
    else:  # interpreters: keep the space small, every config costs a compile
        choices, warps, stages = (1, 4, 16), (4,), (1,)
    # never more than one block of pure padding rows
    fitting = [b for b in choices if b < 2 * max(rows, 1)] or [min(choices)]
    if be.is_triton:
        width = padded_features(features)
        fitting = [b for b in fitting if b * width <= _GPU_MAX_BLOCK_ELEMENTS] or [min(choices)]
    return [Config(b, w, s) for b, w, s in itertools.product(fitting, warps, stages)]


# ---------------------------------------------------------------------------------
# Kernel building blocks (shared by the default bodies and the test variants).

# Triton does not bounds-check a block that hangs over the array's edge (the
# interpreters pad it and drop out-of-bounds writes), so on "triton" every block load and
# store is masked to the rows and columns that exist.


@dataclasses.dataclass(frozen=True)
class Tile:
    """Static facts about one program's (block_rows, width) block, and masked block I/O.

    Masks: ``col_ok()`` (1, width), ``row_ok()`` (block_rows, 1), ``ok()`` both.
    """

    rows: int  # valid rows of the whole array
    features: int  # D
    block_rows: int
    width: int  # D_padded
    masked_io: bool  # True on Triton: mask loads/stores at the array's edges

    def col_ok(self) -> jax.Array:
        return lax.broadcasted_iota(jnp.int32, (1, self.width), 1) < self.features

    def row_ok(self) -> jax.Array:
        first = pl.program_id(0) * self.block_rows
        return first + lax.broadcasted_iota(jnp.int32, (self.block_rows, 1), 0) < self.rows

    def ok(self) -> jax.Array:
        return self.row_ok() & self.col_ok()

    def load(self, ref: Any, mask: jax.Array) -> jax.Array:
        """The block in its own dtype, exact zeros where ``mask`` is False."""
        return block_io.load(ref, mask, masked_io=self.masked_io)

    def load_f32(self, ref: Any, mask: jax.Array) -> jax.Array:
        return self.load(ref, mask).astype(jnp.float32)

    def store(self, ref: Any, value: jax.Array, mask: jax.Array) -> None:
        """Write the block; what ``mask`` excludes may hold anything afterwards
        (interpreters drop only the out-of-bounds part, Triton writes none of it)."""
        block_io.store(ref, value, mask, masked_io=self.masked_io)


def make_tile(rows: int, features: int, config: Config, backend: Backend) -> Tile:
    return Tile(rows, features, config.block_rows, padded_features(features), backend.is_triton)


def layer_norm_statistics(
    x: jax.Array, col_ok: jax.Array, features: int, eps: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Two-pass f32 statistics of masked rows: (mean [br,1], centered, rstd [br,1])."""
    mean = jnp.sum(x, axis=1, keepdims=True) / features
    centered = x - mean
    centered = jnp.where(col_ok, centered, jnp.zeros_like(centered))
    var = jnp.sum(centered * centered, axis=1, keepdims=True) / features
    return mean, centered, lax.rsqrt(var + eps)


def rms_statistics(x: jax.Array, features: int, eps: float) -> jax.Array:
    """rstd [br,1] of masked f32 rows: rsqrt(sum(x^2)/D + eps)."""
    ms = jnp.sum(x * x, axis=1, keepdims=True) / features
    return lax.rsqrt(ms + eps)


def store_output(tile: Tile, y_ref: Any, centered: jax.Array, rstd: jax.Array, scale_ref: Any, offset_ref: Any) -> None:
    """y = (centered * rstd) * scale (+ offset) in f32, rounded once to y's dtype."""
    col_ok = tile.col_ok()
    y = (centered * rstd) * tile.load_f32(scale_ref, col_ok)
    if offset_ref is not None:
        y = y + tile.load_f32(offset_ref, col_ok)
    tile.store(y_ref, y, tile.ok())


def backward_operands(
    tile: Tile, x_ref: Any, scale_ref: Any, mean_ref: Any, rstd_ref: Any, g_ref: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Masked f32 operands of the backward pass: (g, gs = g*scale, xhat, rstd [br,1],
    ok = valid rows & valid columns). ``mean_ref`` is None for rms_norm."""
    col_ok, row_ok = tile.col_ok(), tile.row_ok()
    ok = row_ok & col_ok
    x = tile.load_f32(x_ref, ok)
    g = tile.load_f32(g_ref, ok)
    rstd = tile.load_f32(rstd_ref, row_ok)
    if mean_ref is not None:
        centered = x - tile.load_f32(mean_ref, row_ok)
        centered = jnp.where(col_ok, centered, jnp.zeros_like(centered))
    else:
        centered = x
    xhat = centered * rstd
    gs = g * tile.load_f32(scale_ref, col_ok)
    return g, gs, xhat, rstd, ok


def store_param_partials(
    tile: Tile, dscale_ref: Any, doffset_ref: Any, g: jax.Array, xhat: jax.Array, ok: jax.Array
) -> None:
    """This row block's f32 partial sums of g*xhat (and of g) over its valid rows."""
    gx = g * xhat
    col_ok = tile.col_ok()
    partial = jnp.sum(jnp.where(ok, gx, jnp.zeros_like(gx)), axis=0, keepdims=True)
    tile.store(dscale_ref, partial, col_ok)
    if doffset_ref is not None:
        partial = jnp.sum(jnp.where(ok, g, jnp.zeros_like(g)), axis=0, keepdims=True)
        tile.store(doffset_ref, partial, col_ok)


# ---------------------------------------------------------------------------------
# Default kernel bodies. Signatures (refs; ``None`` where the kind has no such ref):
#   forward:  (x, scale, offset, y, mean, rstd, *, kind, eps, tile)
#   backward: (x, scale, mean, rstd, g, dx, dscale_partial, doffset_partial, *, kind, tile)
# x, y, g, dx blocks: (block_rows, D_padded); scale, offset, partials: (1, D_padded);
# mean, rstd: (block_rows, 1). rms_norm has no offset, mean or doffset refs.


def _forward_kernel(x_ref, scale_ref, offset_ref, y_ref, mean_ref, rstd_ref, *, kind: str, eps: float, tile: Tile):
    col_ok, row_ok = tile.col_ok(), tile.row_ok()
    x = tile.load_f32(x_ref, row_ok & col_ok)
    if kind == "layer_norm":
        mean, centered, rstd = layer_norm_statistics(x, col_ok, tile.features, eps)
        tile.store(mean_ref, mean, row_ok)
    else:
        centered, rstd = x, rms_statistics(x, tile.features, eps)
    tile.store(rstd_ref, rstd, row_ok)
    store_output(tile, y_ref, centered, rstd, scale_ref, offset_ref)


def _backward_kernel(
    x_ref,
    scale_ref,
    mean_ref,
    rstd_ref,
    g_ref,
    dx_ref,
    dscale_ref,
    doffset_ref,
    *,
    kind: str,
    tile: Tile,
):
    g, gs, xhat, rstd, ok = backward_operands(tile, x_ref, scale_ref, mean_ref, rstd_ref, g_ref)
    features = tile.features
    proj = jnp.sum(gs * xhat, axis=1, keepdims=True) / features
    if kind == "layer_norm":
        dx = rstd * (gs - jnp.sum(gs, axis=1, keepdims=True) / features - xhat * proj)
    else:
        dx = rstd * (gs - xhat * proj)
    tile.store(dx_ref, dx, ok)
    store_param_partials(tile, dscale_ref, doffset_ref, g, xhat, ok)


KernelBody = Callable[..., None]


def _launch(kernel, blocks, in_specs, out_specs, out_shape, config: Config, backend: Backend, name: str):
    """One program per row block; the blocks are independent ("parallel")."""
    return backend.pallas_call(
        kernel,
        grid=(blocks,),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        dimension_semantics=("parallel",),
        name=name,
    )


def forward_call(
    x2d: jax.Array,
    scale: jax.Array,
    offset: jax.Array | None,
    *,
    eps: float,
    kind: str,
    config: Config,
    backend: Backend,
    body: KernelBody = _forward_kernel,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Run the forward ``body`` over row blocks of x2d [rows, D]; scale, offset: (D,).

    Returns ``(y [rows, D] x.dtype, mean [rows, 1] f32 or None, rstd [rows, 1] f32)``;
    ``offset`` and ``mean`` are ``None`` for rms_norm.
    """
    rows, features = x2d.shape
    tile = make_tile(rows, features, config, backend)
    br, width = tile.block_rows, tile.width
    layer = kind == "layer_norm"
    row_block = pl.BlockSpec((br, width), lambda i: (i, 0))
    param = pl.BlockSpec((1, width), lambda i: (0, 0))
    stat = pl.BlockSpec((br, 1), lambda i: (i, 0))
    stat_shape = jax.ShapeDtypeStruct((rows, 1), jnp.float32)
    kernel: KernelBody = functools.partial(body, kind=kind, eps=eps, tile=tile)
    params: tuple[jax.Array, ...]
    if layer:
        if offset is None:
            raise ValueError("layer_norm's forward_call needs an offset (only rms_norm's has none)")
        params = (scale.reshape(1, features), offset.reshape(1, features))
        in_specs = [row_block, param, param]
        out_shape = [jax.ShapeDtypeStruct(x2d.shape, x2d.dtype), stat_shape, stat_shape]
        out_specs = [row_block, stat, stat]
    else:
        params = (scale.reshape(1, features),)
        in_specs = [row_block, param]
        out_shape = [jax.ShapeDtypeStruct(x2d.shape, x2d.dtype), stat_shape]
        out_specs = [row_block, stat]

        def kernel(x_ref, scale_ref, y_ref, rstd_ref, _inner=kernel):  # noqa: F811
            _inner(x_ref, scale_ref, None, y_ref, None, rstd_ref)

    outs = _launch(
        kernel, pl.cdiv(rows, br), in_specs, out_specs, out_shape, config, backend, f"pallascheck_{kind}_fwd"
    )(x2d, *params)
    return (outs[0], outs[1], outs[2]) if layer else (outs[0], None, outs[1])


def backward_call(
    x2d: jax.Array,
    scale: jax.Array,
    mean: jax.Array | None,
    rstd: jax.Array,
    g: jax.Array,
    *,
    kind: str,
    config: Config,
    backend: Backend,
    body: KernelBody = _backward_kernel,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Run the backward ``body`` over row blocks.

    Returns ``(dx [rows, D] x.dtype, dscale_partial, doffset_partial)`` where the
    partials are f32 ``[num_row_blocks, D]`` (``doffset_partial`` is None for rms_norm).
    """
    rows, features = x2d.shape
    tile = make_tile(rows, features, config, backend)
    br, width = tile.block_rows, tile.width
    blocks = pl.cdiv(rows, br)
    layer = kind == "layer_norm"
    row_block = pl.BlockSpec((br, width), lambda i: (i, 0))
    param = pl.BlockSpec((1, width), lambda i: (0, 0))
    stat = pl.BlockSpec((br, 1), lambda i: (i, 0))
    partial_spec = pl.BlockSpec((1, width), lambda i: (i, 0))
    partial_shape = jax.ShapeDtypeStruct((blocks, features), jnp.float32)
    dx_shape = jax.ShapeDtypeStruct(x2d.shape, x2d.dtype)
    kernel: KernelBody = functools.partial(body, kind=kind, tile=tile)
    args: tuple[jax.Array | None, ...]
    if layer:
        args = (x2d, scale.reshape(1, features), mean, rstd, g)
        in_specs = [row_block, param, stat, stat, row_block]
        out_shape = [dx_shape, partial_shape, partial_shape]
        out_specs = [row_block, partial_spec, partial_spec]
    else:
        args = (x2d, scale.reshape(1, features), rstd, g)
        in_specs = [row_block, param, stat, row_block]
        out_shape = [dx_shape, partial_shape]
        out_specs = [row_block, partial_spec]

        def kernel(x_ref, scale_ref, rstd_ref, g_ref, dx_ref, dscale_ref, _inner=kernel):  # noqa: F811
            _inner(x_ref, scale_ref, None, rstd_ref, g_ref, dx_ref, dscale_ref, None)

    outs = _launch(kernel, blocks, in_specs, out_specs, out_shape, config, backend, f"pallascheck_{kind}_bwd")(*args)
    return (outs[0], outs[1], outs[2]) if layer else (outs[0], outs[1], None)


# ---------------------------------------------------------------------------------
# Wiring: custom_vjp + jit + public signature, built per (kind, bodies).


def _validate(x: Any, scale: Any, offset: Any, eps: Any, config: Any) -> float:
    validation.require_array("x", x)
    if x.ndim < 1:
        raise ValueError(f"x must have rank >= 1 (features on the last axis), got shape {tuple(x.shape)}")
    validation.require_nonempty("x", tuple(x.shape))
    validation.require_float_dtype("x", x.dtype)
    features = x.shape[-1]
    for name, param in (("scale", scale), ("offset", offset)):
        if param is None:
            continue
        validation.require_array(name, param)
        if tuple(param.shape) != (features,):
            raise ValueError(
                f"{name} must have shape (D,) with D = x.shape[-1] = {features}, got shape {tuple(param.shape)}"
            )
        validation.require_float_dtype(name, param.dtype)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a positive finite float, got {type(eps).__name__}")
    eps = float(eps)
    if not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"eps must be a positive finite float, got {eps!r}")
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be a norms.Config, got {type(config).__name__}")
    return eps


def make_norm(
    kind: str,
    forward_body: KernelBody = _forward_kernel,
    backward_body: KernelBody = _backward_kernel,
) -> Callable[..., jax.Array]:
    """Build ``layer_norm`` / ``rms_norm`` (same public signature) around the given
    kernel bodies: validation, reshape to rows, custom_vjp, jit."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    layer = kind == "layer_norm"
    norm: Callable[..., jax.Array]

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
    def core(x2d, scale, offset, eps, config, backend):
        y, _, _ = forward_call(
            x2d, scale, offset, eps=eps, kind=kind, config=config, backend=backend, body=forward_body
        )
        return y

    def core_fwd(x2d, scale, offset, eps, config, backend):
        y, mean, rstd = forward_call(
            x2d, scale, offset, eps=eps, kind=kind, config=config, backend=backend, body=forward_body
        )
        return y, (x2d, scale, offset, mean, rstd)

    def core_bwd(eps, config, backend, residuals, g):
        del eps
        x2d, scale, offset, mean, rstd = residuals
        dx, dscale_partial, doffset_partial = backward_call(
            x2d, scale, mean, rstd, g, kind=kind, config=config, backend=backend, body=backward_body
        )
        dscale = jnp.sum(dscale_partial, axis=0).astype(scale.dtype)
        doffset = None if offset is None else jnp.sum(doffset_partial, axis=0).astype(offset.dtype)
        return dx, dscale, doffset

    core.defvjp(core_fwd, core_bwd)

    @functools.partial(jax.jit, static_argnames=("eps", "config", "backend"))
    def apply(x, scale, offset, *, eps, config, backend):
        features = x.shape[-1]
        x2d = x.reshape(-1, features)
        if scale is None:  # constants: their cotangents are dropped
            scale = jnp.ones((features,), x.dtype)
        if layer and offset is None:
            offset = jnp.zeros((features,), x.dtype)
        return core(x2d, scale, offset, eps, config, backend).reshape(x.shape)

    def run(x, scale, offset, eps, config, backend):
        eps = _validate(x, scale, offset, eps, config)
        backend = get_backend(backend)
        config = pinning.choose(
            kind,
            config,
            Config(),
            arrays={"x": x, "scale": scale, "offset": offset},
            options={"eps": eps},
            backend=backend.name,
        )
        return apply(x, scale, offset, eps=eps, config=config, backend=backend)

    if layer:

        def norm(x, scale=None, offset=None, *, eps=DEFAULT_EPS[kind], config=None, backend=None):
            return run(x, scale, offset, eps, config, backend)

    else:

        def norm(x, scale=None, *, eps=DEFAULT_EPS[kind], config=None, backend=None):
            return run(x, scale, None, eps, config, backend)

    norm.__name__ = norm.__qualname__ = kind
    norm.kind = kind  # type: ignore[attr-defined]
    return norm


layer_norm = make_norm("layer_norm")
layer_norm.__doc__ = """Layer norm over the last axis of x (rank >= 1; f32, bf16 or f16).

``scale`` / ``offset``: shape (D,), any supported float dtype; None means 1 / 0.
Two-pass f32 statistics, one rounding to x.dtype (see the module docstring).
Differentiable in x, scale and offset (Pallas backward kernel)."""

rms_norm = make_norm("rms_norm")
rms_norm.__doc__ = """RMS norm over the last axis of x (rank >= 1; f32, bf16 or f16).

``scale``: shape (D,), any supported float dtype; None means 1.
f32 statistics, one rounding to x.dtype (see the module docstring).
Differentiable in x and scale (Pallas backward kernel)."""


@functools.partial(jax.jit, static_argnames=("eps",))
def xla_reference_layer_norm(
    x: jax.Array, scale: jax.Array | None = None, offset: jax.Array | None = None, *, eps: float = 1e-5
) -> jax.Array:
    """What a user writes instead: plain jax.numpy in x.dtype, no upcast."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    y = (x - mean) * lax.rsqrt(var + jnp.asarray(eps, x.dtype))
    if scale is not None:
        y = y * scale.astype(x.dtype)
    if offset is not None:
        y = y + offset.astype(x.dtype)
    return y


@functools.partial(jax.jit, static_argnames=("eps",))
def xla_reference_rms_norm(x: jax.Array, scale: jax.Array | None = None, *, eps: float = 1e-6) -> jax.Array:
    """What a user writes instead: plain jax.numpy in x.dtype, no upcast."""
    ms = jnp.mean(x * x, axis=-1, keepdims=True)
    y = x * lax.rsqrt(ms + jnp.asarray(eps, x.dtype))
    if scale is not None:
        y = y * scale.astype(x.dtype)
    return y
