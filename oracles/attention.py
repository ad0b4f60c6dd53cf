"""Float64 oracle and error bounds for flash attention (kernels/attention.py).

Notation per (batch, q head h, query i): s_j = sm_scale (q . k_j) + bias_j the exact
logits over the visible keys j, M = max_j s_j, L = sum_j exp(s_j - M) (>= 1),
p_j = exp(s_j - M) / L, o = sum_j p_j v_j. u = unit roundoff (oracles/tolerance.py),
t = the f32 exp/log accuracy (``Arithmetic.transcendental_rel``).

Forward bound (kernel), derived from the ratio the kernel forms. The kernel's
out = acc / l with acc = sum_j w^N_j v_j and l = sum_j w^D_j where, up to a factor c
common to all j (the running-max shifts cancel in the ratio; c >= exp(-E) with
E = max_j e_j), w^N_j = L p_j (1 + dN_j) and w^D_j = L p_j (1 + dD_j). For any such
relative errors
    out - o = [sum_j p_j dN_j v_j - o sum_j p_j dD_j] / [1 + sum_j p_j dD_j]
so |out - o| <= [sum_j p_j |dN_j| |v_j| + |o| sum_j p_j |dD_j|] / (1 - sum_j p_j |dD_j|).
The per-key errors, step by step:
1. logit error e_j: the q.k dot over head_dim (products exact for bf16/f16 in f32;
   f32 at precision HIGHEST, never tf32; ``algebra.dot``, order unknown inside one MMA
   tile: sequential), times sm_scale rounded to f32 (its representation error is known
   exactly) with one rounding, plus the bias with one rounding.
2. max subtraction and rescaling: s_j - m rounds with error <= u32 |s_j - m| and
   m_block <= m_final <= M + E, so <= u32 (M - s_j + e_j + E); the rescale factors
   alpha = exp(m_old - m_new) applied to key j after its block have arguments whose
   roundings telescope to the same bound: argument error a_j = e_j + 2 u32 (M - s_j + e_j + E);
   exp turns it into the relative error expm1(a_j), and its evaluation adds t.
3. each of at most R = ceil(seq_kv / block_k) - 1 rescales multiplies acc and l by
   alpha, evaluated to t and rounded (u32): ((1 + t)(1 + u32))^R - 1.
4. numerator only: p rounded to the input dtype (u_in; none for f32) and the p.v dot:
   operands rounded to tf32 on GPU (2u + u^2), accumulated in blocks of block_k
   (``Arithmetic.dot_order``: sequential chain on GPU) with the MMA's unit.
5. denominator only: l sums f32 p in blocks of block_k: gamma of the blocked depth.
6. underflow: a rounded p below the smallest normal may be flushed (error
   <= min(p, floor)), in final units <= min(exp(s_j - M + e_j + E), floor) e^E / L
   per key, times |v_j|; subnormal v may be read as 0 (p_j |v_j| lost).
7. out = acc / l in f32: modelled at the exp/log accuracy t, since Triton may emit
   PTX's approximate division (div.full.f32, within 2 ulp); then one rounding to the
   output dtype (``round_to``).
All relative errors compose exactly ((1+a)(1+b) - 1), never by dropping products.

xla_reference (plain jnp in the input dtype): the same ratio, with its own steps: the
f32 logit dot times the f32 sm_scale rounds once to the input dtype and the bias adds
there (one rounding); s - m rounds in the input dtype; exp is
evaluated in f32 and rounded (t + u_in); l = jnp.sum in f32 (sequential, unknown
order) rounded once (u_in, common to all keys); p = e / l rounds (u_in, numerator);
the p.v dot accumulates in f32 (sequential) and rounds to the input dtype; e and p
may each underflow (twice the floor term of step 6).

Gradient bound (kernel's backward; derivation beside ``gradient_bound``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.oracles import algebra, numeric
from pallascheck.oracles.algebra import Bounded
from pallascheck.oracles.gradients import vjp64
from pallascheck.oracles.numeric import f64, xp
from pallascheck.oracles.tolerance import (
    SEQUENTIAL,
    Arithmetic,
    blocked,
    gamma,
    unit_roundoff,
)

F32 = xp.float32


def _einsum(spec: str, *operands: Any) -> Any:
    # numpy's einsum without ``optimize`` loops in C without BLAS: at s = 4096 one
    # [b, h, s, s] contraction took 2 s; with it, a BLAS matmul (float64 either way)
    return xp.einsum(spec, *operands, optimize=True)


def causal_visible(
    seq_q: int, seq_kv: int, *, first_row: Any = 0, rows: int | None = None, keys: int | None = None
) -> np.ndarray:
    """[rows, keys] bool: which of the first ``keys`` keys (None: all seq_kv) the query
    rows ``first_row`` .. ``first_row + rows`` of a case of ``seq_q`` queries see under
    the causal mask, aligned bottom-right (query i sees keys j <= i + seq_kv - seq_q).
    ``first_row`` may be a traced scalar: a chunk of rows sees exactly the visibility
    of its rows in the whole case (properties/families/attention_slices.py)."""
    rows = seq_q if rows is None else rows
    keys = seq_kv if keys is None else keys
    return xp.arange(keys)[None, :] <= xp.arange(rows)[:, None] + first_row + (seq_kv - seq_q)


def key_prefix(x: Any, axis: int, keys: int, *, stand_in: str) -> Any:
    """The first ``keys`` entries of ``x`` along its key ``axis`` and one more, the
    stand-in for the rest, for a chunk of query rows that sees none of the rest (its
    causal mask; ``chunk``): the rest contribute nothing to its values and bounds but
    the terms every unseen key gets (a rounding's underflow floor), which the stand-in
    gets as they do, and dq's bound, which sums such a term times |k_j| over all keys:
    it is linear in |k_j|, so the stand-in of k (``stand_in="magnitude"``) is the sum of
    |k_j| over the rest; of v, a bias and a mask "zero" (0, False)."""
    head = jax.lax.slice_in_dim(x, 0, keys, axis=axis)
    rest = jax.lax.slice_in_dim(x, keys, x.shape[axis], axis=axis)
    if stand_in == "magnitude":  # in float64, as the oracle reads it (exactly)
        head, tail = f64(head), xp.sum(xp.abs(f64(rest)), axis=axis, keepdims=True)
    elif stand_in == "zero":
        tail = xp.zeros_like(jax.lax.slice_in_dim(x, 0, 1, axis=axis))
    else:
        raise ValueError(f"stand_in must be 'magnitude' or 'zero', got {stand_in!r}")
    return xp.concatenate([head, tail], axis=axis)


def visibility(batch: int, heads: int, seq_q: int, seq_kv: int, *, causal: bool, mask: Any) -> np.ndarray:
    """[batch, heads, seq_q, seq_kv] bool: causal (bottom-right) and the mask."""
    vis = xp.ones((batch, heads, seq_q, seq_kv), bool)
    if causal:
        vis &= causal_visible(seq_q, seq_kv)
    if mask is not None:
        vis &= xp.broadcast_to(xp.asarray(mask, bool).reshape((1,) * (4 - xp.ndim(mask)) + xp.shape(mask)), vis.shape)
    return vis


def _bhsd(x, group: int, xp):
    """[b, s, h, d] -> [b, h*group, s, d] (kv heads repeated for their q-head group)."""
    x = xp.transpose(x, (0, 2, 1, 3))
    return xp.repeat(x, group, axis=1) if group > 1 else x


def reference64(q, k, v, bias, visible, sm_scale: float):
    """The float64 function (numpy or jax.numpy inputs; used for values and VJPs).
    q: [b, sq, h, d]; k, v: [b, skv, hkv, d]; bias broadcastable to [b, h, sq, skv]
    or None; ``visible`` also excludes -inf bias. Rows with no visible key give 0."""
    xp = np if isinstance(q, np.ndarray) else jnp
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = _bhsd(q, 1, xp), _bhsd(k, group, xp), _bhsd(v, group, xp)
    s = sm_scale * xp.einsum("bhqd,bhkd->bhqk", qh, kh, optimize=True)
    if bias is not None:
        s = s + bias
    s = xp.where(visible, s, 0.0)
    any_visible = visible.any(axis=-1, keepdims=True)
    m = xp.where(any_visible, xp.max(xp.where(visible, s, -xp.inf), axis=-1, keepdims=True), 0.0)
    if xp is jnp:
        m = jax.lax.stop_gradient(m)  # softmax is shift invariant
    e = xp.where(visible, xp.exp(xp.where(visible, s - m, 0.0)), 0.0)
    l = xp.sum(e, axis=-1, keepdims=True)
    p = e / xp.where(l == 0, 1.0, l)
    return xp.transpose(xp.einsum("bhqk,bhkd->bhqd", p, vh, optimize=True), (0, 2, 1, 3))


@numeric.pytree("sm_scale", "group", "has_bias", "bias_shape", "whole_seq_q", "whole_bias_shape", "whole_seq_kv")
@dataclasses.dataclass(frozen=True)
class AttentionOracle:
    out: np.ndarray  # [b, sq, h, d] float64
    visible: np.ndarray  # [b, h, sq, skv]: causal, mask, and bias != -inf
    qk: np.ndarray  # [b, h, sq, skv] exact q . k (unscaled), 0 where not visible
    qk_magnitude: np.ndarray  # sum_d |q_d k_d|
    qk_flushed: np.ndarray  # the part of it from products with a subnormal factor
    bias: np.ndarray  # [b, h, sq, skv], 0 where not visible (or no bias)
    s: np.ndarray  # exact logits, 0 where not visible
    p: np.ndarray  # exact softmax, 0 where not visible
    row_max: np.ndarray  # M [b, h, sq, 1] (0 for rows with no visible key)
    row_sum: np.ndarray  # L = sum exp(s - M) [b, h, sq, 1] (1 for empty rows)
    q: np.ndarray  # [b, h, sq, d]
    k: np.ndarray  # [b, h, skv, d] (kv heads repeated per group)
    v: np.ndarray  # [b, h, skv, d]
    o: np.ndarray  # [b, h, sq, d]
    sm_scale: float
    group: int
    has_bias: bool
    bias_shape: tuple[int, ...] | None
    # A chunk of query rows (``chunk``): the first row's index in the whole case (a
    # scalar, traced on the device), the whole case's seq_q and bias shape (a bias
    # with query rows has the chunk's in ``bias_shape``); None: the whole case.
    first_row: Any = None
    whole_seq_q: int | None = None
    whole_bias_shape: tuple[int, ...] | None = None
    # A chunk that sees a prefix of the keys (``key_prefix``: its arrays hold the
    # prefix and the stand-in for the rest): the whole case's seq_kv; None: every key.
    whole_seq_kv: int | None = None


def chunk(
    ref: AttentionOracle,
    first_row: Any,
    seq_q: int,
    bias_shape: tuple[int, ...] | None,
    seq_kv: int | None = None,
) -> AttentionOracle:
    """``ref``, the oracle of query rows ``first_row`` .. of a case of ``seq_q`` query
    rows and a bias of ``bias_shape``, marked as such: ``oracle_vjp`` and
    ``gradient_bound`` then take those rows of the whole case's q, cotangent and bias,
    and return the results that sum over query rows as ``RowSums`` (the chunks' parts
    add; ``finish`` applies what depends on the whole sum). ``seq_kv``: ``ref`` was
    computed over a prefix of the case's ``seq_kv`` keys and the stand-in for the rest
    (``key_prefix``); the bounds count the whole case's keys, ``oracle_vjp`` cuts the
    whole case's k, v and bias so, and the results with a key axis come back whole,
    the stand-in's result for every key of the rest."""
    return dataclasses.replace(
        ref, first_row=first_row, whole_seq_q=seq_q, whole_bias_shape=bias_shape, whole_seq_kv=seq_kv
    )


def _seq_kv(ref: AttentionOracle) -> int:
    """The whole case's number of keys (a chunk's arrays may hold a prefix of them)."""
    return ref.k.shape[2] if ref.whole_seq_kv is None else ref.whole_seq_kv


def _prefix_keys(ref: AttentionOracle, x: Any, axis: int, stand_in: str) -> Any:
    """The whole case's ``x`` cut to ``ref``'s keys along its key ``axis`` (x itself
    where ``ref`` sees every key, or where x broadcasts along that axis)."""
    if ref.whole_seq_kv is None or x is None or x.shape[axis] == 1:
        return x
    return key_prefix(x, axis, ref.k.shape[2] - 1, stand_in=stand_in)


def _whole_keys(ref: AttentionOracle, x: Any, axis: int) -> Any:
    """A result of ``ref``'s keys along ``axis`` (the prefix, then the stand-in) with
    every key of the whole case: the stand-in's entry for each key of the rest."""
    if ref.whole_seq_kv is None or x.shape[axis] == 1:
        return x
    axis = axis % x.ndim
    keys = x.shape[axis] - 1
    head = jax.lax.slice_in_dim(x, 0, keys, axis=axis)
    tail = jax.lax.slice_in_dim(x, keys, keys + 1, axis=axis)
    shape = x.shape[:axis] + (ref.whole_seq_kv - keys,) + x.shape[axis + 1 :]
    return xp.concatenate([head, xp.broadcast_to(tail, shape)], axis=axis)


def _query_rows(ref: AttentionOracle, x: Any, axis: int) -> Any:
    """The chunk's rows of the whole case's ``x`` along its query ``axis`` (x itself
    for a whole case, or where x broadcasts along that axis)."""
    if ref.first_row is None or x.shape[axis] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, ref.first_row, ref.q.shape[2], axis)


