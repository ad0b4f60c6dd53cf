"""KernelSpec for kernels/attention.py: flash attention forward and backward.

Cases draw small shape buckets (compiled kernels are reused) and the adversarial
inputs attention kernels get wrong: logits large enough that a kernel without max
subtraction overflows (q and k scaled up), large negative and -inf biases, sparse
masks with fully masked rows, causal with seq_q > seq_kv and seq_q < seq_kv,
unaligned lengths (1, 17, 129), head_dim 64 and 128 (and 24: padded columns), GQA/MQA,
and biases / masks that broadcast over batch, heads or a sequence axis.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels import attention, mosaic_gpu_attention
from pallascheck.kernels.backends import GENERIC, MOSAIC_GPU, Backend
from pallascheck.oracles import attention as oracle
from pallascheck.oracles.tolerance import Arithmetic, arithmetic_for

from . import relations, strategies
from .spec import BadInput, Case, GradientSpec, KernelSpec, Relation

HEADS = ((1, 1, 1), (2, 2, 1), (1, 4, 2), (2, 2, 2))  # (batch, heads_q, heads_kv): MHA, MQA, GQA
SEQ_Q = (1, 17, 32)
SEQ_KV = (1, 17, 40, 129)
HEAD_DIMS = (16, 24, 64, 128)
LOGITS = ("normal", "large")  # large: |logits| ~ 1e3, exp overflows without max subtraction
BIASES = ("none", "normal", "large_negative", "neg_inf")
MASKS = ("none", "sparse", "rows_masked")
# bias / mask shapes, as a function of (b, h, sq, skv): full, broadcast heads/batch, 2-D, seq-broadcast
LAYOUTS = ("full", "per_head", "2d", "per_key")
SM_SCALES = (None, None, 0.3)


def _layout(layout: str, b: int, h: int, sq: int, skv: int) -> tuple[int, ...]:
    return {"full": (b, h, sq, skv), "per_head": (1, h, sq, skv), "2d": (sq, skv), "per_key": (b, 1, 1, skv)}[layout]


def cases(dtype: str, backend: Backend) -> st.SearchStrategy[Case]:
    @st.composite
    def draw(draw_) -> Case:
        b, h, hkv = draw_(strategies.layout("attention.heads", st.sampled_from(HEADS)))
        sq, skv, d = (draw_(strategies.layout(f"attention.{a}", strategies.dims(bucket)))
                      for a, bucket in (("sq", SEQ_Q), ("skv", SEQ_KV), ("d", HEAD_DIMS)))
        causal = draw_(strategies.layout("attention.causal", st.booleans()))
        sm_scale = draw_(strategies.layout("attention.sm_scale", st.sampled_from(SM_SCALES)))
        # Which of bias and mask exist, and their broadcast layouts, are part of the
        # compiled kernel; what they hold is drawn per case.
        has_bias = draw_(strategies.layout("attention.has_bias", st.booleans()))
        has_mask = draw_(strategies.layout("attention.has_mask", st.booleans()))
        bias_kind = draw_(st.sampled_from(BIASES[1:])) if has_bias else "none"
        mask_kind = draw_(st.sampled_from(MASKS[1:])) if has_mask else "none"
        logits_kind = draw_(st.sampled_from(LOGITS))
        seed = draw_(strategies.seeds())
        rng = np.random.default_rng(seed)
        npd = strategies.np_dtype(dtype)
        scale = 1.0
        if logits_kind == "large":  # q.k * sm_scale ~ c^2 for N(0, c^2) entries
            effective = (1.0 / np.sqrt(d)) if sm_scale is None else sm_scale
            scale = np.sqrt(1000.0 / (effective * np.sqrt(d)))
        arrays = {
            "q": (rng.standard_normal((b, sq, h, d)) * scale).astype(npd),
            "k": (rng.standard_normal((b, skv, hkv, d)) * scale).astype(npd),
            "v": rng.standard_normal((b, skv, hkv, d)).astype(npd),
            "cotangent": rng.standard_normal((b, sq, h, d)).astype(npd),
        }
        if bias_kind != "none":
            shape = _layout(draw_(strategies.layout("attention.bias_layout", st.sampled_from(LAYOUTS))), b, h, sq, skv)
            bias = rng.standard_normal(shape)
            if bias_kind == "large_negative":  # some keys pushed ~1e4 below the rest
                bias = np.where(rng.random(shape) < 0.3, -1e4, bias)
            elif bias_kind == "neg_inf":  # -inf sprinkled, and whole rows where there are rows
                bias = np.where(rng.random(shape) < 0.3, -np.inf, bias)
                if len(shape) >= 2 and shape[-2] > 1:
                    bias[..., 0, :] = -np.inf
            arrays["bias"] = bias.astype(npd)
        if mask_kind != "none":
            shape = _layout(draw_(strategies.layout("attention.mask_layout", st.sampled_from(LAYOUTS[:3]))), b, h, sq, skv)
            mask = rng.random(shape) < rng.uniform(0.3, 0.9)
            if mask_kind == "rows_masked":
                mask[..., rng.random(shape[-2]) < 0.3, :] = False
            arrays["mask"] = mask
        return Case(arrays, {"causal": causal, "sm_scale": sm_scale})

    return draw()


def _inputs(case: Case) -> dict[str, Any]:
    a = case.arrays
    return {
        "bias": None if "bias" not in a else jnp.asarray(a["bias"]),
        "mask": None if "mask" not in a else jnp.asarray(a["mask"]),
        "causal": case.params["causal"],
        "sm_scale": case.params["sm_scale"],
    }


def _qkv(case: Case) -> list[jax.Array]:
    return [jnp.asarray(case.arrays[n]) for n in ("q", "k", "v")]


def _oracle(case: Case) -> oracle.AttentionOracle:
    a, p = case.arrays, case.params
    return oracle.oracle(a["q"], a["k"], a["v"], bias=a.get("bias"), mask=a.get("mask"),
                         causal=p["causal"], sm_scale=p["sm_scale"])


def _bound(case: Case, ref: oracle.AttentionOracle, config: Any, arith: Arithmetic) -> np.ndarray:
    block_k = None if config is None else config.block_k  # None: xla_reference
    return oracle.bound(ref, dtype=case.arrays["q"].dtype, arith=arith, block_k=block_k)


def _kernel_vjp(kernel: Callable[..., jax.Array], case: Case, config: Any, backend: Backend) -> dict[str, jax.Array]:
    kw = _inputs(case)
    bias = kw.pop("bias")
    primals = _qkv(case) + ([bias] if bias is not None else [])

    def fn(q, k, v, *maybe_bias):
        return kernel(q, k, v, bias=maybe_bias[0] if maybe_bias else None, config=config, backend=backend, **kw)

    _, pullback = jax.vjp(fn, *primals)
    grads = pullback(jnp.asarray(case.arrays["cotangent"]))
    return dict(zip(("dq", "dk", "dv", "dbias"), grads))


def _oracle_vjp(case: Case, ref: oracle.AttentionOracle) -> dict[str, np.ndarray]:
    a = case.arrays
    return oracle.oracle_vjp(ref, a["q"], a["k"], a["v"], a.get("bias"), a["cotangent"])


def _gradient_bound(case: Case, ref, grads, config: Any, arith: Arithmetic) -> dict[str, np.ndarray]:
    dtype = case.arrays["q"].dtype
    fwd = oracle.bound(ref, dtype=dtype, arith=arith, block_k=config.block_k)
    return oracle.gradient_bound(
        ref, case.arrays["cotangent"], fwd, dtype=dtype, arith=arith,
        block_q=config.block_q_bwd, block_k=config.block_k_bwd, block_k_forward=config.block_k,
    )


def _contract(case: Case, ref: oracle.AttentionOracle, arith: Arithmetic) -> np.ndarray:
    """The two-pass algorithm (no online rescale: every key in one block, its sums in
    any order), logits and softmax in f32, p in the input dtype for the p.v product as
    every tensor-core attention does: the kernel's model with one kv block. The online
    kernel is inside it, as for cross-entropy (oracles/cross_entropy.py): its rescales
    add R (t + u) to a weight's error and save R (block_k - 1) u of summation depth."""
    return oracle.bound(ref, dtype=case.arrays["q"].dtype, arith=arith, block_k=case.arrays["k"].shape[1])


