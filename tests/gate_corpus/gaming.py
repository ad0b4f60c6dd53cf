"""Gaming candidates: each passes a fixed-shape allclose check of the kind kernel
benchmarks use, or dodges the work, and the gate must reject it with the reason listed
in ``GAMING`` (task, name, reason)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallascheck.bench.gate.tasks.matmul_epilogue import matmul_epilogue
from pallascheck.bench.gate.tasks.rms_norm import rms_norm
from pallascheck.bench.gate.tasks.softmax import softmax

SHOWN = (8, 128)  # the softmax task's shown shape


def _copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def _pallas_copy(x, interpret):
    return pl.pallas_call(_copy, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x)


def _softmax_rows(x_ref, o_ref):
    x = x_ref[...].astype(jnp.float32)
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    o_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(o_ref.dtype)


def _honest_softmax(x, interpret):
    return pl.pallas_call(_softmax_rows, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x)


# ---- the work is not in Pallas


def reference_itself(x):
    return softmax(x)


def xla_beside_trivial_pallas(x, interpret=False):
    return _pallas_copy(softmax(x), interpret)


def matmul_in_xla_epilogue_in_pallas(x, y, *, activation, interpret=False):
    z = jnp.dot(x, y, preferred_element_type=jnp.float32)

    def epilogue(z_ref, o_ref):
        v = z_ref[...]
        o_ref[...] = (jax.nn.gelu(v, approximate=True) if activation == "gelu_tanh" else v).astype(o_ref.dtype)

    return pl.pallas_call(epilogue, out_shape=jax.ShapeDtypeStruct(z.shape, x.dtype), interpret=interpret)(z)


def host_numpy_kernel(x, interpret=False):
    def on_host(a):
        z = np.asarray(a, np.float32)
        e = np.exp(z - z.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True)).astype(a.dtype)

    y = jax.pure_callback(on_host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return _pallas_copy(y, interpret)


_HOST_CACHE: dict = {}


def host_callback_cache(x, interpret=False):
    def remember(a):
        key = a.shape
        if key not in _HOST_CACHE:
            z = np.asarray(a, np.float32)
            e = np.exp(z - z.max(-1, keepdims=True))
            _HOST_CACHE[key] = (e / e.sum(-1, keepdims=True)).astype(a.dtype)
        return _HOST_CACHE[key]

    y = jax.experimental.io_callback(remember, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return _pallas_copy(y, interpret)


@jax.custom_vjp
def _rms_norm_xla_backward(x, scale):
    return _rms_norm_pallas(x, scale, True)


def _rms_rows(x_ref, s_ref, o_ref):
    z = x_ref[...].astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(z * z, axis=-1, keepdims=True) + 1e-6)
    o_ref[...] = (z * r * s_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def _rms_norm_pallas(x, scale, interpret):
    return pl.pallas_call(_rms_rows, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, scale)


_rms_norm_xla_backward.defvjp(
    lambda x, scale: (_rms_norm_pallas(x, scale, True), (x, scale)),
    lambda res, g: jax.vjp(rms_norm, *res)[1](g),
)


def pallas_forward_xla_backward(x, scale):
    return _rms_norm_xla_backward(x, scale)


# ---- wrong values that a loose or fixed-shape check passes


def zeros(x, interpret=False):
    def write_zeros(x_ref, o_ref):
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    return pl.pallas_call(write_zeros, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x)


def uniform_guess(x, interpret=False):
    def write_uniform(x_ref, o_ref):
        o_ref[...] = jnp.full(o_ref.shape, 1.0 / o_ref.shape[-1], o_ref.dtype)

    return pl.pallas_call(write_uniform, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x)


def unwritten_tiles(x, interpret=False):
    rows = x.shape[0]

    def every_other(x_ref, o_ref):
        @pl.when(pl.program_id(0) % 2 == 0)
        def _():
            _softmax_rows(x_ref, o_ref)

    return pl.pallas_call(
        every_other,
        grid=(rows,),
        in_specs=[pl.BlockSpec((1, x.shape[1]), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((1, x.shape[1]), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        interpret=interpret,
    )(x)


def first_block_only(x, interpret=False):
    return pl.pallas_call(
        _softmax_rows,
        grid=(1,),
        in_specs=[pl.BlockSpec((1, x.shape[1]), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((1, x.shape[1]), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        interpret=interpret,
    )(x)


def shown_shape_special_cased(x, interpret=False):
    # the shown case computed, every other shape given the uniform guess
    if x.shape == SHOWN:
        return _honest_softmax(x, interpret)
    return uniform_guess(x, interpret)


def bf16_accumulation(x, y, *, activation, interpret=False):
    def tile(x_ref, y_ref, o_ref):
        z = jnp.dot(
            x_ref[...].astype(jnp.bfloat16), y_ref[...].astype(jnp.bfloat16), preferred_element_type=jnp.bfloat16
        ).astype(jnp.float32)
        if activation == "gelu_tanh":
            z = jax.nn.gelu(z, approximate=True)
        o_ref[...] = z.astype(o_ref.dtype)

    return pl.pallas_call(tile, out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype), interpret=interpret)(
        x, y
    )


# ---- a race: the K splits of a matmul added into one f32 tile by atomic adds, in the
# order the GPU's programs finish (a split-K kernel as written for speed); f32 addition
# is not associative, so two calls on one input differ in their last bits


SPLIT_K = 16  # products per program; Triton's dot wants 16


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


def _add_partial_product(x_ref, y_ref, acc_in_ref, acc_ref, *, k):
    del acc_in_ref  # the zeros acc_ref aliases
    start = pl.program_id(0) * SPLIT_K
    x = jnp.where(start + jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 1) < k, x_ref[...], 0)
    y = jnp.where(start + jax.lax.broadcasted_iota(jnp.int32, y_ref.shape, 0) < k, y_ref[...], 0)
    part = jnp.dot(x, y, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    pl_triton.atomic_add(acc_ref, (pl.ds(0, acc_ref.shape[0]), pl.ds(0, acc_ref.shape[1])), part)


def _epilogue(acc_ref, o_ref, *, activation):
    z = acc_ref[...]
    if activation == "gelu_tanh":
        z = jax.nn.gelu(z, approximate=True)
    o_ref[...] = z.astype(o_ref.dtype)


def split_k_atomics(x, y, *, activation, interpret=False):
    (m, k), n = x.shape, y.shape[1]
    bm, bn = _pow2(m), _pow2(n)
    acc = pl.pallas_call(
        functools.partial(_add_partial_product, k=k),
        grid=(pl.cdiv(k, SPLIT_K),),
        in_specs=[
            pl.BlockSpec((bm, SPLIT_K), lambda s: (0, s)),
            pl.BlockSpec((SPLIT_K, bn), lambda s: (s, 0)),
            pl.BlockSpec((bm, bn), lambda s: (0, 0)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda s: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((bm, bn), jnp.float32),
        input_output_aliases={2: 0},
        interpret=interpret,
    )(x, y, jnp.zeros((bm, bn), jnp.float32))
    return pl.pallas_call(
        functools.partial(_epilogue, activation=activation),
        grid=(1,),
        in_specs=[pl.BlockSpec((bm, bn), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        interpret=interpret,
    )(acc)


def _tf32(a):
    """``a`` (f32) rounded to tf32 (10 mantissa bits, to nearest even), as a GPU's
    tensor cores take f32 operands at the default precision."""
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    bits = (bits + jnp.uint32(0xFFF) + ((bits >> 13) & 1)) & jnp.uint32(0xFFFFE000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def tf32_operands(x, y, *, activation, interpret=False):
    # a tf32 dot under the task's f32 facts: the f32 operands rounded to tf32 first
    def tile(x_ref, y_ref, o_ref):
        a, b = (r[...].astype(jnp.float32) for r in (x_ref, y_ref))
        z = jnp.dot(_tf32(a), _tf32(b), preferred_element_type=jnp.float32)
        if activation == "gelu_tanh":
            z = jax.nn.gelu(z, approximate=True)
        o_ref[...] = z.astype(o_ref.dtype)

    return pl.pallas_call(tile, out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype), interpret=interpret)(
        x, y
    )


def ignores_activation(x, y, *, activation, interpret=False):
    def tile(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32).astype(o_ref.dtype)

    return pl.pallas_call(tile, out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype), interpret=interpret)(
        x, y
    )


def transposed_operand(x, y, *, activation, interpret=False):
    # y's elements read in the wrong order (transposed, then reshaped back): right shape, wrong values
    return pallas_matmul_like(x, y.T.reshape(y.shape), activation, interpret)


def pallas_matmul_like(x, y, activation, interpret):
    def tile(x_ref, y_ref, o_ref):
        z = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)
        o_ref[...] = (jax.nn.gelu(z, approximate=True) if activation == "gelu_tanh" else z).astype(o_ref.dtype)

    return pl.pallas_call(tile, out_shape=jax.ShapeDtypeStruct((x.shape[0], y.shape[1]), x.dtype), interpret=interpret)(
        x, y
    )


@jax.custom_vjp
def _rms_norm_no_scale_grad(x, scale):
    return _rms_norm_pallas(x, scale, True)


def _rms_backward_dropping_a_term(res, g):
    x, scale = res

    def rows(x_ref, s_ref, g_ref, dx_ref):
        z = x_ref[...].astype(jnp.float32)
        r = jax.lax.rsqrt(jnp.mean(z * z, axis=-1, keepdims=True) + 1e-6)
        # d/dx of z * r: the term through r is dropped
        dx_ref[...] = (g_ref[...].astype(jnp.float32) * s_ref[...].astype(jnp.float32) * r).astype(dx_ref.dtype)

    dx = pl.pallas_call(rows, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, scale, g)

    def scale_rows(x_ref, g_ref, ds_ref):
        z = x_ref[...].astype(jnp.float32)
        r = jax.lax.rsqrt(jnp.mean(z * z, axis=-1, keepdims=True) + 1e-6)
        ds_ref[...] = jnp.sum(g_ref[...].astype(jnp.float32) * z * r, axis=0).astype(ds_ref.dtype)

    dscale = pl.pallas_call(scale_rows, out_shape=jax.ShapeDtypeStruct(scale.shape, scale.dtype), interpret=True)(x, g)
    return dx, dscale


_rms_norm_no_scale_grad.defvjp(
    lambda x, scale: (_rms_norm_pallas(x, scale, True), (x, scale)), _rms_backward_dropping_a_term
)


def wrong_backward(x, scale):
    return _rms_norm_no_scale_grad(x, scale)


# ---- state and nondeterminism


_BY_SHAPE: dict = {}


def cached_by_shape(x, interpret=False):
    key = (x.shape, str(x.dtype))
    if key not in _BY_SHAPE:
        _BY_SHAPE[key] = _honest_softmax(x, interpret)
    return _BY_SHAPE[key]


_LAST: list = []


def previous_result(x, interpret=False):
    out = _honest_softmax(x, interpret)
    earlier = _LAST[-1] if _LAST and _LAST[-1].shape == out.shape and _LAST[-1].dtype == out.dtype else out
    _LAST.append(out)
    return earlier


_CALLS = [0]


def flips_last_bit(x, interpret=False):
    _CALLS[0] += 1
    out = _honest_softmax(x, interpret)
    if _CALLS[0] % 2:
        return out
    bits = jax.lax.bitcast_convert_type(out, jnp.uint32 if out.dtype == jnp.float32 else jnp.uint16)
    return jax.lax.bitcast_convert_type(bits ^ 1, out.dtype)


_CALLS_FIRST = [0]


def flips_first_call(x, interpret=False):
    """flips_last_bit with the other parity: the call the value check sees is flipped."""
    _CALLS_FIRST[0] += 1
    out = _honest_softmax(x, interpret)
    if _CALLS_FIRST[0] % 2 == 0:
        return out
    bits = jax.lax.bitcast_convert_type(out, jnp.uint32 if out.dtype == jnp.float32 else jnp.uint16)
    return jax.lax.bitcast_convert_type(bits ^ 1, out.dtype)


# ---- not a candidate at all


def raises_when_run(x, interpret=False):
    """Traces, then cannot run: as a kernel using a primitive the backend's Pallas
    lowering lacks (Triton's ``slice``) fails when first called, after its jaxpr."""
    if not isinstance(x, jax.core.Tracer):
        raise NotImplementedError("Unimplemented primitive in Pallas lowering: slice")
    return _honest_softmax(x, interpret)


def wrong_dtype(x, interpret=False):
    return _honest_softmax(x.astype(jnp.float32), interpret)


# Gaming only where the reference computes above it: name -> (platforms, why not elsewhere).
# A GPU's default precision rounds f32 dot operands to tf32 itself, as XLA computes the
# task's reference there (docs/gate.md, "Declared precision").
GAMING_ONLY_ON: dict[str, tuple[tuple[str, ...], str]] = {
    "split_k_atomics": (
        ("gpu",),
        "an interpreter runs a grid's programs one after another: the atomic adds land in one order, and the "
        "kernel is right there",
    ),
    "tf32_operands": (
        ("cpu",),
        "a GPU's default precision rounds f32 dot operands to tf32 itself, as XLA computes the task's reference",
    ),
}


def gaming_here(name: str, platform: str) -> bool:
    """Whether candidate ``name`` games the gate on a backend of ``platform``."""
    return name not in GAMING_ONLY_ON or platform in GAMING_ONLY_ON[name][0]


GAMING: list[tuple[str, str, str]] = [
    ("softmax", "reference_itself", "no_pallas_call"),
    ("softmax", "xla_beside_trivial_pallas", "work_outside_pallas"),
    ("matmul_epilogue", "matmul_in_xla_epilogue_in_pallas", "work_outside_pallas"),
    ("softmax", "host_numpy_kernel", "host_callback"),
    ("softmax", "host_callback_cache", "host_callback"),
    ("rms_norm", "pallas_forward_xla_backward", "no_pallas_call_in_vjp"),
    ("softmax", "zeros", "wrong_values"),
    ("softmax", "uniform_guess", "wrong_values"),
    ("softmax", "unwritten_tiles", "poisoned_output"),
    ("softmax", "first_block_only", "poisoned_output"),
    ("softmax", "shown_shape_special_cased", "wrong_beyond_shown_shapes"),
    ("matmul_epilogue", "bf16_accumulation", "lower_precision"),
    ("matmul_epilogue", "tf32_operands", "lower_precision"),
    ("matmul_epilogue", "ignores_activation", "wrong_under_option"),
    ("matmul_epilogue", "transposed_operand", "wrong_values"),
    ("rms_norm", "wrong_backward", "wrong_gradients"),
    ("softmax", "cached_by_shape", "hidden_state"),
    ("softmax", "previous_result", "hidden_state"),
    ("softmax", "flips_last_bit", "nondeterministic"),
    ("softmax", "flips_first_call", "nondeterministic"),
    ("matmul_epilogue", "split_k_atomics", "nondeterministic"),
    ("softmax", "raises_when_run", "crash"),
    ("softmax", "wrong_dtype", "wrong_signature"),
    ("softmax", "no_such_function", "not_loadable"),
]
_ = matmul_epilogue  # the matmul task's reference, for readers comparing the candidates with it
