"""Honest candidates: our kernels, the examples, JAX's bundled Pallas ops that run in
Pallas' interpreter, and plain Pallas kernels of the kind a kernel writer submits. Each
takes a task's inputs and options (task.signature); ``HONEST`` lists (task, name)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas.ops.gpu import softmax as jax_softmax

from examples.blocked_cumsum import blocked_cumsum
from examples.linear_attention import linear_attention as example_linear_attention
from examples.rmsnorm_matmul import rmsnorm_matmul as example_rmsnorm_matmul
from examples.rope import rope as example_rope
from examples.softcap_attention import softcap_attention as example_softcap_attention
from pallascheck.kernels.attention import attention as our_attention
from pallascheck.kernels.cross_entropy import cross_entropy as our_cross_entropy
from pallascheck.kernels.gated_linear_unit import gated_linear_unit
from pallascheck.kernels.matmul import matmul
from pallascheck.kernels.norms import layer_norm as our_layer_norm
from pallascheck.kernels.norms import rms_norm as our_rms_norm
from pallascheck.kernels.ragged_dot import ragged_dot as our_ragged_dot
from pallascheck.kernels.top_k import top_k as our_top_k

# ---- our kernels (their backend: $PALLASCHECK_BACKEND or the interpreter)


def ours_rms_norm(x, scale):
    return our_rms_norm(x, scale, eps=1e-6)


def ours_layer_norm(x, scale, offset):
    return our_layer_norm(x, scale, offset, eps=1e-5)


def ours_cross_entropy(logits, labels):
    return our_cross_entropy(logits, labels, reduction="none")


def ours_attention(q, k, v, *, causal):
    return our_attention(q, k, v, causal=causal)


def ours_matmul(x, y, *, activation):
    return matmul(x, y, activation=activation)


def ours_glu(x, weights):
    return gated_linear_unit(x, weights, activation="silu")


def ours_ragged_dot(lhs, rhs, group_sizes):
    return our_ragged_dot(lhs, rhs, group_sizes)


def ours_top_k(logits, *, k):
    return our_top_k(logits, k)[0]


# ---- the examples


def example_rope_kernel(x, interpret=False):
    return example_rope(x, interpret=interpret)


def example_cumsum(x, interpret=False):
    return blocked_cumsum(x, interpret=interpret)


def example_rmsnorm_matmul_kernel(x, g, w, interpret=False):
    return example_rmsnorm_matmul(x, g, w, interpret=interpret)


def example_linear_attention_kernel(q, k, v, interpret=False):
    return example_linear_attention(q, k, v, interpret=interpret)


def example_softcap_attention_kernel(q, k, v, interpret=False):
    return example_softcap_attention(q, k, v, interpret=interpret)


# ---- JAX's bundled Pallas ops


def jax_softmax_kernel(x, interpret=False):
    return jax_softmax.softmax(x, axis=-1, interpret=interpret)


# ---- plain Pallas kernels, as a kernel writer submits them for a GPU: Triton lowers
# only power-of-two blocks (it masks their loads and stores past the array's edge),
# so each block is the next power of two, the padding masked in the kernel


def _pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= n and >= least (Triton's dot wants 16)."""
    return max(least, 1 << (n - 1).bit_length())


def _columns(n: int, block: int) -> jax.Array:
    """Whether each column of a (1, block) tile lies inside the n of the array."""
    return jax.lax.broadcasted_iota(jnp.int32, (1, block), 1) < n


def _softmax_row(x_ref, o_ref, *, n):
    inside = _columns(n, x_ref.shape[1])
    x = jnp.where(inside, x_ref[...].astype(jnp.float32), -jnp.inf)
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    o_ref[...] = (e / jnp.sum(e, axis=-1, keepdims=True)).astype(o_ref.dtype)


def _by_rows(kernel, x, out_cols, interpret, *inputs):
    """``kernel`` on each row of x in a (1, power of two) block, the grid over rows."""
    rows, cols = x.shape
    width, out_width = _pow2(cols), _pow2(out_cols)
    return pl.pallas_call(
        kernel,
        grid=(rows,),
        in_specs=[pl.BlockSpec((1, width), lambda i: (i, 0))]
        + [pl.BlockSpec(a.shape, lambda i: (0, 0)) for a in inputs],
        out_specs=pl.BlockSpec((1, out_width), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, out_cols), x.dtype),
        interpret=interpret,
    )(x, *inputs)