def _gradient_contract(case: Case, ref, grads, arith: Arithmetic) -> dict[str, np.ndarray]:
    """The same for the backward pass: one q block and one kv block, sums in any order."""
    dtype = case.arrays["q"].dtype
    seq_q, seq_kv = case.arrays["q"].shape[1], case.arrays["k"].shape[1]
    fwd = oracle.bound(ref, dtype=dtype, arith=arith, block_k=seq_kv)
    return oracle.gradient_bound(ref, case.arrays["cotangent"], fwd, dtype=dtype, arith=arith,
                                 block_q=seq_q, block_k=seq_kv, block_k_forward=seq_kv)


# ------------------------------------------------------------------------ relations


def _permuted_case(case: Case, batch_perm: np.ndarray, kv_head_perm: np.ndarray) -> tuple[Case, np.ndarray]:
    """Permute the batch, and the kv heads with their q-head groups; returns the case
    and the q-head permutation."""
    h, hkv = case.arrays["q"].shape[2], case.arrays["k"].shape[2]
    group = h // hkv
    q_head_perm = (kv_head_perm[:, None] * group + np.arange(group)[None, :]).reshape(-1)
    out = {}
    for name, x in case.arrays.items():
        if name in ("q", "cotangent"):
            x = x[batch_perm][:, :, q_head_perm]
        elif name in ("k", "v"):
            x = x[batch_perm][:, :, kv_head_perm]
        else:  # bias / mask: rank-4 dims that are not broadcast
            if x.ndim == 4:
                x = x[batch_perm] if x.shape[0] > 1 else x
                x = x[:, q_head_perm] if x.shape[1] > 1 else x
        out[name] = x
    return Case(out, case.params), q_head_perm