def _bias_rows(ref: AttentionOracle, bias: Any) -> Any:
    """The chunk's rows of a bias in its own shape (broadcasting to [b, h, sq, skv],
    so its query axis, if it has one, is its second to last)."""
    return bias if bias is None or bias.ndim < 2 else _query_rows(ref, bias, bias.ndim - 2)


def _sums_over_query_rows(bias_shape: tuple[int, ...]) -> bool:
    """Whether a bias of ``bias_shape`` broadcasts over the query rows of a chunked
    case, so that its gradient sums over the chunks (else each chunk has its rows)."""
    return len(bias_shape) < 2 or bias_shape[-2] == 1


class RowSums:
    """A result that is a sum over query rows, held in parts that chunks of rows add
    (sums of exact values and of non-negative magnitudes); ``finish()`` applies the
    factors of the whole sum (its accumulation depth, term count, scaling, rounding)."""

    def finish(self) -> Any:
        raise NotImplementedError


@numeric.pytree()
@dataclasses.dataclass(frozen=True)
class _Summed(RowSums):
    """An exact float64 sum: the chunks' sums add."""

    value: Any

    def finish(self) -> Any:
        return self.value


def _finished(ref: AttentionOracle, x: Any) -> Any:
    """A chunk keeps its row sums for the chunks to add; a whole case finishes them."""
    return x.finish() if isinstance(x, RowSums) and ref.first_row is None else x


