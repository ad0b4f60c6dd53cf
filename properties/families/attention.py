"""KernelSpec for kernels/attention.py: flash attention forward and backward.

Cases draw small shape buckets (compiled kernels are reused) and the adversarial
inputs attention kernels get wrong: logits large enough that a kernel without max
subtraction overflows (q and k scaled up), large negative and -inf biases, sparse
masks with fully masked rows, causal with seq_q > seq_kv and seq_q < seq_kv,
unaligned lengths (1, 17, 129), head_dim 64 and 128 (and 24: padded columns), GQA/MQA,
and biases / masks that broadcast over batch, heads or a sequence axis.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels import attention, mosaic_gpu_attention
from pallascheck.kernels.backends import GENERIC, MOSAIC_GPU, Backend, get_backend
from pallascheck.oracles import attention as oracle
from pallascheck.oracles.tolerance import Arithmetic, arithmetic_for
from pallascheck.properties import builders, checks, production, relations, strategies
from pallascheck.properties.device import layout_programs
from pallascheck.properties.families import attention_slices
from pallascheck.properties.spec import (
    BadInput,
    Case,
    CodePath,
    GradientSpec,
    KernelSpec,
    Layout,
    Parameter,
    Relation,
    config_fields,
)

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


def _check_bytes(b: int, sq: int, skv: int, h: int, hkv: int, d: int, *, bias: bool, held: bool) -> int:
    """The check's device memory at q [b, sq, h, d], k and v [b, skv, hkv, d] (the
    production tier's memory rule; xla_reference's is apart: ``_reference_bytes``).

    The whole case's q-like and kv-like arrays on the kernel's side (q, k, v, the
    cotangent, the output and three gradients, placed by the kernel's call and by its
    VJP's: 32 bytes an element allows them in float32); one chunk of the oracle
    (attention_slices.py: its oracle held while one function's program runs on it, at
    most 16 float64 [G, rows, skv] intermediates of SLICE_ELEMENTS, and 6 of the
    slice's [G, skv, d] k/v copies; a causal chunk over a prefix of the keys holds
    fewer); and a comparison's three float64 blocks (checks.HELD_BLOCK). The results
    (float64 values, bounds and contracts: out, its four bounds and dq, its bound and
    contract, 8 q-like arrays; dk and dv, each with its bound and contract, 6 kv-like)
    stay on the device unless a chunked case's are held on the host (``held``); a
    chunked case on the device joins one result at a time, its slices beside the whole
    (one q-like array more). Measured in bfloat16, results held (an H100): 6.1 GiB at
    32k, 9.1 GiB at 64k, where this charges 10.5 and 16.2 GiB; results on the device
    (an H200): 15.9, 26.7 and 50.9 GiB at 32k, 64k and 128k, where this charges 21.0,
    37.3 and 69.8 GiB. A bias of b x h x sq x
    skv elements adds its gradient's arrays (a check with a full bias at b2 s2000 h16
    peaked at 4.5 GiB on an H100: 48 bytes an element allowed)."""
    group = h // hkv
    chunked = group * sq * skv > attention_slices.SLICE_ELEMENTS  # a (batch row, kv head) slice chunks
    q_like, kv_like = b * sq * h * d, b * skv * hkv * d
    results = 0 if chunked and held else 64 * q_like + 48 * kv_like + (8 * q_like if chunked else 0)
    return (
        32 * (q_like + kv_like)
        + results
        + 16 * 8 * attention_slices.SLICE_ELEMENTS
        + 6 * 8 * group * skv * d
        + checks.HELD_BYTES
        + (48 * b * h * sq * skv if bias else 0)
    )


def _results_on_device_bytes(case: Case) -> int:
    (b, sq, h, d), (skv, hkv) = case.arrays["q"].shape, case.arrays["k"].shape[1:3]
    return _check_bytes(b, sq, skv, h, hkv, d, bias="bias" in case.arrays, held=False)


def production_layouts() -> tuple[Layout, ...]:
    """The production tier's layouts of real models (properties/production.py: the memory rule)."""

    def layout(
        name: str, b: int, s: int, h: int, hkv: int, d: int, causal: tuple[bool, ...], biases: tuple[str, ...] = ()
    ) -> Layout:
        """``biases``: the bias layouts drawn, one in every case (none: no bias). The
        device oracle slices a large case by batch row and kv head, never along an axis
        its bias broadcasts over (attention_slices.py), and unsliced it would not fit:
        a layout draws only the biases that let it slice on both, b x h x s x s
        elements."""
        domain: dict[str, Any] = dict(
            heads=((b, h, hkv),), seq_q=(s,), seq_kv=None, head_dims=(d,), causal=causal, sm_scales=(None,)
        )
        # a bias layout leaves ``bias`` to the spec's domain: a kernel that takes none keeps none
        # a mask ([b, h, s, s] booleans) only beside a bias: at 32k a full one is 34 GB on the host
        domain.update(dict(bias_layouts=biases, bias_always=True) if biases else dict(bias=False, mask=False))
        needs = _check_bytes(b, s, s, h, hkv, d, bias=bool(biases), held=True)
        # One case an example from a 32k case's logits on (b h s^2 >= 2^34, half of
        # Mistral 32k's 2^35; by the work, not the length, so that the unaligned 32767
        # counts as 32k: at four cases it took 341 s a unit where Mistral 32k took 146):
        # its float64 oracle is half a minute (32k) to minutes (64k: 193 s, first case,
        # H100) of device work, where four would hold the run up for the layout alone
        # (more: verify --examples)
        cases = 1 if b * h * s * s >= 2**34 else None
        on_device = _check_bytes(b, s, s, h, hkv, d, bias=bool(biases), held=False)
        return Layout(f"{name}: b{b} s{s} h{h}/{hkv} d{d}", domain, needs, cases, on_device)

    both = (False, True)
    return (
        layout("llama-3 8B", 1, 4096, 32, 8, 128, (True,)),
        layout("llama-3 8B 8k", 1, 8192, 32, 8, 128, (True,)),
        layout("llama-3 70B", 1, 4096, 64, 8, 128, (True,)),
        layout("gemma-2 9B", 1, 8192, 16, 8, 256, (True,)),
        layout("mistral 7B 32k", 1, 32768, 32, 8, 128, (True,)),
        layout("llama-3.1 8B 64k", 1, 65536, 32, 8, 128, (True,)),
        layout("llama-3.1 8B 128k", 1, 131072, 32, 8, 128, (True,)),
        layout("llama-3 70B 32k", 1, 32768, 64, 8, 128, (True,)),
        layout("unaligned 32767, GQA", 1, 32767, 32, 8, 128, (True,)),
        layout("MHA b2 4k", 2, 4096, 16, 16, 128, both),
        layout("BERT-large 2k", 4, 2048, 16, 16, 64, (False,)),
        layout("unaligned 4000", 2, 4000, 16, 16, 64, both),
        layout("MQA 16k", 1, 16384, 16, 1, 128, (True,)),
        # relative-position biases: T5's per head, a full one per batch row and head
        layout("per-head bias (T5-style), GQA 2k", 1, 2048, 32, 8, 128, both, ("full", "per_head")),
        layout("full bias, unaligned 2000", 2, 2000, 16, 16, 64, both, ("full",)),
    )