def _batch_head_permutation(run, bound, case: Case, config: Any, backend: Backend, out: np.ndarray):
    """attention(P q, P k, P v) = P attention(q, k, v) for P permuting the batch and the
    kv heads together with their q-head groups (bias/mask permuted alike). Each side is
    within its bound of the same oracle element: they agree within the sum of bounds."""
    b, hkv = case.arrays["q"].shape[0], case.arrays["k"].shape[2]
    rng = np.random.default_rng(b * 31 + hkv)
    bp, kp = rng.permutation(b), rng.permutation(hkv)
    permuted, qp = _permuted_case(case, bp, kp)
    lhs = np.asarray(run(permuted, config, backend))
    rhs = np.asarray(out)[bp][:, :, qp].astype(np.float64)
    return lhs, rhs, bound(permuted, config, backend) + bound(case, config, backend)[bp][:, :, qp]


def _key_value_permutation(run, bound, case: Case, config: Any, backend: Backend, out: np.ndarray):
    """Non-causal attention is invariant to permuting keys and values together (and the
    key axis of the bias and mask); causal attention is not, so it is not checked."""
    skv = case.arrays["k"].shape[1]
    perm = np.random.default_rng(skv).permutation(skv)
    arrays = {}
    for name, x in case.arrays.items():
        if name in ("k", "v"):
            x = x[:, perm]
        elif name in ("bias", "mask") and x.shape[-1] > 1:
            x = x[..., perm]
        arrays[name] = x
    permuted = Case(arrays, case.params)
    lhs = np.asarray(run(permuted, config, backend))
    rhs = np.asarray(out).astype(np.float64)
    return lhs, rhs, bound(permuted, config, backend) + bound(case, config, backend)


def permutations(run, bound) -> Relation:
    """Both permutation relations on one case, compared as one flat array: batch/head
    equivariance always, key/value invariance when not causal."""

    def relation(case: Case, config: Any, backend: Backend, out: np.ndarray):
        parts = [_batch_head_permutation(run, bound, case, config, backend, out)]
        if not case.params["causal"]:
            parts.append(_key_value_permutation(run, bound, case, config, backend, out))
        return tuple(np.concatenate([np.ravel(p[i]) for p in parts]) for i in range(3))

    return Relation("permutations", relation)


def _bias_shifted(case: Case) -> Case | None:
    """bias + c, one constant (0, up to 100 or up to 1e4, either sign): softmax ignores a
    constant added to a row of logits (the contract's logit errors grow with |c|:
    logits are computed in f32). None without a bias (a bias would be another
    compiled kernel)."""
    if "bias" not in case.arrays:
        return None
    bias = case.arrays["bias"]
    rng = np.random.default_rng(bias.size)
    c = rng.uniform(-1.0, 1.0) * rng.choice([0.0, 100.0, 1e4])
    return Case({**case.arrays, "bias": (bias.astype(np.float64) + c).astype(bias.dtype)}, case.params)


# ------------------------------------------------------------------------ bad inputs