def oracle(q, k, v, *, bias=None, mask=None, causal: bool = False, sm_scale: float | None = None) -> AttentionOracle:
    q64, k64, v64 = f64(q), f64(k), f64(v)
    b, sq, h, d = q64.shape
    skv = k64.shape[1]
    group = h // k64.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    vis = visibility(b, h, sq, skv, causal=causal, mask=mask)
    bias64 = xp.zeros((b, h, sq, skv))
    if bias is not None:
        raw = f64(bias)
        bias64 = xp.broadcast_to(raw.reshape((1,) * (4 - raw.ndim) + raw.shape), vis.shape).copy()
        vis &= xp.isfinite(bias64) | (bias64 > 0)  # -inf bias masks the key
        bias64 = xp.where(vis, bias64, 0.0)
    out = reference64(q64, k64, v64, bias64 if bias is not None else None, vis, scale)
    qh, kh, vh = _bhsd(q64, 1, xp), _bhsd(k64, group, xp), _bhsd(v64, group, xp)
    qk = xp.where(vis, _einsum("bhqd,bhkd->bhqk", qh, kh), 0.0)
    qk_mag = xp.where(vis, _einsum("bhqd,bhkd->bhqk", xp.abs(qh), xp.abs(kh)), 0.0)
    sub = algebra.subnormal_part
    flushed = xp.where(
        vis,
        _einsum("bhqd,bhkd->bhqk", sub(qh, F32), xp.abs(kh)) + _einsum("bhqd,bhkd->bhqk", xp.abs(qh), sub(kh, F32)),
        0.0,
    )
    s = xp.where(vis, scale * qk + bias64, 0.0)
    any_vis = vis.any(-1, keepdims=True)
    m = xp.where(any_vis, xp.max(xp.where(vis, s, -xp.inf), -1, keepdims=True), 0.0)
    e = xp.where(vis, xp.exp(xp.where(vis, s - m, 0.0)), 0.0)
    l_sum = e.sum(-1, keepdims=True)
    p = e / xp.where(l_sum == 0, 1.0, l_sum)
    return AttentionOracle(
        out=out,
        visible=vis,
        qk=qk,
        qk_magnitude=qk_mag,
        qk_flushed=flushed,
        bias=bias64,
        s=s,
        p=p,
        row_max=m,
        row_sum=xp.where(l_sum == 0, 1.0, l_sum),
        q=qh,
        k=kh,
        v=vh,
        o=xp.transpose(out, (0, 2, 1, 3)),
        sm_scale=scale,
        group=group,
        has_bias=bias is not None,
        bias_shape=None if bias is None else tuple(xp.shape(bias)),
    )


