"""JAX's own Pallas kernels (``jax.experimental.pallas.ops``) as outside clients: a
spec for each, built with the spec builders, named ``jax:<module>``, e.g.
``pallascheck verify --kernel jax:gpu.attention``.

Each adapter below states how the bundled kernel's conventions map onto ours (scale,
causal alignment, layout, what it accepts); the checks, oracles and bounds are ours.
Blocks are the kernel's own (its defaults or the config chosen here), so the
implementation bound models its tiling. Where a module cannot run on a backend, its
spec says so by the backends it lists (README: the bundled-kernel table, with the
reason for each one that does not run in an interpreter).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from collections.abc import Callable
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import backend as jax_backend

from pallascheck.kernels.backends import MOSAIC_GPU
from pallascheck.properties.families import attention as attention_spec
from pallascheck.properties.families import matmul as matmul_spec
from pallascheck.properties.families import norms as norms_spec
from pallascheck.properties.families import ragged_dot as ragged_dot_spec
from pallascheck.properties.families import softmax as softmax_spec
from pallascheck.properties.spec import KernelSpec

LOW = ("bfloat16", "float16")  # the Mosaic GPU kernels' dtypes
TRITON = ("interpret", "triton")
# The SM count the Mosaic GPU interpreter reports to a persistent kernel: fewer programs
# than output tiles, so each program loops over several (the schedule an H100's 132
# SMs run at large shapes), and the interpreter runs 2 programs, not 132.
INTERPRETER_SMS = 2


def _module(name: str):
    """``jax.experimental.pallas.ops.<name>``; the deprecation warning some of them
    give on import (layer_norm, attention: "use Tokamax") is not ours to raise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(f"jax.experimental.pallas.ops.{name}")


def gpu_attention() -> KernelSpec:
    """``ops.gpu.attention.mha``: [b, s, h, d], MHA only; ``sm_scale`` defaults to 1.0
    (passed explicitly, not 1/sqrt(d)); causal top-left; the fused backward needs as
    many q blocks as kv blocks (seq_q = seq_kv here) and sequences a multiple of its
    blocks (min(128, seq) forward, 32 backward). Its f32 q.k is a plain ``pl.dot``:
    tf32 on the GPU."""
    mha = _module("gpu.attention").mha
    return attention_spec.attention_like(
        lambda q, k, v, causal, interpret: mha(q, k, v, None, sm_scale=1.0, causal=causal, interpret=interpret),
        name="jax:gpu.attention",
        scale="none",
        causal=(False, True),
        causal_alignment="top_left",
        gqa=False,
        seq_q=(32, 64, 128),
        seq_kv=None,
        blocks=attention_spec.Blocks(128, 32, 32, qk_precision="default", exp2=True),
        backends=TRITON,
        interpret="interpret",
    )


def gpu_decode_attention() -> KernelSpec:
    """``ops.gpu.decode_attention.gqa``: one query per sequence (q [b, h, d]), k/v
    [b, s, h_kv, d], scale 1/sqrt(d), kv split in ``k_splits`` parts of ``block_k``
    blocks combined at the end; forward only. Its f32 q.k is tf32 on the GPU."""
    gqa = _module("gpu.decode_attention").gqa
    return attention_spec.attention_like(
        lambda q, k, v, interpret: gqa(q[:, 0], k, v, block_k=32, k_splits=4, interpret=interpret)[:, None],
        name="jax:gpu.decode_attention",
        seq_q=(1,),
        seq_kv=(128, 256),
        head_dims=(64, 128),
        blocks=attention_spec.Blocks(block_k=32, qk_precision="default"),
        differentiable=False,
        backends=TRITON,
        interpret="interpret",
    )


PAGE = 16  # tokens per page of the paged kv cache