def _bad_inputs(fn: Callable[..., jax.Array]) -> Callable[[], list[BadInput]]:
    def bad() -> list[BadInput]:
        q = jnp.ones((1, 8, 4, 16), jnp.float32)
        kv = jnp.ones((1, 8, 2, 16), jnp.float32)
        return [
            BadInput("rank-3 q", lambda: fn(q[0], kv, kv), ValueError, r"q must have rank 4"),
            BadInput("head_dim mismatch", lambda: fn(q, jnp.ones((1, 8, 2, 8)), jnp.ones((1, 8, 2, 8))), ValueError, r"head_dim must match"),
            BadInput("kv heads", lambda: fn(q, jnp.ones((1, 8, 3, 16)), jnp.ones((1, 8, 3, 16))), ValueError, r"kv heads must divide"),
            BadInput("k/v shapes", lambda: fn(q, kv, jnp.ones((1, 9, 2, 16))), ValueError, r"k and v must have the same shape"),
            BadInput("integer q", lambda: fn(q.astype(jnp.int32), kv, kv), TypeError, r"q must have dtype in"),
            BadInput("float64 q", lambda: fn(np.ones((1, 8, 4, 16)), np.ones((1, 8, 2, 16)), np.ones((1, 8, 2, 16))), TypeError, r"q must have dtype in"),
            BadInput("mixed dtypes", lambda: fn(q, kv.astype(jnp.bfloat16), kv), TypeError, r"same dtype"),
            BadInput("mask shape", lambda: fn(q, kv, kv, mask=jnp.ones((3, 8), bool)), ValueError, r"mask must broadcast to \[batch, heads_q, seq_q, seq_kv\]"),
            BadInput("bias shape", lambda: fn(q, kv, kv, bias=jnp.ones((1, 2, 8, 8))), ValueError, r"bias must broadcast"),
            BadInput("mask dtype", lambda: fn(q, kv, kv, mask=jnp.ones((8, 8))), TypeError, r"mask must have dtype bool"),
            BadInput("config type", lambda: fn(q, kv, kv, config=(64, 64)), TypeError, r"config must be of type attention.Config"),
            BadInput("block below 16", lambda: attention.Config(block_q=8), ValueError, r"config.block_q must be a power of two >= 16"),
            BadInput("sm_scale", lambda: fn(q, kv, kv, sm_scale="1"), TypeError, r"sm_scale must be a finite float"),
            BadInput("f32 on Mosaic GPU", lambda: fn(q, kv, kv, backend="mosaic_gpu_interpret"), TypeError, r"bfloat16 or float16 inputs, got float32"),
            BadInput("generic config on Mosaic GPU", lambda: fn(q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), config=attention.Config(), backend="mosaic_gpu_interpret"),
                     TypeError, r"config must be of type mosaic_gpu_attention.Config on backend mosaic_gpu_interpret"),
            BadInput("Mosaic GPU block", lambda: mosaic_gpu_attention.Config(block_q=32), ValueError, r"config.block_q must be one of"),
        ]

    return bad


def make_spec(kernel: Callable[..., jax.Array] = attention.attention, name: str = "attention") -> KernelSpec:
    """The attention spec for ``kernel`` (any callable with attention.attention's signature)."""

    def run(case: Case, config: Any, backend: Backend) -> jax.Array:
        return kernel(*_qkv(case), config=config, backend=backend, **_inputs(case))

    def run_bound(case: Case, config: Any, backend: Backend) -> np.ndarray:
        return _bound(case, _oracle(case), config, arithmetic_for(backend.name))

    return KernelSpec(
        name=name,
        dtypes=strategies.DTYPES,
        cases=cases,
        kernel=run,
        reference=lambda case: attention.xla_reference(*_qkv(case), **_inputs(case)),
        oracle=_oracle,
        expected=lambda ref: ref.out,
        bound=_bound,
        configs=lambda case, backend: attention.configs(
            case.arrays["q"].shape[1], case.arrays["k"].shape[1], case.arrays["q"].shape[3], backend,
            itemsize=case.arrays["q"].dtype.itemsize,
        ),
        default_config=attention.Config(),
        gradients=GradientSpec(functools.partial(_kernel_vjp, kernel), _oracle_vjp, _gradient_bound,
                               contract=_gradient_contract),
        contract=_contract,
        relations=(permutations(run, run_bound),
                   relations.invariance_within_contract("bias_shift", run, _bias_shifted, _oracle, _contract)),
        bad_inputs=_bad_inputs(kernel),
        backends=GENERIC + MOSAIC_GPU,
        dtypes_on={name: ("bfloat16", "float16") for name in MOSAIC_GPU},
        default_config_on={name: mosaic_gpu_attention.Config() for name in MOSAIC_GPU},
    )


SPEC = make_spec()