def pallas_softmax(x, interpret=False):
    return _by_rows(functools.partial(_softmax_row, n=x.shape[1]), x, x.shape[1], interpret)


def _round_half_even(v):
    """jnp.round (half to even) from floor: Triton's lowering has no round."""
    down = jnp.floor(v)
    frac = v - down
    odd = down - 2.0 * jnp.floor(down * 0.5) == 1.0
    return jnp.where((frac > 0.5) | ((frac == 0.5) & odd), down + 1.0, down)


def _fake_quantize_row(x_ref, o_ref, *, n):
    z = jnp.where(_columns(n, x_ref.shape[1]), x_ref[...].astype(jnp.float32), 0.0)
    scale = jnp.maximum(jnp.max(jnp.abs(z), axis=-1, keepdims=True) / 127.0, 2.0**-126)
    o_ref[...] = (jnp.clip(_round_half_even(z / scale), -127.0, 127.0) * scale).astype(o_ref.dtype)


def pallas_fake_quantize(x, interpret=False):
    return _by_rows(functools.partial(_fake_quantize_row, n=x.shape[1]), x, x.shape[1], interpret)


def _matmul_whole(x_ref, y_ref, o_ref, *, k, activation):
    bm, bk = x_ref.shape
    inner_x = jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 1) < k
    inner_y = jax.lax.broadcasted_iota(jnp.int32, y_ref.shape, 0) < k
    x = jnp.where(inner_x, x_ref[...], 0)
    y = jnp.where(inner_y, y_ref[...], 0)
    # f32 operands as f32 (a GPU's default would feed them to tensor cores as tf32)
    z = jnp.dot(x, y, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if activation == "gelu_tanh":
        z = jax.nn.gelu(z, approximate=True)
    o_ref[...] = z.astype(o_ref.dtype)


def pallas_matmul(x, y, *, activation, interpret=False):
    (m, k), n = x.shape, y.shape[1]
    bm, bk, bn = _pow2(m, 16), _pow2(k, 16), _pow2(n, 16)
    return pl.pallas_call(
        functools.partial(_matmul_whole, k=k, activation=activation),
        grid=(1,),
        in_specs=[pl.BlockSpec((bm, bk), lambda i: (0, 0)), pl.BlockSpec((bk, bn), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        interpret=interpret,
    )(x, y)


def _cumsum_row(x_ref, o_ref, *, n):
    x = jnp.where(_columns(n, x_ref.shape[1]), x_ref[...].astype(jnp.float32), 0.0)
    o_ref[...] = jnp.cumsum(x, axis=-1).astype(o_ref.dtype)


def pallas_cumsum(x, interpret=False):
    return _by_rows(functools.partial(_cumsum_row, n=x.shape[1]), x, x.shape[1], interpret)


def _cumsum_by_dot(x_ref, o_ref, *, n):
    # the running sums as one dot with the upper-triangular ones, out[:, j] = sum_{i <= j}
    # x[:, i]: Triton's scan is wrong on a block wider than the row (EXPECTED_FINDINGS),
    # and a dot is not a scan; on an H100 this is wrong too (EXPECTED_FINDINGS), so the
    # block's padding, not the scan, may be what Triton gets wrong. Its products are
    # exact (x times 1 or 0), its sums in some order: the reference's bound, which holds
    # for any order of the j additions.
    width = x_ref.shape[1]
    x = jnp.where(_columns(n, width), x_ref[...].astype(jnp.float32), 0.0)
    row = jax.lax.broadcasted_iota(jnp.int32, (width, width), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (width, width), 1)
    upper = (row <= col).astype(jnp.float32)
    out = jnp.dot(x, upper, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    o_ref[...] = out.astype(o_ref.dtype)


def pallas_cumsum_by_dot(x, interpret=False):
    """cumsum as a dot, 16 rows a block (Triton's dot wants 16), the grid over row blocks."""
    rows, n = x.shape
    width = _pow2(n, 16)
    return pl.pallas_call(
        functools.partial(_cumsum_by_dot, n=n),
        grid=(pl.cdiv(rows, 16),),
        in_specs=[pl.BlockSpec((16, width), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((16, width), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        interpret=interpret,
    )(x)


def _rope_row(x_ref, o_ref):
    # one position per program; the halves read and written through the refs (Triton's
    # lowering slices refs, not values)
    half = x_ref.shape[1] // 2
    pos = pl.program_id(0).astype(jnp.float32)
    inv_freq = 1.0 / (10000.0 ** (jax.lax.broadcasted_iota(jnp.float32, (1, half), 1) * 2.0 / (2 * half)))
    cos, sin = jnp.cos(pos * inv_freq), jnp.sin(pos * inv_freq)
    x1 = x_ref[:, pl.ds(0, half)].astype(jnp.float32)
    x2 = x_ref[:, pl.ds(half, half)].astype(jnp.float32)
    o_ref[:, pl.ds(0, half)] = (x1 * cos - x2 * sin).astype(o_ref.dtype)
    o_ref[:, pl.ds(half, half)] = (x2 * cos + x1 * sin).astype(o_ref.dtype)


def pallas_rope(x, interpret=False):
    return _by_rows(_rope_row, x, x.shape[1], interpret)


def _top_k_rows(x_ref, o_ref, *, k):
    o_ref[...] = jax.lax.top_k(x_ref[...], k)[0]


def pallas_top_k(logits, *, k, interpret=False):
    return pl.pallas_call(
        functools.partial(_top_k_rows, k=k),
        out_shape=jax.ShapeDtypeStruct((logits.shape[0], k), logits.dtype),
        interpret=interpret,
    )(logits)


# Where each candidate is meant to run. Our kernels pick their lowering by backend;
# the examples and plain kernels are generic Pallas, and those Triton cannot lower
# (checked on the CPU for an H100: tests/test_gate_corpus.py) are meant for the
# interpreter only, each with the reason. A corpus run on a backend counts only the
# candidates meant for it and lists the others with their reasons.
GPU = ("interpret", "triton")
# name -> (the primitive Triton's lowering lacks, where the candidate uses it)
INTERPRETER_ONLY: dict[str, tuple[str, str]] = {
    "example_rope_kernel": ("slice", "it slices a value in the kernel (x[:, : d // 2])"),
    "example_cumsum": ("slice", "it slices a value in the kernel"),
    "pallas_top_k": ("top_k", "lax.top_k in the kernel"),
}


def why_not_meant(name: str, backend: str) -> str:
    """Why candidate ``name`` is not meant for ``backend``."""
    if name in INTERPRETER_ONLY:
        primitive, where = INTERPRETER_ONLY[name]
        return f"{where}: Triton's lowering has no {primitive}"
    return f"a generic Pallas kernel, not a {backend} one: on a GPU Triton lowers it (the triton corpus judges it)"


# Outside findings, expected (a strict xfail where the gate sees them): name -> (the
# reasons it gets, the evidence, where the gate sees it). Where: AS_WRITTEN, wherever
# bf16 intermediates are rounded as written (a GPU, and the CPU with
# compilation.AS_WRITTEN_CPU_FLAGS: XLA:CPU otherwise computes a chain in f32, and the
# kernel as run is right there); TRITON, on Triton only (the interpreter runs it right).
AS_WRITTEN, TRITON = "as_written", "triton"
EXPECTED_FINDINGS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "jax_softmax_kernel": (
        ("wrong_values", "lower_precision"),
        "JAX's bundled softmax subtracts the row max in the input dtype, (row - row_max).astype(f32): in bf16 "
        "4.8 times the task's f32-intermediate bound at out[6, 91] of the shown bf16 unit (H100, triton: "
        "wrong_values). Replay: XLA_FLAGS=--xla_allow_excess_precision=false pallascheck gate softmax "
        "tests.gate_corpus.honest:jax_softmax_kernel --drawn 0",
        AS_WRITTEN,
    ),
    "pallas_cumsum": (
        ("wrong_values", "wrong_beyond_shown_shapes", "nondeterministic"),
        "jnp.cumsum in a Triton kernel is wrong on a block wider than the row (JAX's Triton lowering or "
        "Triton's scan): on an H100 (jax 0.11.2) out[2, 0] = -1.5e-37 against -1.08e-38 at the shown "
        "rows=4,n=48 f32 in (1, 64) blocks, 16 of 192 elements differing between reruns; right where the block "
        "is the row's width. python -m studies.triton_cumsum measures it. Replay: pallascheck gate cumsum "
        "tests.gate_corpus.honest:pallas_cumsum --backend triton --seed 0 --drawn 2 --examples 1",
        TRITON,
    ),
    "pallas_cumsum_by_dot": (
        ("wrong_values", "wrong_beyond_shown_shapes", "nondeterministic", "hidden_state"),
        "the cumsum as one dot with the upper-triangular ones, in (16, 64) blocks over a (4, 48) array, is wrong "
        "on Triton: on an H100 (jax 0.11.2) out[2, 0], which is x[2, 0] itself (U[i, 0] = 1 at i = 0 only: no "
        "addition, bound 0), came out -3.297 against -2.364, on the second call of the shown rows=4,n=48 f32 "
        "(the first call right); the interpreter is right. Like pallas_cumsum it pads the block past the array's "
        "edge; the cause in JAX's Triton lowering is not isolated. Replay: pallascheck gate cumsum "
        "tests.gate_corpus.honest:pallas_cumsum_by_dot --backend triton --seed 0 --drawn 2 --examples 1",
        TRITON,
    ),
}


def finding_seen(name: str, backend: str, as_written: bool) -> bool:
    """Whether the gate sees candidate ``name``'s expected finding on ``backend``, its bf16
    intermediates rounded as written or not."""
    if name not in EXPECTED_FINDINGS:
        return False
    where = EXPECTED_FINDINGS[name][2]
    return backend == "triton" if where == TRITON else as_written


# Our kernels with a Mosaic GPU version, and the task dtypes it takes there (bf16 and
# f16 only: f32 would need wgmma's tf32 mode), judged in those dtypes on Mosaic GPU
MOSAIC_GPU_DTYPES: dict[str, tuple[str, ...]] = {
    "ours_matmul": ("bfloat16",),
    "ours_glu": ("bfloat16",),
    "ours_ragged_dot": ("bfloat16",),
    "ours_attention": ("bfloat16",),
}


def backends(name: str) -> tuple[str, ...]:
    """The backends candidate ``name`` is meant for."""
    if name in INTERPRETER_ONLY:
        return ("interpret",)
    return GPU + (("mosaic_gpu", "mosaic_gpu_interpret") if name in MOSAIC_GPU_DTYPES else ())


def dtypes_on(name: str, backend: str) -> tuple[str, ...] | None:
    """The task dtypes candidate ``name`` is judged in on ``backend`` (None: all)."""
    return MOSAIC_GPU_DTYPES[name] if backend.startswith("mosaic_gpu") and name in MOSAIC_GPU_DTYPES else None


HONEST: list[tuple[str, str]] = [
    ("rms_norm", "ours_rms_norm"),
    ("layer_norm", "ours_layer_norm"),
    ("cross_entropy", "ours_cross_entropy"),
    ("attention", "ours_attention"),
    ("matmul_epilogue", "ours_matmul"),
    ("glu", "ours_glu"),
    ("ragged_dot", "ours_ragged_dot"),
    ("top_k", "ours_top_k"),
    ("rope", "example_rope_kernel"),
    ("cumsum", "example_cumsum"),
    ("rmsnorm_matmul", "example_rmsnorm_matmul_kernel"),
    ("linear_attention", "example_linear_attention_kernel"),
    ("softcap_attention", "example_softcap_attention_kernel"),
    ("softmax", "jax_softmax_kernel"),
    ("softmax", "pallas_softmax"),
    ("fake_quantize", "pallas_fake_quantize"),
    ("matmul_epilogue", "pallas_matmul"),
    ("cumsum", "pallas_cumsum"),
    ("cumsum", "pallas_cumsum_by_dot"),
    ("rope", "pallas_rope"),
    ("top_k", "pallas_top_k"),
]