def gpu_paged_attention() -> KernelSpec:
    """``ops.gpu.paged_attention.paged_attention``: one query per sequence (q [b, h, d]),
    k/v as pages [h_kv, pages, page, d] found through a block table, **no softmax
    scale** (q.k as is, like its reference), exp2 of log2(e)-scaled shifts, kv split in
    ``k_splits`` parts of ``pages_per_compute_block`` pages; forward only. The adapter
    stores the pages in a shuffled order the block table undoes, so a wrong table
    lookup shows; every sequence has its full length."""
    mod = _module("gpu.paged_attention")

    def call(q: jax.Array, k: jax.Array, v: jax.Array, interpret: bool) -> jax.Array:
        b, skv, h_kv, d = k.shape
        pages = skv // PAGE
        order = np.random.default_rng(pages).permutation(b * pages)  # physical slot -> logical page

        def paged(x: jax.Array) -> jax.Array:
            return x.reshape(b * pages, PAGE, h_kv, d).transpose(2, 0, 1, 3)[:, order]

        tables = jnp.asarray(np.argsort(order).reshape(b, pages), jnp.int32)
        lengths = jnp.full((b,), skv, jnp.int32)
        return mod.paged_attention(
            q[:, 0],
            paged(k),
            paged(v),
            tables,
            lengths,
            block_h=16,
            pages_per_compute_block=2,
            k_splits=2,
            interpret=interpret,
        )[:, None]

    return attention_spec.attention_like(
        call,
        name="jax:gpu.paged_attention",
        scale="none",
        seq_q=(1,),
        seq_kv=(128, 256),
        head_dims=(64,),
        blocks=attention_spec.Blocks(block_k=2 * PAGE, qk_precision="default", exp2=True),
        differentiable=False,
        backends=TRITON,
        interpret="interpret",
    )


def gpu_attention_mgpu() -> KernelSpec:
    """``ops.gpu.attention_mgpu.attention`` (FlashAttention-3 on Mosaic GPU): [b, s, h, d],
    f16 (bf16 inputs fail to lower on jax 0.11.2: README), **no softmax scale**
    (softmax(q k^T) v: its reference applies none either), blocks of 64 in both
    sequences. Hardware only: the Mosaic GPU interpreter cannot lower its
    warp-specialised pipeline (README)."""
    mod = _module("gpu.attention_mgpu")
    config = mod.TuningConfig(
        block_q=64, block_kv=64, max_concurrent_steps=2, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64
    )
    return attention_spec.attention_like(
        lambda q, k, v: mod.attention(q, k, v, config),
        name="jax:gpu.attention_mgpu",
        scale="none",
        seq_q=(128, 256),
        seq_kv=(128, 256),
        head_dims=(64, 128),
        blocks=attention_spec.Blocks(64, 64, 64),
        dtypes=("float16",),
        backends=("mosaic_gpu",),
    )


def gpu_hopper_matmul_mgpu() -> KernelSpec:
    """``ops.gpu.hopper_matmul_mgpu.matmul`` (persistent, TMA + wgmma): bf16/f16, out in
    the input dtype, m and k multiples of its 64-wide tiles, n of 128 (two consumer
    warpgroups split N); forward only."""
    mod = _module("gpu.hopper_matmul_mgpu")
    config = mod.TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2)

    def matmul(x: jax.Array, y: jax.Array) -> jax.Array:
        # Its persistent grid is one program per SM, counted on the default device; the
        # CPU has none. That device is the CPU for the interpreter even on a GPU host
        # (Backend.placement), so ask the device, not the host's default backend.
        on_gpu = jax_backend.get_default_device().platform == "gpu"
        with (
            contextlib.nullcontext() if on_gpu else mock.patch.object(mod, "get_num_sms", return_value=INTERPRETER_SMS)
        ):
            return mod.matmul(x, y, None, config)

    return matmul_spec.matmul_like(
        matmul,
        name="jax:gpu.hopper_matmul_mgpu",
        m=(64, 192),
        n=(128, 256),
        k=(64, 192),
        blocks=matmul_spec.Blocks(block_k=64),
        dtypes=LOW,
        differentiable=False,
        backends=MOSAIC_GPU,
    )


def gpu_ragged_dot_mgpu(rows_outside_groups: str = "unwritten") -> KernelSpec:
    """``ops.gpu.ragged_dot_mgpu.ragged_dot``: bf16/f16, K a multiple of its block;
    forward only. Rows past sum(group_sizes) are never written (uninitialised memory,
    NaN in the interpreter), unlike ``jax.lax.ragged_dot``'s zeros: its spec promises
    nothing there (README: findings)."""
    ragged_dot = _module("gpu.ragged_dot_mgpu").ragged_dot
    return ragged_dot_spec.grouped_matmul_like(
        lambda lhs, rhs, sizes: ragged_dot(
            lhs, rhs, group_sizes=sizes, block_m=64, block_n=64, block_k=64, max_concurrent_steps=2, grid_block_n=1
        ),
        name="jax:gpu.ragged_dot_mgpu",
        m=(64, 200),
        n=(64, 128),
        k=(64, 128),
        rows_outside_groups=rows_outside_groups,
        blocks=ragged_dot_spec.Blocks(block_k=64),
        dtypes=LOW,
        differentiable=False,
        backends=MOSAIC_GPU,
    )