LAYOUTS_PRODUCTION = production_layouts()


def _layout(layout: str, b: int, h: int, sq: int, skv: int) -> tuple[int, ...]:
    return {"full": (b, h, sq, skv), "per_head": (1, h, sq, skv), "2d": (sq, skv), "per_key": (b, 1, 1, skv)}[layout]


@dataclasses.dataclass(frozen=True)
class Domain:
    """The inputs a kernel accepts, as the buckets cases are drawn from. The default is
    everything kernels/attention.py accepts; a kernel that accepts less (sequence
    lengths a multiple of its block, MHA only, no bias) narrows it, never widens it."""

    heads: tuple[tuple[int, int, int], ...] = HEADS
    seq_q: tuple[int, ...] = SEQ_Q
    seq_kv: tuple[int, ...] | None = SEQ_KV  # None: seq_kv = seq_q
    head_dims: tuple[int, ...] = HEAD_DIMS
    causal: tuple[bool, ...] = (False, True)
    sm_scales: tuple[float | None, ...] = SM_SCALES  # None: 1/sqrt(head_dim)
    bias: bool = True
    # the bias layouts drawn (LAYOUTS' names); the production tier keeps to those its
    # device oracle can slice (properties/production.py)
    bias_layouts: tuple[str, ...] = LAYOUTS
    bias_always: bool = False  # every layout has a bias (else half of them)
    mask: bool = True
    # causal cases draw seq_kv = seq_q: for kernels aligned top-left, where the two
    # alignments agree (ours is bottom-right)
    causal_square: bool = False