def _compose(*rels: Any) -> np.ndarray:
    """(1 + a)(1 + b)... - 1 for nonnegative relative error bounds."""
    total = xp.ones_like(xp.asarray(rels[0], dtype=xp.float64))
    for r in rels:
        total = total * (1.0 + xp.asarray(r, dtype=xp.float64))
    return total - 1.0


def _masked(ref: AttentionOracle, x: np.ndarray) -> np.ndarray:
    return xp.where(ref.visible, x, 0.0)


def logits(
    ref: AttentionOracle,
    *,
    dtype: Any,
    arith: Arithmetic,
    compute_dtype: Any,
    kernel: bool,
    qk_highest: bool = True,
    log2e: bool = False,
) -> Bounded:
    """Step 1: s_hat = (q.k) * sm_scale (+ bias): the dot and the scaling in f32, then
    one rounding to ``compute_dtype`` (none for f32) where the bias adds;
    the kernel's dot accumulates in f32 with f32 operands never rounded to tf32
    (precision HIGHEST; ``qk_highest=False``: a kernel whose f32 q.k runs at the
    backend's default precision, tf32 on NVIDIA GPUs); xla_reference's dot runs at
    default precision and rounds to its dtype. ``log2e``: the kernel evaluates exp2 of
    logits scaled by log2(e) (rounded to f32), before the max or after the shift: the
    constant's representation and the product's rounding add <= 2 u32 |s_j| or
    2 u32 (M - s_j) to each logit, in natural units; both are charged."""
    if kernel and qk_highest:
        arith = dataclasses.replace(arith, matmul_input_f32="float32")
    qk = algebra.dot(
        ref.qk,
        ref.qk_magnitude,
        ref.q.shape[-1],
        arith=arith,
        operand_dtype=dtype,
        order=SEQUENTIAL,
        flushed_magnitude=ref.qk_flushed,
    )
    scale_rep = float(np.asarray(ref.sm_scale, dtype=F32).astype(np.float64))
    scale = Bounded(xp.full_like(ref.qk, ref.sm_scale), xp.full_like(ref.qk, abs(scale_rep - ref.sm_scale)))
    s = algebra.multiply(qk, scale, arith=arith, dtype=F32)
    if xp.dtype(compute_dtype) != xp.float32:
        s = algebra.round_to(s, compute_dtype, arith)
    if ref.has_bias:
        s = algebra.add(s, Bounded.exact(ref.bias), arith=arith, dtype=compute_dtype)
    err = s.err
    if log2e:
        err = err + 2.0 * unit_roundoff(F32) * (xp.abs(ref.s) + xp.abs(ref.row_max - ref.s))
    return Bounded(ref.s, _masked(ref, err))


def _row_max(x: np.ndarray, visible: np.ndarray) -> np.ndarray:
    return xp.max(xp.where(visible, x, 0.0), axis=-1, keepdims=True)


def _ratio_error(ref: AttentionOracle, d_num: np.ndarray, d_den: np.ndarray, floor: np.ndarray) -> np.ndarray:
    """[sum_j p_j dN_j |v_j| + floor_j |v_j| + |o| sum_j p_j dD_j] / (1 - sum_j p_j dD_j),
    in [b, h, sq, d]."""
    p = ref.p
    absv = xp.abs(ref.v)
    num = _einsum("bhqk,bhkd->bhqd", p * d_num + floor, absv)
    den = xp.sum(p * d_den, axis=-1, keepdims=True)
    with xp.errstate(divide="ignore", invalid="ignore"):
        return xp.where(den < 1.0, (num + xp.abs(ref.o) * den) / (1.0 - den), xp.inf)


def _floor_weights(ref: AttentionOracle, e: np.ndarray, e_max: np.ndarray, floor: float) -> np.ndarray:
    """Step 6: per-key absolute underflow loss in units of the final normalisation."""
    with xp.errstate(over="ignore"):
        p_up = xp.exp(xp.minimum(ref.s - ref.row_max + e + e_max, 0.0))
        return _masked(ref, xp.minimum(p_up, floor) * xp.exp(e_max) / ref.row_sum)


def _flushed_v(ref: AttentionOracle, arith: Arithmetic, dtype: Any) -> np.ndarray | float:
    if not arith.flush_subnormals:
        return 0.0
    return _einsum("bhqk,bhkd->bhqd", ref.p, algebra.subnormal_part(ref.v, F32))


def _to_bshd(x: np.ndarray) -> np.ndarray:
    return xp.transpose(x, (0, 2, 1, 3))