def _gpu_norm(kind: str) -> KernelSpec:
    """``ops.gpu.layer_norm`` / ``ops.gpu.rms_norm``: x [b, s, d] with a weight and a
    bias (rms_norm adds its bias too: zeros here, which our RMS norm has)."""
    fn = getattr(_module(f"gpu.{kind}"), kind)

    def call(x: jax.Array, scale: jax.Array, *rest: jax.Array, eps: float, interpret: bool) -> jax.Array:
        bias = rest[0] if rest else jnp.zeros_like(scale)
        return fn(x.reshape(1, -1, x.shape[-1]), scale, bias, eps=eps, interpret=interpret).reshape(x.shape)

    return norms_spec.norm_like(call, name=f"jax:gpu.{kind}", kind=kind, backends=TRITON, interpret="interpret")


def gpu_softmax() -> KernelSpec:
    """``ops.gpu.softmax.softmax``: each row in one block (the next power of two), the
    row max subtracted in the input dtype and then upcast for the f32 exp, sum and
    division; forward only."""
    softmax = _module("gpu.softmax").softmax
    return softmax_spec.softmax_like(
        lambda x, interpret: softmax(x, axis=-1, interpret=interpret),
        name="jax:gpu.softmax",
        blocks=softmax_spec.Blocks(shift_dtype="input"),
        differentiable=False,
        backends=TRITON,
        interpret="interpret",
    )


def tpu_flash_attention() -> KernelSpec:
    """``ops.tpu.flash_attention.flash_attention``: [b, h, s, d], MHA only, ``ab`` a full
    [b, h, sq, skv] bias, ``sm_scale`` 1.0 by default, causal top-left; blocks of 128."""
    mod = _module("tpu.flash_attention")

    def call(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
        return mod.flash_attention(q, k, v, causal=causal, sm_scale=1.0)

    return attention_spec.attention_like(
        call,
        name="jax:tpu.flash_attention",
        layout="bhsd",
        scale="none",
        causal=(False, True),
        causal_alignment="top_left",
        gqa=False,
        # 256 queries: a causal case is square (top-left), and two kv blocks of it are
        # the causal path over several kv blocks
        seq_q=(128, 256),
        seq_kv=(128, 256),
        head_dims=(64, 128),
        blocks=attention_spec.Blocks(128, 128, 128),
        backends=("tpu_interpret", "tpu"),
    )


def tpu_megablox_gmm(rows_outside_groups: str = "unwritten") -> KernelSpec:
    """``ops.tpu.megablox.gmm``: grouped matmul, tiles (m, k, n) = (16, 128, 128), m a
    multiple of 16; out in the input dtype; f32 and bf16 (it refuses f16). Rows past
    sum(group_sizes) hold leftovers of other tiles, not zeros: as ragged_dot_mgpu."""
    gmm = _module("tpu.megablox").gmm
    return ragged_dot_spec.grouped_matmul_like(
        lambda lhs, rhs, sizes: gmm(lhs, rhs, sizes, lhs.dtype, (16, 128, 128)),
        name="jax:tpu.megablox.gmm",
        m=(16, 48),
        n=(128,),
        k=(128, 256),
        rows_outside_groups=rows_outside_groups,
        blocks=ragged_dot_spec.Blocks(block_k=128, block_rows=16),
        dtypes=("float32", "bfloat16"),
        backends=("tpu_interpret", "tpu"),
    )


@functools.cache
def spec(name: str) -> KernelSpec:
    """The spec of bundled kernel ``name``, built (and its module imported) once."""
    return BUNDLED[name]()


BUNDLED: dict[str, Callable[[], KernelSpec]] = {
    "jax:gpu.attention": gpu_attention,
    "jax:gpu.decode_attention": gpu_decode_attention,
    "jax:gpu.paged_attention": gpu_paged_attention,
    "jax:gpu.layer_norm": lambda: _gpu_norm("layer_norm"),
    "jax:gpu.rms_norm": lambda: _gpu_norm("rms_norm"),
    "jax:gpu.softmax": gpu_softmax,
    "jax:gpu.attention_mgpu": gpu_attention_mgpu,
    "jax:gpu.hopper_matmul_mgpu": gpu_hopper_matmul_mgpu,
    "jax:gpu.ragged_dot_mgpu": gpu_ragged_dot_mgpu,
    "jax:tpu.flash_attention": tpu_flash_attention,
    "jax:tpu.megablox.gmm": tpu_megablox_gmm,
}