DOMAIN = Domain()
# The Mosaic GPU kernels tile by 64 rows (wgmma) where the Pallas ones tile by 16 or 32:
# their small tier has 150 queries (3 q blocks of 64; the warp-specialised forward's
# first CTA has both warpgroups on real rows, its second CTA a warpgroup of padding;
# the backward's third q block reuses the first one's slot) and 200 keys (4 kv blocks
# of 64 and a tail of 8; the warp-specialised dk/dv's second CTA has 8 keys in its
# second warpgroup), one large size per axis to keep the interpreter's cost near the
# generic buckets'. docs/shape_tiers.md states what each tier reaches.
MOSAIC_GPU_DOMAIN = Domain(seq_q=(1, 17, 150), seq_kv=(1, 17, 40, 200))


def cases(dtype: str, backend: Backend, domain: Domain = DOMAIN) -> st.SearchStrategy[Case]:
    if backend.is_mosaic_gpu and domain is DOMAIN:  # a builder's domain is the user's own
        domain = MOSAIC_GPU_DOMAIN

    @st.composite
    def draw(draw_) -> Case:
        b, h, hkv = draw_(strategies.layout_choice("attention.heads", domain.heads))
        sq, skv, d = (
            draw_(strategies.layout_choice(f"attention.{a}", bucket))
            for a, bucket in (("sq", domain.seq_q), ("skv", domain.seq_kv or (0,)), ("d", domain.head_dims))
        )
        causal = draw_(strategies.layout_choice("attention.causal", domain.causal))
        if domain.seq_kv is None or (causal and domain.causal_square):
            skv = sq
        sm_scale = draw_(strategies.layout_choice("attention.sm_scale", domain.sm_scales))
        # Which of bias and mask exist, and their broadcast layouts, are part of the
        # compiled kernel; what they hold is drawn per case.
        has_bias = domain.bias and (domain.bias_always or draw_(strategies.layout("attention.has_bias", st.booleans())))
        has_mask = domain.mask and draw_(strategies.layout("attention.has_mask", st.booleans()))
        bias_kind = draw_(strategies.element_kinds(BIASES[1:])) if has_bias else "none"
        mask_kind = draw_(strategies.element_kinds(MASKS[1:])) if has_mask else "none"
        logits_kind = draw_(strategies.element_kinds(LOGITS))
        seed = draw_(strategies.seeds())
        rng = np.random.default_rng(seed)
        npd = strategies.np_dtype(dtype)
        scale = _qk_scale(logits_kind, d, sm_scale)
        arrays = {
            "q": (strategies.normal(rng, (b, sq, h, d)) * scale).astype(npd),
            "k": (strategies.normal(rng, (b, skv, hkv, d)) * scale).astype(npd),
            "v": strategies.normal(rng, (b, skv, hkv, d)).astype(npd),
            "cotangent": strategies.normal(rng, (b, sq, h, d)).astype(npd),
        }
        if bias_kind != "none":
            shape = _layout(
                draw_(strategies.layout_choice("attention.bias_layout", domain.bias_layouts)), b, h, sq, skv
            )
            bias = rng.standard_normal(shape)
            if bias_kind == "large_negative":  # some keys pushed ~1e4 below the rest
                bias = np.where(rng.random(shape) < 0.3, -1e4, bias)
            elif bias_kind == "neg_inf":  # -inf sprinkled, and whole rows where there are rows
                bias = np.where(rng.random(shape) < 0.3, -np.inf, bias)
                if len(shape) >= 2 and shape[-2] > 1:
                    bias[..., 0, :] = -np.inf
            arrays["bias"] = bias.astype(npd)
        if mask_kind != "none":
            shape = _layout(draw_(strategies.layout_choice("attention.mask_layout", LAYOUTS[:3])), b, h, sq, skv)
            mask = rng.random(shape) < rng.uniform(0.3, 0.9)
            if mask_kind == "rows_masked":
                mask[..., rng.random(shape[-2]) < 0.3, :] = False
            arrays["mask"] = mask
        return Case(arrays, {"causal": causal, "sm_scale": sm_scale})

    return draw()


def _qk_scale(kind: str, d: int, sm_scale: float | None) -> float:
    """The scale of N(0, 1) q and k entries: 1, or for "large" logits such that
    q.k * sm_scale ~ 1e3 (c^2 for N(0, c^2) entries)."""
    if kind != "large":
        return 1.0
    effective = (1.0 / np.sqrt(d)) if sm_scale is None else sm_scale
    return float(np.sqrt(1000.0 / (effective * np.sqrt(d))))


