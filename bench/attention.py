"""``pallascheck bench --op attention``: flash attention forward and forward+backward
TFLOP/s against xla_reference, ``jax.nn.dot_product_attention`` (XLA and cuDNN) and
JAX's bundled Pallas GPU kernels (``ops.gpu.attention.mha``, Triton, and on the Mosaic
GPU backend ``ops.gpu.attention_mgpu.attention``, which applies no softmax scale: it is
given q already multiplied by 1/sqrt(head_dim), the same math).

FLOPs count the two matmuls of the forward, 4 * batch * heads * seq_q * seq_kv *
head_dim (half of it when causal), and 2.5 times that for the backward (five matmuls
against two), as FlashAttention reports them. Each competitor is guarded: one that
fails to compile or run leaves its error string in the row instead of a time. Our
kernel is timed with its default config and with the fastest of its config space
(forward fields first, then the backward block sizes with the best forward ones); the
best configs and the competitors are then timed together in shuffled rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

from pallascheck.bench.timing import fastest, interleaved_medians, peak_bytes
from pallascheck.kernels import attention
from pallascheck.kernels.backends import Backend

HEADS = 16
# (batch, seq, head_dim)
SHAPES = ((4, 2048, 64), (4, 2048, 128), (4, 4096, 64), (4, 4096, 128))
MOSAIC_GPU_SHAPES = ((2, 4096, 128),)  # the shape of the Mosaic GPU target (vs cuDNN)
DTYPE = "bfloat16"
INTERLEAVED_ROUNDS = 20
SEARCH_ROUNDS = 8


def _competitors(causal: bool, scale: float, backend: Backend) -> dict[str, Callable[..., Any]]:
    def pallas_mha(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention as bundled

        return bundled.mha(q, k, v, segment_ids=None, sm_scale=scale, causal=causal)

    def attention_mgpu(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention_mgpu as bundled

        config = bundled.TuningConfig(block_q=128, block_kv=128, max_concurrent_steps=2, causal=causal)
        return bundled.attention((q * scale).astype(q.dtype), k, v, config)

    competitors = {
        "xla_reference": lambda q, k, v: attention.xla_reference(q, k, v, causal=causal, sm_scale=scale),
        "jax_nn_xla": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="xla"
        ),
        "jax_nn_cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="cudnn"
        ),
        "pallas_mha": pallas_mha,
    }
    if backend.is_mosaic_gpu:
        competitors["attention_mgpu"] = attention_mgpu
    return competitors


def _fwd_and_fwd_bwd(fn: Callable[..., Any], q, k, v, do) -> tuple[Callable[[], Any], Callable[[], Any]]:
    fwd = jax.jit(fn)
    fwd_bwd = jax.jit(lambda q, k, v: jax.vjp(fn, q, k, v)[1](do))
    return (lambda: fwd(q, k, v)), (lambda: fwd_bwd(q, k, v))


def _search_spaces(space: list[Any], backend: Backend) -> tuple[list[Any], Callable[[Any], list[Any]]]:
    """The forward search space (the configs with the default backward blocks), and the
    backward one: the configs that share the best forward config's forward fields and
    vary the backward blocks (and, on Mosaic GPU, the stages both passes share). Each
    forward+backward candidate costs a compile of three kernels: searching every
    config twice did not fit a 330 s call on a fresh H200."""
    default = type(space[0])()

    def backward(c):
        return (c.block_q_bwd, c.block_k_bwd)

    if backend.is_mosaic_gpu:

        def forward(c):
            return (c.block_q, c.block_k, c.consumers)

        fwd_space = [c for c in space if backward(c) == backward(default)] or space[:1]
    else:

        def forward(c):
            return (c.block_q, c.block_k, c.num_warps, c.num_stages)

        # one warp count per block_q (4 for 64 rows, 8 for 128) keeps the search short
        fwd_space = [
            c for c in space if backward(c) == backward(default) and c.num_warps == (4 if c.block_q <= 64 else 8)
        ] or space[:1]
    return fwd_space, lambda best: [c for c in space if forward(c) == forward(best)]


def bench_shape(backend: Backend, batch: int, seq: int, head_dim: int, causal: bool) -> dict:
    keys = jax.random.split(jax.random.key(seq + head_dim), 4)
    shape = (batch, seq, HEADS, head_dim)
    q, k, v, do = (jax.random.normal(key, shape, DTYPE) for key in keys)
    scale = 1.0 / math.sqrt(head_dim)
    fwd_flops = 4.0 * batch * HEADS * seq * seq * head_dim * (0.5 if causal else 1.0)
    total_flops = 3.5 * fwd_flops
    row: dict[str, Any] = {
        "op": "attention",
        "shape": f"b{batch}xs{seq}xh{HEADS}xd{head_dim}",
        "dtype": DTYPE,
        "causal": causal,
    }

    def ours(config: Any):
        return lambda q, k, v: attention.attention(
            q, k, v, causal=causal, sm_scale=scale, config=config, backend=backend
        )

    space = attention.configs(seq, seq, head_dim, backend, itemsize=q.dtype.itemsize, bias=False)
    fwd_space, bwd_space_around = _search_spaces(space, backend)
    best_fwd = fastest(lambda c: _fwd_and_fwd_bwd(ours(c), q, k, v, do)[0], fwd_space, SEARCH_ROUNDS)
    if best_fwd is None:
        row["error"] = "no config of the space ran"
        return row
    cfg = best_fwd[1]
    best_all = fastest(lambda c: _fwd_and_fwd_bwd(ours(c), q, k, v, do)[1], bwd_space_around(cfg), SEARCH_ROUNDS)
    row["best_config"] = str(cfg)
    if best_all is not None:
        row["best_config_fwd_bwd"] = str(best_all[1])
    # Compiled peak memory of forward+backward: O(seq) for the kernel, O(seq^2) for XLA's.
    reference = _competitors(causal, scale, backend)["xla_reference"]
    for name, fn in (("kernel", ours(None)), ("xla_reference", reference)):
        try:
            row[f"{name}_fwd_bwd_peak_MiB"] = (
                peak_bytes(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1](do), q, k, v) / 2**20
            )
        except Exception as err:  # noqa: BLE001 - recorded like a competitor that does not run
            row[f"{name}_fwd_bwd_peak_error"] = f"{type(err).__name__}: {str(err)[:120]}"
    # Our best configs and every competitor timed in shuffled rounds
    # (timing.interleaved_medians), so that clock drift between them decides no ratio.
    for label, config, flops in (("fwd", cfg, fwd_flops), ("fwd_bwd", best_all and best_all[1], total_flops)):
        if config is None:
            continue
        pick = int(label == "fwd_bwd")
        thunks = {
            "kernel": _fwd_and_fwd_bwd(ours(config), q, k, v, do)[pick],
            "kernel_default": _fwd_and_fwd_bwd(ours(None), q, k, v, do)[pick],
        }
        thunks.update(
            {name: _fwd_and_fwd_bwd(fn, q, k, v, do)[pick] for name, fn in _competitors(causal, scale, backend).items()}
        )
        medians, errors = interleaved_medians(thunks, INTERLEAVED_ROUNDS)
        row.update({f"{name}_{label}_error": err for name, err in errors.items()})
        for name, t in medians.items():
            row[f"{name}_{label}_ms"] = t * 1e3
            row[f"{name}_{label}_tflops"] = flops / t / 1e12
            if not name.startswith("kernel") and "kernel" in medians:
                row[f"{label}_speed_vs_{name}"] = t / medians["kernel"]
    return row


def bench_attention(backend: Backend) -> list[dict]:
    shapes = MOSAIC_GPU_SHAPES if backend.is_mosaic_gpu else SHAPES
    return [bench_shape(backend, *shape, causal) for shape in shapes for causal in (False, True)]