def bound(
    ref: AttentionOracle,
    *,
    dtype: Any,
    arith: Arithmetic,
    block_k: int | None,
    qk_highest: bool = True,
    log2e: bool = False,
) -> np.ndarray:
    """|out - oracle| for [b, sq, h, d]: the kernel with ``block_k`` (steps 1-7 of the
    module docstring), or xla_reference in ``dtype`` when ``block_k`` is None;
    ``qk_highest``, ``log2e``: see ``logits``."""
    dtype = xp.dtype(dtype)
    skv = _seq_kv(ref)
    u32, u_in, t = unit_roundoff(F32), unit_roundoff(dtype), arith.transcendental_rel(F32)
    kernel = block_k is not None
    compute = F32 if kernel else dtype
    s = logits(ref, dtype=dtype, arith=arith, compute_dtype=compute, kernel=kernel, qk_highest=qk_highest, log2e=log2e)
    e = s.err
    e_max = _row_max(e, ref.visible)
    gap = _masked(ref, ref.row_max - ref.s + e + e_max)  # >= m_hat - s_hat_j >= 0
    u_op = arith.operand_unit(dtype)
    operand_rel = 2.0 * u_op + u_op * u_op
    if block_k is not None:  # the kernel
        arg = e + 2.0 * u32 * gap
        d_exp = _compose(xp.expm1(arg), t)
        rescales = max(-(-skv // block_k) - 1, 0)
        d_res = ((1.0 + t) * (1.0 + u32)) ** rescales - 1.0
        p_round = u_in if dtype != xp.float32 else 0.0
        acc_gamma = arith.gamma(arith.dot_order(block_k).depth(skv), arith.mma_unit())
        l_gamma = arith.gamma(blocked(block_k).depth(skv), u32)
        d_num = _compose(d_exp, d_res, p_round, operand_rel, acc_gamma)
        d_den = _compose(d_exp, d_res, l_gamma)
        floor = _floor_weights(
            ref, e, e_max, algebra.underflow_floor(dtype, arith) + algebra.underflow_floor(F32, arith)
        )
    else:
        arg = e + u_in * gap
        d_exp = _compose(xp.expm1(arg), t, u_in)
        dot_gamma = arith.gamma(SEQUENTIAL.depth(skv), arith.mma_unit())
        d_num = _compose(d_exp, u_in, operand_rel, dot_gamma)
        d_den = _compose(d_exp, arith.gamma(SEQUENTIAL.depth(skv), u32), u_in)
        floor = 2.0 * _floor_weights(ref, e, e_max, algebra.underflow_floor(dtype, arith))
    err = _ratio_error(ref, _masked(ref, d_num), _masked(ref, d_den), floor) + _flushed_v(ref, arith, dtype)
    out = Bounded(ref.o, err)
    if kernel:  # acc / l in f32, at the accuracy of an approximate division (see step 7)
        out = Bounded(ref.o, err + t * (xp.abs(ref.o) + err))
    return _unbounded_not_nan(_to_bshd(algebra.round_to(out, dtype, arith).err))


def _unbounded_not_nan(err: np.ndarray) -> np.ndarray:
    """Where an unbounded intermediate met an exact zero (inf * 0), the bound is NaN;
    it means "no bound", so it is reported as inf (never a silent NaN comparison)."""
    return xp.where(xp.isnan(err), xp.inf, err)


def oracle_vjp(ref: AttentionOracle, q, k, v, bias, cotangent) -> dict[str, Any]:
    """dq, dk, dv (and dbias in the bias's own shape) of sum(out * cotangent), float64.
    For a chunk of query rows (``chunk``; q, bias, cotangent are the whole case's): its
    rows' dq (and dbias, where the bias has rows), and dk, dv (and a dbias that
    broadcasts over rows) as ``RowSums`` of its rows' terms."""
    vis = ref.visible
    scale = ref.sm_scale
    # whether the bias has query rows is a fact of the whole case's (a chunk may have one row)
    summed = bias is not None and _sums_over_query_rows(tuple(bias.shape))
    q, cotangent, bias = _query_rows(ref, q, 1), _query_rows(ref, cotangent, 1), _bias_rows(ref, bias)
    k, v = _prefix_keys(ref, k, 1, "magnitude"), _prefix_keys(ref, v, 1, "zero")
    bias = None if bias is None else _prefix_keys(ref, bias, bias.ndim - 1, "zero")
    if bias is None:
        dq, dk, dv = vjp64(_without_bias, (q, k, v), cotangent, constants=(vis,), static=(scale,))
        dbias = None
    else:
        raw = xp.where(xp.isfinite(f64(bias)), f64(bias), 0.0)  # -inf entries are masked: no gradient
        dq, dk, dv, dbias = vjp64(_with_bias, (q, k, v, raw), cotangent, constants=(vis,), static=(scale,))
    dk, dv = _whole_keys(ref, dk, 1), _whole_keys(ref, dv, 1)
    grads = {"dq": dq, "dk": _Summed(dk), "dv": _Summed(dv)}
    if dbias is not None:
        dbias = _whole_keys(ref, dbias, -1)
        grads["dbias"] = _Summed(dbias) if summed else dbias
    return {key: _finished(ref, g) for key, g in grads.items()}


def _without_bias(q, k, v, visible, scale: float):
    return reference64(q, k, v, None, visible, scale)


def _with_bias(q, k, v, bias, visible, scale: float):
    full = jnp.broadcast_to(bias.reshape((1,) * (4 - bias.ndim) + bias.shape), visible.shape)
    return reference64(q, k, v, full, visible, scale)


@dataclasses.dataclass(frozen=True)
class Forward:
    """What a bound of the forward pass knows of its tiling (``bound``'s keywords): the
    kernel's kv block (None: xla_reference's model), the logit facts."""

    block_k: int | None
    qk_highest: bool = True
    log2e: bool = False


@dataclasses.dataclass(frozen=True)
class Backward:
    """What a bound of the kernel's backward pass knows of its tiling (``gradient_bound``'s
    keywords): the backward's q and kv blocks, the forward's kv block, the logit facts."""

    block_q: int
    block_k: int
    block_k_forward: int
    qk_highest: bool = True
    log2e: bool = False


def gradient_bound(
    ref: AttentionOracle,
    cotangent: Any,
    forward_bound: np.ndarray,
    *,
    dtype: Any,
    arith: Arithmetic,
    block_q: int,
    block_k: int,
    block_k_forward: int,
    qk_highest: bool = True,
    log2e: bool = False,
) -> dict[str, Any]:
    """Bounds on dq, dk, dv (and dbias) of the kernel's backward pass; for a chunk of
    query rows (``chunk``) its rows' dq (and dbias, where the bias has rows), and the
    bounds that sum over q rows (dk, dv, a dbias broadcast over rows) as ``RowSums``.

    With dO the cotangent, P_ij the exact softmax, dP_ij = dO_i . v_j,
    delta_i = dO_i . o_i and dS_ij = P_ij (dP_ij - delta_i), replayed per step:
    - lse = m + log(l) from the forward: |lse_hat - lse| <= E (log-sum-exp is
      1-Lipschitz in the max norm of the logit errors) + -log(1 - sum_j P_j dD_j) (l's
      relative errors of steps 2, 3, 5 weighted by P, as in the forward's ratio) + the
      log's evaluation t |log l| + one f32 rounding of the sum;
    - P_hat = exp(s_hat - lse_hat): argument error e_ij + err(lse_i) + u32 |s_ij - lse_i|
      (the subtraction; 3 u32 |s_ij - lse_i| for a kernel that takes exp2 of the shift
      times log2(e)), relative error expm1(.) and t for exp, plus the f32 floor;
    - dP: the dO.v dot over head_dim (``algebra.dot``); delta: XLA's f32 rowsum of
      dO * out_hat over head_dim: sum_d |dO| err(out) + gamma_D(u32) sum_d |dO|(|o| + err(out));
    - dS = P_hat (dP_hat - delta_hat): one subtraction and one product in f32;
    - dv = sum_i round(P_hat) dO_i, dk = sm_scale sum_i round(dS)_ij q_i (rounding to
      the input dtype, none for f32), accumulated over q in blocks of ``block_q``
      (``Arithmetic.dot_order``); with GQA, the group's f32 partials add group - 1
      steps to the chain. dq = sm_scale sum_j round(dS)_ij k_j over kv in blocks of
      ``block_k``. Operands rounded by the hardware (tf32) add 2u + u^2 per product;
      propagated operand errors add sum err(a) |b|. sm_scale is the f32 value (its
      representation error is known) and its product rounds; each result rounds once
      to the input dtype.
    - dbias: XLA's f32 sum of the unrounded dS over the dimensions the bias broadcasts
      along (n terms, sequential), rounded once to the bias dtype.
    The bounds of the sums over q rows are sums over rows of non-negative terms
    (propagated errors, magnitudes) and of exact values, times factors of the whole sum
    (gamma of the chain over all sq rows, sq * group underflow floors, sm_scale, the
    output rounding): chunks of rows add the sums, and ``RowSums.finish`` applies the
    factors once, so a chunked bound is the whole one up to float64 reassociation.
    """
    backward = Backward(block_q, block_k, block_k_forward, qk_highest, log2e)
    shared = _exact_backward(ref, cotangent, dtype=dtype, arith=arith)
    return _gradient_bound(ref, shared, forward_bound, backward, dtype=dtype, arith=arith)


def bounds(
    ref: AttentionOracle, cotangent: Any, asks: Sequence[Forward | Backward], *, dtype: Any, arith: Arithmetic
) -> list[Any]:
    """The bound of each of ``asks``, in order: ``bound`` of a ``Forward`` (a kernel's
    tiling, xla_reference's model, the contract's one block), ``gradient_bound`` of a
    ``Backward`` (with the forward bound of its forward kv block and logit facts); the
    same values, with the work they share done once. A forward bound is computed once
    for every ask that reads it: the values' bound and contract are the forward bounds
    the gradient bound and its contract read, five forward bounds a chunk where three
    differ. The backward's work that no tiling changes is done once too: dP = dO . v^T
    and its magnitude, and the sums over q rows and over keys of the exact dS and P and
    of their absolute values (``_exact_backward``: 8 of the 12 [G, rows, keys]
    contractions of one gradient bound; each tiling adds the 3 of the errors). On the
    device each ask's [G, rows, keys] arrays are computed after the ask before it has
    finished (an optimization barrier, which also keeps XLA from holding one ask's
    arrays for the next), so a program of several holds those of one, the shared ones
    and the forward bounds ([G, rows, d]: attention_slices' docstring has the bytes)."""
    forwards: dict[Forward, Any] = {}
    shared: dict[str, Any] | None = None
    results: list[Any] = []
    for ask in asks:
        this = ref
        if numeric.active_device() is not None:
            this, shared, _ = jax.lax.optimization_barrier((ref, shared, results[-1:]))
        backward: Backward | None = None
        if isinstance(ask, Backward):
            backward, forward = ask, Forward(ask.block_k_forward, ask.qk_highest, ask.log2e)
        else:
            forward = ask
        if forward not in forwards:
            forwards[forward] = bound(
                this,
                dtype=dtype,
                arith=arith,
                block_k=forward.block_k,
                qk_highest=forward.qk_highest,
                log2e=forward.log2e,
            )
        if backward is None:
            results.append(forwards[forward])
            continue
        if shared is None:
            shared = _exact_backward(this, cotangent, dtype=dtype, arith=arith)
        results.append(_gradient_bound(this, shared, forwards[forward], backward, dtype=dtype, arith=arith))
    return results


def _grouped(ref: AttentionOracle, x: Any) -> Any:
    """[b, h, ...] as [b, kv heads, group, ...]."""
    return x.reshape((x.shape[0], x.shape[1] // ref.group, ref.group) + x.shape[2:])


def _sum_products(ref: AttentionOracle, weights: Any, other: Any, over_q: bool) -> Any:
    """The sum over q rows and the group's q heads (over_q: [b, kv heads, keys, d]) or
    over keys ([b, h, rows, d]) of weights * other."""
    if over_q:
        # other first: as the left operand of ``bngqk,bngqd->bnkd`` XLA:CPU copied the
        # [G, rows, keys] weights transposed (keys major) before the dot, half its time
        summed = _einsum("bngqd,bngqk->bndk", _grouped(ref, other), _grouped(ref, weights))
        return xp.swapaxes(summed, -1, -2)
    return _einsum("bhqk,bhkd->bhqd", weights, other)


def _exact_backward(ref: AttentionOracle, cotangent: Any, *, dtype: Any, arith: Arithmetic) -> dict[str, Any]:
    """What no tiling changes in ``gradient_bound``: the chunk's rows of dO ([b, h,
    rows, d]), dP (exact, and its dot's error bound), delta's exact value, and for each
    gradient the sums of the exact weights (dS for dq and dk, P for dv) times the other
    operand ("value") and of their absolute values times its absolute value ("size")."""
    do = f64(_query_rows(ref, cotangent, 1)).transpose(0, 2, 1, 3)  # [b, h, rows, d]
    absdo = xp.abs(do)
    vh = ref.v
    dp_exact = _einsum("bhqd,bhkd->bhqk", do, vh)
    dp = algebra.dot(
        dp_exact,
        _einsum("bhqd,bhkd->bhqk", absdo, xp.abs(vh)),
        ref.q.shape[3],
        arith=arith,
        operand_dtype=dtype,
        order=SEQUENTIAL,
    )
    delta_exact = xp.sum(do * ref.o, axis=-1, keepdims=True)
    # dS's exact value, as ``_gradient_bound``'s algebra forms it (add, then multiply)
    ds = _masked(ref, ref.p * (dp.value + -delta_exact))
    absds = xp.abs(ds)
    return {
        "do": do,
        "dp": dp.value,
        "dp_err": dp.err,
        "delta": delta_exact,
        "dq": _sum_products(ref, ds, ref.k, False),
        "dq_size": _sum_products(ref, absds, xp.abs(ref.k), False),
        "dk": _sum_products(ref, ds, ref.q, True),
        "dk_size": _sum_products(ref, absds, xp.abs(ref.q), True),
        "dv": _sum_products(ref, ref.p, do, True),
        "dv_size": _sum_products(ref, ref.p, absdo, True),  # P >= 0
    }


def _gradient_bound(
    ref: AttentionOracle,
    shared: dict[str, Any],
    forward_bound: np.ndarray,
    backward: Backward,
    *,
    dtype: Any,
    arith: Arithmetic,
) -> dict[str, Any]:
    """``gradient_bound`` of one tiling, from ``_exact_backward``'s ``shared`` part."""
    dtype = xp.dtype(dtype)
    u32, t = unit_roundoff(F32), arith.transcendental_rel(F32)
    vis = ref.visible
    # a chunk of rows (``chunk``): its own rows, in sums over q the whole case's sq
    sq = ref.q.shape[2] if ref.whole_seq_q is None else ref.whole_seq_q
    skv, d = _seq_kv(ref), ref.q.shape[3]
    do = shared["do"]
    absdo = xp.abs(do)
    rounds = dtype != xp.float32
    floor32 = algebra.underflow_floor(F32, arith)

    # lse and P
    s = logits(
        ref,
        dtype=dtype,
        arith=arith,
        compute_dtype=F32,
        kernel=True,
        qk_highest=backward.qk_highest,
        log2e=backward.log2e,
    )
    e = s.err
    e_max = _row_max(e, vis)
    gap = _masked(ref, ref.row_max - ref.s + e + e_max)
    rescales = max(-(-skv // backward.block_k_forward) - 1, 0)
    d_den = _masked(
        ref,
        _compose(
            xp.expm1(2.0 * u32 * gap),
            t,
            ((1.0 + t) * (1.0 + u32)) ** rescales - 1.0,
            arith.gamma(blocked(backward.block_k_forward).depth(skv), u32),
        ),
    )
    weighted = xp.sum(ref.p * d_den, axis=-1, keepdims=True)
    lse = ref.row_max + xp.log(ref.row_sum)
    with xp.errstate(divide="ignore"):
        log_l_err = xp.where(weighted < 1.0, -xp.log1p(-weighted), xp.inf)
    lse_err = e_max + log_l_err + t * (xp.log(ref.row_sum) + log_l_err)
    lse_err = lse_err + u32 * (xp.abs(lse) + lse_err) + floor32
    # exp2 of the log2(e)-scaled shift: the constant's representation and the product's
    # rounding add 2 u32 |s - lse| more (in natural units) to the subtraction's one
    shift_roundings = 3.0 if backward.log2e else 1.0
    arg = _masked(ref, e + lse_err + shift_roundings * u32 * xp.abs(ref.s - lse))
    with xp.errstate(invalid="ignore"):  # p = 0 (underflow) with an unbounded factor: 0
        p_err = _masked(ref, xp.where(ref.p == 0, 0.0, ref.p * _compose(xp.expm1(arg), t)) + floor32)
    p_hat = Bounded(ref.p, p_err)

    # dP, delta, dS
    dp = Bounded(shared["dp"], shared["dp_err"])
    out_err = xp.transpose(forward_bound, (0, 2, 1, 3))
    delta_err = xp.sum(absdo * out_err, -1, keepdims=True) + gamma(d, u32) * xp.sum(
        absdo * (xp.abs(ref.o) + out_err), -1, keepdims=True
    )
    centered = algebra.add(dp, Bounded(-shared["delta"], delta_err), arith=arith, dtype=F32)
    ds = algebra.multiply(p_hat, centered, arith=arith, dtype=F32)
    ds = Bounded(_masked(ref, ds.value), _masked(ref, ds.err))

    def rounded(x: Bounded) -> Bounded:
        return algebra.round_to(x, dtype, arith) if rounds else x

    def sums(name: str, err: Any, other: Any, over_q: bool) -> tuple[Any, Any, Any]:
        """The sums over the dot's reduction of the exact weights times ``other``
        (``shared``), of the weights' errors times |other| and of their magnitudes
        (|exact| + error) times |other| (``_DotSums`` bounds the kernel's dot from them)."""
        propagated = _sum_products(ref, err, xp.abs(other), over_q)
        value, size = shared[name], shared[f"{name}_size"]
        if over_q:  # [b, kv heads, keys, d]: every key of the whole case
            value, size, propagated = (_whole_keys(ref, x, 2) for x in (value, size, propagated))
        return value, propagated, size + propagated

    q_depth = int(arith.dot_order(backward.block_q).depth(sq)) + ref.group - 1
    kv_depth = int(arith.dot_order(backward.block_k).depth(skv))
    ds_err = rounded(ds).err
    common = dict(arith=arith, dtype=dtype)
    over_q = dict(common, depth=q_depth, terms=ref.group * sq)  # a dot's terms may each underflow twice

    bounds: dict[str, Any] = {
        "dq": _DotSums(
            *sums("dq", ds_err, ref.k, False), **common, depth=kv_depth, terms=skv, sm_scale=ref.sm_scale
        ).finish(),
        "dk": _DotSums(*sums("dk", ds_err, ref.q, True), **over_q, sm_scale=ref.sm_scale),
        "dv": _DotSums(*sums("dv", rounded(p_hat).err, do, True), **over_q, sm_scale=None),
    }
    if ref.has_bias:
        if ref.bias_shape is None:
            raise ValueError("AttentionOracle: has_bias without a bias_shape")
        # the axes it broadcasts along are the whole case's (a chunk may have one row)
        whole_bias = ref.bias_shape if ref.whole_bias_shape is None else ref.whole_bias_shape
        shape = (1,) * (4 - len(whole_bias)) + tuple(whole_bias)
        whole = ds.value.shape[:2] + (sq, skv)
        axes = tuple(a for a in range(4) if shape[a] == 1 and whole[a] != 1)
        ds_parts = (ds.value, ds.err, ds.magnitude)
        if axes:
            value, err, magnitude = (_whole_keys(ref, x.sum(axes, keepdims=True), -1) for x in ds_parts)
            total = _BiasSums(
                value,
                err,
                magnitude,
                **common,
                terms=math.prod(whole[a] for a in axes),
                shape=tuple(ref.bias_shape[:-1]) + (whole_bias[-1],),
            )
            # a bias with query rows has each chunk's rows: only a sum over rows waits
            bounds["dbias"] = total if 2 in axes else total.finish()
        else:
            err = algebra.round_to(ds, dtype, arith).err.reshape(ref.bias_shape)
            bounds["dbias"] = _whole_keys(ref, _unbounded_not_nan(err), -1)
    return {key: _finished(ref, value) for key, value in bounds.items()}


@numeric.pytree("arith", "dtype", "depth", "terms", "sm_scale")
@dataclasses.dataclass(frozen=True)
class _DotSums(RowSums):
    """The bound on a dot the kernel's backward accumulates (dq over kv; dk, dv over
    q rows and the group's q heads), from the sums over its reduction of the weights'
    exact values, errors (``propagated``) and magnitudes, times |other|: the chain of
    ``depth`` additions errs by gamma_depth of the (operand-rounded) magnitudes, each of
    its ``terms`` products and additions may underflow, then the product with the f32
    ``sm_scale`` (None: none) rounds, and the result rounds to ``dtype``."""

    value: Any
    propagated: Any
    magnitude: Any
    arith: Arithmetic
    dtype: Any
    depth: int
    terms: int
    sm_scale: float | None

    def finish(self) -> np.ndarray:
        arith, magnitude = self.arith, self.magnitude
        u_op = arith.operand_unit(self.dtype)
        operand_rel = 2.0 * u_op + u_op * u_op
        chain = arith.gamma(self.depth, arith.mma_unit()) * xp.ones_like(magnitude)
        with xp.errstate(invalid="ignore"):  # an unbounded chain times an empty sum is 0
            summed = xp.where(magnitude == 0, 0.0, chain * (1.0 + operand_rel) * magnitude)
        floor = 2 * self.terms * algebra.underflow_floor(F32, arith)
        x = Bounded(self.value, self.propagated + operand_rel * magnitude + summed + floor)
        if self.sm_scale is not None:  # the f32 sm_scale: its representation error is known
            scale32 = float(xp.float32(self.sm_scale))
            sc = Bounded(xp.full_like(x.value, self.sm_scale), xp.full_like(x.value, abs(scale32 - self.sm_scale)))
            x = algebra.multiply(x, sc, arith=arith, dtype=F32)
        return _unbounded_not_nan(_to_bshd(algebra.round_to(x, self.dtype, arith).err))


@numeric.pytree("arith", "dtype", "terms", "shape")
@dataclasses.dataclass(frozen=True)
class _BiasSums(RowSums):
    """The bound on dbias, XLA's f32 sum of the unrounded dS over the ``terms``
    elements a bias broadcasts along (sequential), rounded once to the bias dtype,
    from the sums of dS's exact values, errors and magnitudes; in the bias's ``shape``."""

    value: Any
    err: Any
    magnitude: Any
    arith: Arithmetic
    dtype: Any
    terms: int
    shape: tuple[int, ...]

    def finish(self) -> np.ndarray:
        steps = max(self.terms - 1, 0)
        err = (
            self.err
            + gamma(steps, unit_roundoff(F32)) * self.magnitude
            + steps * algebra.underflow_floor(F32, self.arith)
        )
        return _unbounded_not_nan(
            algebra.round_to(Bounded(self.value, err), self.dtype, self.arith).err.reshape(self.shape)
        )