def _adversarial(case: Case, seed: int) -> list[Case]:
    """q, k, v redrawn with each logits kind at case's shapes (bias and mask kept)."""
    a = case.arrays
    d, npd = a["q"].shape[-1], a["q"].dtype
    out = []
    for i, kind in enumerate(LOGITS):
        rng = np.random.default_rng(seed + i)
        scale = _qk_scale(kind, d, case.params["sm_scale"])
        drawn = {n: (rng.standard_normal(a[n].shape) * (scale if n != "v" else 1.0)).astype(npd) for n in "qkv"}
        out.append(Case({**a, **drawn}, case.params))
    return out


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
    return oracle.oracle(
        a["q"], a["k"], a["v"], bias=a.get("bias"), mask=a.get("mask"), causal=p["causal"], sm_scale=p["sm_scale"]
    )


@dataclasses.dataclass(frozen=True)
class Blocks:
    """What the bound needs to know of a kernel's tiling, for a kernel that is not
    ours: the kv block of the online softmax and the backward's q and kv blocks. None
    is "unknown": the whole sequence, which bounds every blocking (the contract).
    ``qk_precision``: "highest" (f32 q.k in IEEE f32, as ours) or "default" (the
    backend's default, tf32 on NVIDIA GPUs: a plain ``pl.dot`` / ``jnp.dot`` in Triton).
    ``exp2``: it takes exp2 of logits scaled by log2(e) (FlashAttention's form)."""

    block_k: int | None = None
    block_q_bwd: int | None = None
    block_k_bwd: int | None = None
    qk_precision: str = "highest"
    exp2: bool = False


def _logit_facts(config: Any) -> dict[str, bool]:
    """Our kernels' configs state neither: f32 logits at HIGHEST, natural exp."""
    return {
        "qk_highest": getattr(config, "qk_precision", "highest") == "highest",
        "log2e": getattr(config, "exp2", False),
    }


def _bound(case: Case, ref: oracle.AttentionOracle, config: Any, arith: Arithmetic) -> np.ndarray:
    """The forward bound of ``config`` alone (``_bounds``; None: xla_reference's model)."""
    return _bounds(case, ref, (("forward", config),), arith)[0]


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


def _backward(case: Case, config: Any) -> oracle.Backward:
    """The backward pass's tiling ``config`` states (a block of None: the whole sequence)."""
    seq_q, seq_kv = case.arrays["q"].shape[1], case.arrays["k"].shape[1]
    return oracle.Backward(
        block_q=config.block_q_bwd or seq_q,
        block_k=config.block_k_bwd or seq_kv,
        block_k_forward=config.block_k or seq_kv,
        **_logit_facts(config),
    )


def _forward(case: Case, config: Any) -> oracle.Forward:
    """The forward pass's tiling ``config`` states (None: xla_reference's model; a block
    of None: the whole sequence)."""
    if config is None:
        return oracle.Forward(None)
    return oracle.Forward(config.block_k or case.arrays["k"].shape[1], **_logit_facts(config))


def _bounds(case: Case, ref, asks: tuple[tuple[str, Any], ...], arith: Arithmetic) -> tuple[Any, ...]:
    """The bound of each of ``asks``: ("forward", config) the forward pass's (config
    None: xla_reference's; ``Blocks()``: the contract), ("gradient", config) the
    backward's, their shared work done once (``oracle.bounds``)."""
    resolved = [_forward(case, config) if kind == "forward" else _backward(case, config) for kind, config in asks]
    dtype = case.arrays["q"].dtype
    return tuple(oracle.bounds(ref, case.arrays.get("cotangent"), resolved, dtype=dtype, arith=arith))


