"""Focused top-k rules the random properties reach only by chance: the production
vocab (201088, not a multiple of a power-of-two block count), the deepest m stage,
k up to 128, NaN payloads, the tie rule stated directly, both slot layouts, and the
TPU interpreter (race detection, SMEM stop state, shuffled grids)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallascheck.kernels import top_k
from pallascheck.kernels.backends import Backend
from pallascheck.oracles import top_k as oracle
from pallascheck.properties import checks
from pallascheck.properties.families.top_k import logits as draw_logits

VOCAB = 201088  # 1571 * 128: a multiple of no power-of-two block count above 128


def _check(x: np.ndarray, k: int, config: top_k.Config, backend) -> np.ndarray:
    values, indices = top_k.top_k(jnp.asarray(x), k, config=config, backend=backend)
    expected = oracle.oracle(x, k)
    checks.check_values(
        oracle.encode(np.asarray(values), np.asarray(indices)),
        expected.out,
        oracle.bound(expected),
        context=checks.Context(kernel="top_k", dtype=x.dtype.name, backend=str(backend), config=config),
    )
    return np.asarray(indices)


def _seed_worst_case(dtype) -> np.ndarray:
    x = np.zeros((2, VOCAB), dtype)
    x[:, ::128] = 1  # every large value in block 0 of 128
    return x


def _seed_random_bf16() -> np.ndarray:
    """The notebook's test input: uniform 16-bit patterns as bf16, NaN and +inf set to 0."""
    x = np.random.default_rng(7).integers(0, 2**16, (2, VOCAB), dtype=np.uint16).view(ml_dtypes.bfloat16)
    wide = x.astype(np.float32)
    return np.where(np.isnan(wide) | (wide == np.inf), 0, wide).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("make", [_seed_worst_case, _seed_random_bf16], ids=["worst_case", "random_bf16"])
def test_production_vocab_is_exact(make, backend) -> None:
    x = make(ml_dtypes.bfloat16) if make is _seed_worst_case else make()
    config = top_k.Config(num_blocks=256)  # 201088 = 785.5 * 256: a ragged last chunk
    _check(x, 64, config, backend)


def test_worst_case_runs_the_deepest_stage(backend) -> None:
    x = np.zeros((2, 4000), np.float32)
    x[:, ::128] = 1.0
    counts = top_k.candidate_counts(jnp.asarray(x), 16, top_k.Config(), backend)
    assert np.asarray(counts).tolist() == [16, 16]  # no criterion holds below m = k
    _check(x, 16, top_k.Config(), backend)


@pytest.mark.parametrize("k", [64, 128])
def test_large_k(k: int, backend) -> None:
    x = draw_logits(3, (3, 1000), "bfloat16", "degenerate_bits")
    _check(x, k, top_k.Config(num_blocks=32, m_schedule=(3, 9)), backend)


def test_k_equals_vocab_and_all_equal_rows_keep_index_order(backend) -> None:
    x = np.full((2, 37), -1.5, np.float32)
    indices = _check(x, 37, top_k.Config(num_blocks=8, m_schedule=(2,)), backend)
    assert (indices == np.arange(37)).all()  # equal values: lowest index first


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_nan_payloads_follow_the_total_order(dtype: str, backend) -> None:
    """Every NaN payload of both signs, with infinities and signed zeros."""
    bits = {"float32": (np.uint32, 23, 8), "bfloat16": (np.uint16, 7, 8), "float16": (np.uint16, 10, 5)}[dtype]
    uint, mantissa, exponent = bits
    exp_mask = ((1 << exponent) - 1) << mantissa
    payloads = np.array([1, 2, 1 << (mantissa - 1), (1 << mantissa) - 1], np.uint64)
    sign = np.uint64(1) << np.uint64(mantissa + exponent)
    nans = np.concatenate([exp_mask | payloads, sign | exp_mask | payloads]).astype(uint)
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    specials = np.array([np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0], dt)
    row = np.concatenate([nans.view(dt), specials, nans.view(dt)])
    x = np.stack([row, row[::-1]])
    _check(x, row.size, top_k.Config(num_blocks=8, m_schedule=(2,)), backend)


@pytest.mark.parametrize(
    "field, first, other, seed, kind",
    [
        # the unrolled slot layout is what the GPU runs, the stacked one the TPU's
        ("layout", "unrolled", "stacked", 5, "log_probs"),
        # a vector stop state is the GPU's, SMEM scalars the TPU's
        ("stop_state", "vector", "scalars", 7, "strided_ones"),
    ],
)
def test_both_forms_of_a_config_field_agree_with_the_oracle(backend, field, first, other, seed, kind) -> None:
    """The interpreters run both forms; Triton cannot lower the TPU's, and must say so."""
    x = draw_logits(seed, (9, 300), "float32", kind)
    config = top_k.Config(num_blocks=8, m_schedule=(2, 3, 5), block_tokens=2, **{field: first})
    _check(x, 8, config, backend)
    config = dataclasses.replace(config, **{field: other})
    if backend.is_triton:
        with pytest.raises(ValueError, match=f"config.{field} '{other}' does not lower on Triton"):
            top_k.top_k(jnp.asarray(x), 8, config=config, backend=backend)
    else:
        _check(x, 8, config, backend)


def test_tpu_interpreter_races_and_grid_shuffles() -> None:
    """SMEM stop state, race detection on, two grid shuffles: identical bits."""
    x = draw_logits(11, (5, 100), "bfloat16", "log_probs")
    config = top_k.Config(num_blocks=8, m_schedule=(2, 3), block_tokens=2)
    with jax.default_device(jax.devices("cpu")[0]):  # the interpreter runs on the host
        first = _check(x, 5, config, Backend("tpu_interpret", 0))
        second = _check(x, 5, config, Backend("tpu_interpret", 1))
    assert (first == second).all()


def test_many_tokens_with_a_partial_token_block(backend) -> None:
    x = draw_logits(13, (130, 300), "float16", "few_distinct")  # 130 = 16 * 8 + 2
    _check(x, 16, top_k.Config(num_blocks=32, m_schedule=(2, 5)), backend)
