"""Targeted attention tests: the rules the property suite draws only sometimes.

- a fully masked row (by the mask, by causality with seq_q > seq_kv, or by -inf bias)
  has output exactly 0 and gradient exactly 0, never NaN;
- causal attention with seq_q != seq_kv is aligned bottom-right: it and the same
  kernel with the explicit mask j <= i + seq_kv - seq_q both match that mask's oracle;
- a 1000-long unaligned causal case, values and gradients within the derived bound;
- the Mosaic GPU interpreter's config space fits the GPU's SMEM, and the case that
  deadlocked the interpreter finishes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallascheck.kernels import attention, mosaic_gpu_attention, tiling
from pallascheck.kernels.backends import Backend
from pallascheck.oracles import attention as oracle
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import checks, watchdog
from pallascheck.properties.spec import Case
from pallascheck.properties.strategies import np_dtype

CONFIG = attention.Config(16, 16, 16, 16)
# Each test runs on every backend of the session (``each_backend``): with the CPU
# default, the Pallas kernel in ``interpret`` and the Mosaic GPU kernel in its
# interpreter. The Mosaic GPU kernel takes bf16/f16 only and 64-row blocks.


def _config(backend: Backend) -> attention.Config | mosaic_gpu_attention.Config:
    return mosaic_gpu_attention.Config() if backend.is_mosaic_gpu else CONFIG


def _widest_dtype(backend: Backend) -> str:
    return "bfloat16" if backend.is_mosaic_gpu else "float32"


def _inputs(seed: int, b: int, sq: int, skv: int, h: int, hkv: int, d: int, dtype: str):
    rng = np.random.default_rng(seed)
    npd = np_dtype(dtype)
    q = rng.standard_normal((b, sq, h, d)).astype(npd)
    k = rng.standard_normal((b, skv, hkv, d)).astype(npd)
    v = rng.standard_normal((b, skv, hkv, d)).astype(npd)
    g = rng.standard_normal((b, sq, h, d)).astype(npd)
    return q, k, v, g


def _grads(q, k, v, g, backend, config, **kw):
    def fn(q, k, v, *bias):
        return attention.attention(q, k, v, bias=bias[0] if bias else None, config=config, backend=backend, **kw)

    primals = [jnp.asarray(x) for x in (q, k, v)] + ([jnp.asarray(kw.pop("bias_value"))] if "bias_value" in kw else [])
    out, pullback = jax.vjp(fn, *primals)
    return np.asarray(out), [np.asarray(x) for x in pullback(jnp.asarray(g))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fully_masked_rows_give_zero_output_and_zero_gradients(dtype: str, each_backend: Backend) -> None:
    backend = each_backend
    if backend.is_mosaic_gpu and dtype == "float32":
        pytest.skip("the Mosaic GPU kernel refuses float32 (tf32 logits); the bad-input checks assert the refusal")
    b, sq, skv, h, d = 1, 20, 12, 2, 16
    q, k, v, g = _inputs(1, b, sq, skv, h, h, d, dtype)
    mask = np.ones((sq, skv), bool)
    mask[3] = False  # row 3: masked by the mask
    bias = np.zeros((sq, skv), np_dtype(dtype))
    bias[5] = -np.inf  # row 5: masked by -inf bias
    # causal with seq_q - seq_kv = 8: rows 0..7 see no key
    out, (dq, dk, dv, dbias) = _grads(
        q, k, v, g, backend, _config(backend), mask=jnp.asarray(mask), causal=True, bias_value=bias
    )
    for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv), ("dbias", dbias)):
        assert not np.isnan(x.astype(np.float64)).any(), f"{name} has NaN"
    empty = [3, 5] + list(range(8))
    assert np.all(out[:, empty] == 0), "fully masked rows must give output 0"
    assert np.all(dq[:, empty] == 0), "fully masked rows must give dq = 0"
    assert np.all(dbias[empty] == 0), "fully masked rows must give dbias = 0"
    # keys seen only by fully masked rows get no gradient: none here, but the visible
    # rows' outputs must not have changed either
    assert np.any(out[:, 8:] != 0)


def _check_against_oracle(out, grads, ref, q, k, v, g, backend, config, dtype: str) -> None:
    """Values and dq, dk, dv within the derived bounds of the float64 oracle ``ref``."""
    arith = arithmetic_for(backend)
    ctx = checks.Context("attention", dtype, str(backend), config)
    fwd = oracle.bound(ref, dtype=q.dtype, arith=arith, block_k=config.block_k)
    checks.check_values(out, ref.out, fwd, context=ctx)
    exact = oracle.oracle_vjp(ref, q, k, v, None, g)
    bounds = oracle.gradient_bound(
        ref,
        g,
        fwd,
        dtype=q.dtype,
        arith=arith,
        block_q=config.block_q_bwd,
        block_k=config.block_k_bwd,
        block_k_forward=config.block_k,
    )
    checks.check_gradients(dict(zip(("dq", "dk", "dv"), grads)), exact, bounds, context=ctx)


@pytest.mark.parametrize("sq,skv", [(7, 33), (33, 7)])
def test_causal_is_aligned_bottom_right(sq: int, skv: int, each_backend: Backend) -> None:
    """causal=True and the explicit mask j <= i + seq_kv - seq_q both match the float64
    oracle of that mask, values and gradients, within the derived bounds. (Not bitwise
    equal to each other: on the GPU the causal path skips kv blocks, so the two compile
    to different code.) A shift of the diagonal by one moves whole softmax weights, far
    outside the bounds."""
    backend, dtype = each_backend, _widest_dtype(each_backend)
    config = _config(backend)
    b, h, hkv, d = 2, 4, 2, 16
    q, k, v, g = _inputs(sq * 100 + skv, b, sq, skv, h, hkv, d, dtype)
    explicit = np.arange(skv)[None, :] <= np.arange(sq)[:, None] + (skv - sq)
    ref = oracle.oracle(q, k, v, mask=explicit)
    causal_out, causal_grads = _grads(q, k, v, g, backend, config, causal=True)
    _check_against_oracle(causal_out, causal_grads, ref, q, k, v, g, backend, config, dtype)
    mask_out, mask_grads = _grads(q, k, v, g, backend, config, mask=jnp.asarray(explicit))
    _check_against_oracle(mask_out, mask_grads, ref, q, k, v, g, backend, config, dtype)


def test_unaligned_length_1000_within_bound(each_backend: Backend) -> None:
    """One long causal case with a ragged last block for every block size (1000 = 62*16 + 8)."""
    backend, dtype = each_backend, "bfloat16"
    config = mosaic_gpu_attention.Config() if backend.is_mosaic_gpu else attention.Config(64, 64, 64, 64)
    b, s, h, d = 1, 1000, 1, 64
    q, k, v, g = _inputs(1000, b, s, s, h, h, d, dtype)
    out, grads = _grads(q, k, v, g, backend, config=config, causal=True)
    _check_against_oracle(out, grads, oracle.oracle(q, k, v, causal=True), q, k, v, g, backend, config, dtype)


# Configs Triton refused on an H200 for shared memory (jax 0.11.2, f32, 3 stages,
# sequence 256), with the bytes it asked for: (head_dim, bias, block_q, block_k,
# block_q_bwd, block_k_bwd, bytes). `verify --backend triton --examples 15` drew the
# first; the rest came from compiling the largest configs of the space.
TRITON_REFUSED = [
    (128, True, 64, 64, 32, 64, 245760),
    (64, True, 128, 128, 64, 64, 393216),
    (64, True, 64, 128, 64, 64, 278528),
    (64, True, 64, 32, 64, 128, 262144),
    (64, True, 64, 64, 64, 128, 262144),
    (64, False, 128, 128, 64, 64, 262144),
]


@pytest.mark.parametrize("head_dim, bias, bq, bk, bqb, bkb, requested", TRITON_REFUSED)
def test_triton_space_leaves_out_configs_triton_refused(head_dim, bias, bq, bk, bqb, bkb, requested):
    space = attention.configs(256, 256, head_dim, "triton", itemsize=4, bias=bias)
    blocks = {(c.block_q, c.block_k, c.block_q_bwd, c.block_k_bwd, c.num_stages) for c in space}
    assert space and (bq, bk, bqb, bkb, 3) not in blocks, f"Triton asked {requested} bytes for it"


@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
@pytest.mark.parametrize("bias", [False, True])
def test_mosaic_gpu_interpreter_space_fits_shared_memory(head_dim: int, bias: bool) -> None:
    """The interpreter checks only configs a GPU can run: each fits one block's SMEM by
    the model the GPU space is filtered with (the warp-specialised dk/dv kernel with
    128-row q blocks, which needs 325-709 KiB with a bias, is not among them)."""
    width = mosaic_gpu_attention.padded_head_dim(head_dim)
    for seq_q, seq_kv in ((1, 17), (150, 200)):
        for c in mosaic_gpu_attention.configs(seq_q, seq_kv, head_dim, "mosaic_gpu_interpret", 2, bias):
            assert mosaic_gpu_attention._smem_bytes(c, width, 2, bias) <= tiling.GPU_SHARED_MEMORY_BYTES, c


def test_warp_specialised_dkdv_with_gqa_causal_mask_finishes(each_backend: Backend) -> None:
    """The case that deadlocked the Mosaic GPU interpreter on a 2-core machine (XLA:CPU's
    pool starved by warpgroups blocked at barriers; properties/device/compilation.py's
    INTERPRETER_FLAGS): GQA, causal and a mask through the warp-specialised dk/dv
    kernel with 128-row q blocks (with the mask's bias tiles no GPU's SMEM holds it: a
    config for the interpreter only). Values and gradients within their bounds; a hang ends the run with a report."""
    if each_backend.name != "mosaic_gpu_interpret":
        pytest.skip("the Mosaic GPU interpreter's threads on XLA:CPU")
    config = mosaic_gpu_attention.Config(64, 64, 2, 128, 64, consumers=1, consumers_bwd=2)
    q, k, v, g = _inputs(3, 1, 17, 40, 2, 1, 16, "bfloat16")
    mask = np.random.default_rng(4).random((17, 40)) < 0.6
    dog = watchdog.CaseWatchdog(120.0, kernel="attention", dtype="bfloat16", backend=str(each_backend))
    with watchdog.watching(dog):
        dog.before_case(Case({"q": q, "k": k, "v": v, "mask": mask}, {"causal": True}), config)
        out, grads = _grads(q, k, v, g, each_backend, config, causal=True, mask=jnp.asarray(mask))
    ref = oracle.oracle(q, k, v, mask=mask, causal=True)
    _check_against_oracle(out, grads, ref, q, k, v, g, each_backend, config, "bfloat16")