def _contract(case: Case, ref: oracle.AttentionOracle, arith: Arithmetic) -> np.ndarray:
    """The two-pass algorithm (no online rescale: every key in one block, its sums in
    any order), logits and softmax in f32, p in the input dtype for the p.v product as
    every tensor-core attention does: the kernel's model with one kv block. The online
    kernel is inside it, as for cross-entropy (oracles/cross_entropy.py): its rescales
    add R (t + u) to a weight's error and save R (block_k - 1) u of summation depth."""
    return _bound(case, ref, Blocks(), arith)


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
    lhs = np.asarray(layout_programs.run_kernel(run, permuted, config, backend))
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
    lhs = np.asarray(layout_programs.run_kernel(run, permuted, config, backend))
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
            BadInput(
                "head_dim mismatch",
                lambda: fn(q, jnp.ones((1, 8, 2, 8)), jnp.ones((1, 8, 2, 8))),
                ValueError,
                r"head_dim must match",
            ),
            BadInput(
                "kv heads",
                lambda: fn(q, jnp.ones((1, 8, 3, 16)), jnp.ones((1, 8, 3, 16))),
                ValueError,
                r"kv heads must divide",
            ),
            BadInput(
                "k/v shapes",
                lambda: fn(q, kv, jnp.ones((1, 9, 2, 16))),
                ValueError,
                r"k and v must have the same shape",
            ),
            BadInput("integer q", lambda: fn(q.astype(jnp.int32), kv, kv), TypeError, r"q must have dtype in"),
            BadInput(
                "float64 q",
                lambda: fn(np.ones((1, 8, 4, 16)), np.ones((1, 8, 2, 16)), np.ones((1, 8, 2, 16))),
                TypeError,
                r"q must have dtype in",
            ),
            BadInput("mixed dtypes", lambda: fn(q, kv.astype(jnp.bfloat16), kv), TypeError, r"same dtype"),
            BadInput(
                "mask shape",
                lambda: fn(q, kv, kv, mask=jnp.ones((3, 8), bool)),
                ValueError,
                r"mask must broadcast to \[batch, heads_q, seq_q, seq_kv\]",
            ),
            BadInput(
                "bias shape", lambda: fn(q, kv, kv, bias=jnp.ones((1, 2, 8, 8))), ValueError, r"bias must broadcast"
            ),
            BadInput(
                "mask dtype", lambda: fn(q, kv, kv, mask=jnp.ones((8, 8))), TypeError, r"mask must have dtype bool"
            ),
            BadInput(
                "config type",
                lambda: fn(q, kv, kv, config=(64, 64)),
                TypeError,
                r"config must be of type attention.Config",
            ),
            BadInput(
                "block below 16",
                lambda: attention.Config(block_q=8),
                ValueError,
                r"config.block_q must be a power of two >= 16",
            ),
            BadInput("sm_scale", lambda: fn(q, kv, kv, sm_scale="1"), TypeError, r"sm_scale must be a finite float"),
            BadInput(
                "f32 on Mosaic GPU",
                lambda: fn(q, kv, kv, backend="mosaic_gpu_interpret"),
                TypeError,
                r"bfloat16 or float16 inputs, got float32",
            ),
            BadInput(
                "head_dim 192 on Mosaic GPU",
                lambda: fn(
                    jnp.ones((1, 8, 4, 192), jnp.bfloat16),
                    jnp.ones((1, 8, 2, 192), jnp.bfloat16),
                    jnp.ones((1, 8, 2, 192), jnp.bfloat16),
                    backend="mosaic_gpu_interpret",
                ),
                ValueError,
                r"head_dim must be <= 128 on Mosaic GPU",
            ),
            BadInput(
                "generic config on Mosaic GPU",
                lambda: fn(
                    q.astype(jnp.bfloat16),
                    kv.astype(jnp.bfloat16),
                    kv.astype(jnp.bfloat16),
                    config=attention.Config(),
                    backend="mosaic_gpu_interpret",
                ),
                TypeError,
                r"config must be of type mosaic_gpu_attention.Config on backend mosaic_gpu_interpret",
            ),
            BadInput(
                "Mosaic GPU block",
                lambda: mosaic_gpu_attention.Config(block_q=32),
                ValueError,
                r"config.block_q must be one of",
            ),
            BadInput(
                "Mosaic GPU consumers",
                lambda: mosaic_gpu_attention.Config(block_q=128, consumers=2),
                ValueError,
                r"config.consumers = 2 needs block_q = 64",
            ),
            BadInput(
                "Mosaic GPU backward consumers",
                lambda: mosaic_gpu_attention.Config(block_kv_bwd=128, consumers_bwd=2),
                ValueError,
                r"config.consumers_bwd = 2 needs block_kv_bwd = 64",
            ),
        ]

    return bad


def _sq_skv(case: Case) -> tuple[int, int]:
    return case.arrays["q"].shape[1], case.arrays["k"].shape[1]


def _blocks(n: int, block: int | None) -> int:
    return 1 if not block else -(-n // block)


def _kv_block(config: Any) -> int | None:
    """The forward's kv block: ours (generic ``block_k``, Mosaic GPU ``block_kv``) or a
    user kernel's ``Blocks.block_k`` (None: unknown)."""
    return getattr(config, "block_kv", getattr(config, "block_k", None))


def _reference_bytes(case: Case) -> int:
    """xla_reference's device memory: the whole [b, h, sq, skv] logits in the input
    dtype and f32 and their softmax (16.5 GiB at b2 h16 s4096 on an H100, 33 bytes an
    element: 40 allowed)."""
    q, k = case.arrays["q"], case.arrays["k"]
    return 40 * q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1]


def _paths(blocks: Blocks | None, domain: Domain) -> tuple[CodePath, ...]:
    """The code paths every small-tier run reaches (docs/shape_tiers.md, made a rule)."""

    def causal(case: Case) -> bool:
        return bool(case.params.get("causal"))

    shared = (
        CodePath(
            "several kv blocks: online softmax rescales",
            lambda case, config: _blocks(_sq_skv(case)[1], _kv_block(config)) >= 2,
        ),
        CodePath(
            "a ragged last kv block",
            lambda case, config: bool(
                (block := _kv_block(config)) and _sq_skv(case)[1] % block != 0 and _sq_skv(case)[1] > block
            ),
        ),
    )
    if blocks is not None:  # a user's kernel: what its declared tiling makes of the draws
        block = blocks.block_k
        if block is None:  # unknown: no tile to reach
            return ()
        # only the paths its declared lengths reach (builders.tiles_reachable), as
        # ``cases`` draws them: a causal case with top-left alignment is square
        causal_kv = set(domain.seq_q if domain.seq_kv is None or domain.causal_square else domain.seq_kv)
        kv = (set(domain.seq_kv or domain.seq_q) if False in domain.causal else set()) | (
            causal_kv if True in domain.causal else set()
        )
        inferred = (
            (shared[0], any(n > block for n in kv)),
            (shared[1], builders.tiles_reachable(kv, block)),
            (
                CodePath(
                    "causal over several kv blocks",
                    lambda case, config: causal(case) and _blocks(_sq_skv(case)[1], _kv_block(config)) >= 2,
                ),
                True in domain.causal and any(n > block for n in causal_kv),
            ),
        )
        return tuple(dataclasses.replace(p, required=False) for p, reachable in inferred if reachable)
    ws = ("mosaic_gpu", "mosaic_gpu_interpret")
    return shared + (
        CodePath(
            "causal: q blocks with different kv ranges",
            lambda case, config: causal(case) and _sq_skv(case)[0] > config.block_q,
        ),
        CodePath("grouped-query heads", lambda case, config: case.arrays["q"].shape[2] != case.arrays["k"].shape[2]),
        CodePath("a bias or mask", lambda case, config: "bias" in case.arrays or "mask" in case.arrays),
        CodePath(
            "4+ kv blocks",
            lambda case, config: _blocks(_sq_skv(case)[1], _kv_block(config)) >= 4,
            backends=ws,
        ),
        CodePath(
            "warp-specialised forward, second consumer on real rows, causal",
            lambda case, config: config.consumers == 2 and causal(case) and _sq_skv(case)[0] > config.block_q,
            backends=ws,
        ),
        CodePath(
            # the ring's slot arithmetic is mod 3 here, mod 2 in the 2-stage configs:
            # a slot reused one step early shows only with 3
            "warp-specialised forward, a 3-slot ring",
            lambda case, config: config.consumers == 2 and config.max_concurrent_steps == 3,
            backends=ws,
        ),
        CodePath(
            "warp-specialised forward, a consumer of padding only",
            lambda case, config: config.consumers == 2 and _blocks(_sq_skv(case)[0], config.block_q) % 2 == 1,
            backends=ws,
        ),
        CodePath(
            "warp-specialised dk/dv, second consumer on real keys",
            lambda case, config: config.consumers_bwd == 2 and _sq_skv(case)[1] > config.block_kv_bwd,
            backends=ws,
        ),
    )


def _bias_or_mask(case: Case) -> tuple[str, ...]:
    return tuple(a for a in ("bias", "mask") if a in case.arrays) or ("none",)


def _parameters(blocks: Blocks | None) -> tuple[Parameter, ...]:
    """The discrete parameters whose pairs every small-tier run meets (ours only: a
    user's kernel has one config, and its domain may narrow the rest)."""
    if blocks is not None:
        return ()
    return (
        builders.config_parameter(
            lambda config: f"{config.block_q}x{config.block_k}",
            ("16x16", "16x32", "32x16", "32x32"),  # the forward tile: blocks_for(_, (16, 32))
            builders.GENERIC_INTERPRETED,
        ),
        builders.config_parameter(builders.warpgroups, builders.WARPGROUPS, MOSAIC_GPU),
        Parameter("causal", (False, True), lambda case, config: (bool(case.params["causal"]),)),
        Parameter(
            "grouped-query",
            (False, True),
            lambda case, config: (case.arrays["q"].shape[2] != case.arrays["k"].shape[2],),
        ),
        Parameter("bias/mask", ("none", "bias", "mask"), lambda case, config: _bias_or_mask(case)),
        # the logits kinds (a bias drawn "normal" is a normal input too): the bias and
        # mask kinds exist only with a bias or mask, so they pair with "none" never
        Parameter(
            "input kind",
            LOGITS,
            lambda case, config: [k for k in case.kinds if k in LOGITS],
            element_kind=True,
        ),
    )


def make_spec(
    kernel: Callable[..., jax.Array] = attention.attention,
    name: str = "attention",
    *,
    domain: Domain = DOMAIN,
    blocks: Blocks | None = None,
    dtypes: Sequence[str] = strategies.DTYPES,
    differentiable: bool = True,
    backends: Sequence[str] = GENERIC + MOSAIC_GPU,
    bad_inputs: Callable[[], Sequence[BadInput]] | None = None,
) -> KernelSpec:
    """The attention spec for ``kernel`` (any callable with attention.attention's
    signature). ``blocks``: the tiling of a kernel that is not ours (one "config"; the
    default checks ours over its config space)."""

    def run(case: Case, config: Any, backend: Backend) -> jax.Array:
        return kernel(*_qkv(case), config=config, backend=backend, **_inputs(case))

    def run_bound(case: Case, config: Any, backend: Backend) -> np.ndarray:
        return _bound(case, _oracle(case), config, arithmetic_for(backend))

    def configs(case: Case, backend: Backend) -> Sequence[Any]:
        q, k = case.arrays["q"], case.arrays["k"]
        # bias or mask: the Mosaic GPU kernels stream an f32 logit-bias tile (SMEM)
        return attention.configs(
            q.shape[1],
            k.shape[1],
            q.shape[3],
            backend,
            itemsize=q.dtype.itemsize,
            bias="bias" in case.arrays or "mask" in case.arrays,
        )

    shift = (relations.invariance_within_contract("bias_shift", run, _bias_shifted, _oracle, _contract),)
    sliced_oracle, expected, per_slice = attention_slices.sliced(_oracle, lambda ref: ref.out)
    # every bound of one arithmetic: the calls a pass serves together join (one program)
    bounds = per_slice(_bounds, joins=0)

    def bound(case: Case, ref: Any, config: Any, arith: Arithmetic) -> np.ndarray:
        return bounds(case, ref, (("forward", config),), arith)[0]

    def contract(case: Case, ref: Any, arith: Arithmetic) -> np.ndarray:
        """As ``_contract``."""
        return bounds(case, ref, (("forward", Blocks()),), arith)[0]

    def gradient_bound(case: Case, ref: Any, grads: Any, config: Any, arith: Arithmetic) -> dict[str, Any]:
        return bounds(case, ref, (("gradient", config),), arith)[0]

    def gradient_contract(case: Case, ref: Any, grads: Any, arith: Arithmetic) -> dict[str, Any]:
        """The backward's two-pass form, as ``_contract``: one q block and one kv block,
        sums in any order."""
        return bounds(case, ref, (("gradient", Blocks()),), arith)[0]

    return KernelSpec(
        name=name,
        dtypes=dtypes,
        cases=functools.partial(cases, domain=domain),
        production=production.production_cases("attention", LAYOUTS_PRODUCTION, cases, domain),
        production_layouts=LAYOUTS_PRODUCTION,
        kernel=run,
        reference=lambda case: attention.xla_reference(*_qkv(case), **_inputs(case)),
        oracle=sliced_oracle,
        expected=expected,
        bound=bound,
        gradients=GradientSpec(
            functools.partial(_kernel_vjp, kernel),
            per_slice(_oracle_vjp),
            gradient_bound,
            contract=gradient_contract,
            # the bounds take the oracle's forward quantities and the cotangent: each
            # chunk's oracle serves the exact VJP and both bounds in one pass
            bound_reads_gradients=False,
        )
        if differentiable
        else None,
        contract=contract,
        relations=(permutations(run, run_bound),) + (shift if domain.bias else ()),
        adversarial=_adversarial,
        bad_inputs=bad_inputs or _bad_inputs(kernel),
        backends=backends,
        paths=_paths(blocks, domain),
        parameters=_parameters(blocks),
        reference_bytes=_reference_bytes,
        results_on_device_bytes=_results_on_device_bytes,
        **config_fields(blocks, configs, attention.Config(), mosaic_gpu_attention.Config()),
    )


SPEC = make_spec()


# ------------------------------------------------------------------------ builder

LAYOUTS_QKV = {"bshd": (0, 1, 2, 3), "bhsd": (0, 2, 1, 3)}  # ours is bshd; each is its own inverse


def attention_like(
    fn: Callable[..., jax.Array],
    *,
    name: str,
    layout: str = "bshd",
    scale: str | float = "1/sqrt(d)",
    causal: Sequence[bool] = (False,),
    causal_alignment: str = "bottom_right",
    bias: bool = False,
    mask: bool = False,
    gqa: bool = True,
    seq_q: Sequence[int] = SEQ_Q,
    seq_kv: Sequence[int] | None = SEQ_KV,
    head_dims: Sequence[int] = HEAD_DIMS,
    blocks: Blocks = Blocks(),
    dtypes: Sequence[str] = strategies.DTYPES,
    differentiable: bool = True,
    backends: Sequence[str] = GENERIC,
    interpret: str | None = None,
) -> KernelSpec:
    """The spec of a user's attention ``fn(q, k, v, **options) -> out``.

    - ``layout``: "bshd" ([batch, seq, heads, head_dim], ours) or "bhsd", for q, k, v, out;
    - ``scale``: the softmax scale ``fn`` applies: "1/sqrt(d)", "none" (1.0), or a float;
    - ``causal``: the values of ``causal=`` to call it with ((False,): never passed);
      ``causal_alignment`` "top_left" (query i sees keys j <= i) draws causal cases
      with seq_q = seq_kv only, where it and our bottom-right alignment agree;
    - ``bias`` / ``mask``: it takes ``bias=`` (float, broadcasting to [b, h, sq, skv]
      in our layout) / ``mask=`` (bool, True = visible); ``gqa``: fewer kv heads;
    - ``seq_q``, ``seq_kv``, ``head_dims``: the sizes it accepts (e.g. multiples of its
      block); ``seq_kv=None``: only seq_kv = seq_q;
    - ``blocks``: its kv block and backward blocks, the precision of its f32 q.k and
      whether it uses exp2, for the implementation bound;
    - ``backends`` / ``interpret``: see ``builders.call_on``.
    Everything else (oracle, bounds, strategies, gradients, relations) is ours.
    """
    if layout not in LAYOUTS_QKV:
        raise ValueError(f"layout must be one of {tuple(LAYOUTS_QKV)}, got {layout!r}")
    if causal_alignment not in ("bottom_right", "top_left"):
        raise ValueError(f"causal_alignment must be 'bottom_right' or 'top_left', got {causal_alignment!r}")
    if blocks.qk_precision not in ("highest", "default"):
        raise ValueError(f"blocks.qk_precision must be 'highest' or 'default', got {blocks.qk_precision!r}")
    sm_scale = {"1/sqrt(d)": None, "none": 1.0}.get(scale, scale) if isinstance(scale, str) else float(scale)
    if isinstance(sm_scale, str):
        raise ValueError(f"scale must be '1/sqrt(d)', 'none' or a float, got {scale!r}")
    perm = LAYOUTS_QKV[layout]
    passes_causal = True in causal

    def adapted(q, k, v, *, bias=None, mask=None, causal=False, sm_scale=None, config=None, backend=None):
        del sm_scale, config  # the case's sm_scale is the function's convention; blocks are fixed
        options = {"causal": causal} if passes_causal else {}
        if bias is not None:
            options["bias"] = bias
        if mask is not None:
            options["mask"] = mask
        args = [jnp.transpose(x, perm) for x in (q, k, v)]
        return jnp.transpose(builders.call_on(fn, get_backend(backend), backends, interpret, *args, **options), perm)

    domain = Domain(
        heads=HEADS if gqa else tuple(h for h in HEADS if h[1] == h[2]),
        seq_q=tuple(seq_q),
        seq_kv=None if seq_kv is None else tuple(seq_kv),
        head_dims=tuple(head_dims),
        causal=tuple(causal),
        sm_scales=(sm_scale,),
        bias=bias,
        mask=mask,
        causal_square=causal_alignment == "top_left",
    )

    def bad() -> list[BadInput]:
        chosen = builders.checking_backend(backends)
        sq, skv, d = max(seq_q), max(seq_kv or seq_q), max(head_dims)
        q, kv = jnp.ones((1, sq, 2, d), dtypes[-1]), jnp.ones((1, skv, 2, d), dtypes[-1])

        def call(q_, k_, v_):
            return lambda: adapted(q_, k_, v_, backend=chosen)

        return [
            builders.must_refuse("head_dim mismatch", call(q, kv[..., : d // 2], kv[..., : d // 2])),
            builders.must_refuse("k/v lengths differ", call(q, kv, kv[:, : skv // 2])),
        ]

    spec = make_spec(
        adapted,
        name,
        domain=domain,
        blocks=blocks,
        dtypes=dtypes,
        differentiable=differentiable,
        backends=backends,
        bad_inputs=bad,
    )
    return builders.backward_on_backend(spec, interpret)
