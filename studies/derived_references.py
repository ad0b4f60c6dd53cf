"""jax.numpy references of our kernels' arithmetic, and family specs judged by the
bounds derived from them (oracles/derive.py) instead of the hand-derived ones.

Each reference states what the kernel computes and in which order, as a kernel
author would for ``from_reference``: the tiles of a blocked loop are a Python loop
over the blocks (the online softmax of attention and cross-entropy rescales per kv or
vocabulary tile), the dtype each value is rounded to is an explicit cast, and where the
kernel's backward is its own algorithm (flash attention recomputes p from the saved
log-sum-exp; cross-entropy from the saved max and log-sum) the reference carries it as a
``jax.custom_vjp``, whose backward the derivation follows. The family spec keeps its
kernel, cases and float64 oracle; only the bounds of the values, contract and gradient
checks are replaced (``judged``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallascheck.oracles import derive
from pallascheck.oracles.derive import Facts
from pallascheck.oracles.tolerance import SEQUENTIAL, Arithmetic, blocked
from pallascheck.properties.families.derived import CONTRACT
from pallascheck.properties.spec import Case, KernelSpec

F32 = jnp.float32
NEG_INF = -jnp.inf


class Stated(NamedTuple):
    """A case's reference: ``fn(*args)`` and the facts the kernel's config implies; the
    gradients are those of ``args[wrt]`` under ``cotangent``, named ``names``."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    facts: Facts
    wrt: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    # the oracle's output is the reference's value (else an encoding of it: top_k's bits)
    comparable: bool = True


def _blocks(n: int, block: int) -> list[slice]:
    return [slice(s, min(s + block, n)) for s in range(0, n, block)]


# ------------------------------------------------------------------------ attention


def _logits(q, k, bias, visible, sm_scale, cols):
    """f32 logits (b, h, q, cols) at HIGHEST precision, scaled, biased, -inf where hidden."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k[:, cols], precision=lax.Precision.HIGHEST, preferred_element_type=F32) * F32(
        sm_scale
    )
    if bias is not None:
        s = s + bias[..., cols].astype(F32)
    return jnp.where(visible[..., cols], s, NEG_INF)


def _guard(m):
    return jnp.where(m == NEG_INF, 0.0, m)


def attention_reference(
    *, causal: bool, sm_scale: float | None, has_bias: bool, mask: Any, block_k: int, block_q_bwd: int, block_k_bwd: int
) -> Callable[..., Any]:
    """kernels/attention.py: (q, k, v[, bias]) -> out, bshd. Forward: the online softmax
    over kv tiles of ``block_k`` (running max m, sum l, accumulator acc; p rounded to v's
    dtype for the p.v dot), out = acc / l. Backward (custom_vjp): p = exp(s - lse)
    recomputed, delta = sum(out * do) from the stored out, ds = p (do.v - delta); dk and
    dv per q head summed over q tiles of ``block_q_bwd``, then over the GQA group in f32;
    dq summed over kv tiles of ``block_k_bwd``; dbias = ds summed over the axes the
    bias broadcasts along."""

    def prepared(q, k, v, bias):
        b, sq, h, d = q.shape
        skv, hkv = k.shape[1], k.shape[2]
        scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
        kk, vv = jnp.repeat(k, h // hkv, axis=2), jnp.repeat(v, h // hkv, axis=2)
        visible = jnp.ones((sq, skv), bool)
        if causal:
            visible = jnp.arange(skv)[None, :] <= jnp.arange(sq)[:, None] + (skv - sq)
        if mask is not None:
            visible = visible & jnp.asarray(mask)
        visible = jnp.broadcast_to(visible, (b, h, sq, skv))
        bias4 = (
            None
            if bias is None
            else jnp.broadcast_to(bias.reshape((1,) * (4 - bias.ndim) + bias.shape), (b, h, sq, skv))
        )
        return kk, vv, visible, bias4, scale

    def forward(q, k, v, bias):
        kk, vv, visible, bias4, scale = prepared(q, k, v, bias)
        b, sq, h, d = q.shape
        m = jnp.full((b, h, sq, 1), NEG_INF, F32)
        l = jnp.zeros((b, h, sq, 1), F32)
        acc = jnp.zeros((b, h, sq, d), F32)
        for cols in _blocks(k.shape[1], block_k):
            s = _logits(q, kk, bias4, visible, scale, cols)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
            m_safe = _guard(m_new)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe)
            l = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
            acc = alpha * acc + jnp.einsum(
                "bhqk,bkhd->bhqd", p.astype(v.dtype), vv[:, cols], preferred_element_type=F32
            )
            m = m_new
        empty = l == 0.0
        l_safe = jnp.where(empty, 1.0, l)
        out = (acc / l_safe).transpose(0, 2, 1, 3).astype(q.dtype)
        lse = jnp.where(empty, NEG_INF, _guard(m) + jnp.log(l_safe))
        return out, lse

    def backward(q, k, v, bias, out, lse, do):
        kk, vv, visible, bias4, scale = prepared(q, k, v, bias)
        (b, sq, h, d), (skv, hkv) = q.shape, k.shape[1:3]
        delta = jnp.sum(out.astype(F32) * do.astype(F32), axis=-1).transpose(0, 2, 1)[..., None]
        lse0 = _guard(lse)

        def ds_of(rows, cols):
            s = _logits(q[:, rows], kk, None if bias4 is None else bias4[:, :, rows], visible[:, :, rows], scale, cols)
            p = jnp.exp(s - lse0[:, :, rows])
            dp = jnp.einsum("bqhd,bkhd->bhqk", do[:, rows], vv[:, cols], preferred_element_type=F32)
            return p, p * (dp - delta[:, :, rows])

        dk, dv = jnp.zeros((b, skv, h, d), F32), jnp.zeros((b, skv, h, d), F32)
        for rows in _blocks(sq, block_q_bwd):
            p, ds = ds_of(rows, slice(0, skv))
            dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p.astype(do.dtype), do[:, rows], preferred_element_type=F32)
            dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds.astype(q.dtype), q[:, rows], preferred_element_type=F32)
        dk = dk * F32(scale)
        dq = jnp.zeros((b, h, sq, d), F32)
        for cols in _blocks(skv, block_k_bwd):
            _, ds = ds_of(slice(0, sq), cols)
            dq = dq + jnp.einsum("bhqk,bkhd->bhqd", ds.astype(k.dtype), kk[:, cols], preferred_element_type=F32)
        dq = (dq * F32(scale)).transpose(0, 2, 1, 3).astype(q.dtype)
        group = h // hkv
        dk = dk.reshape(b, skv, hkv, group, d).sum(3).astype(k.dtype)
        dv = dv.reshape(b, skv, hkv, group, d).sum(3).astype(v.dtype)
        if bias is None:
            return dq, dk, dv, None
        _, ds = ds_of(slice(0, sq), slice(0, skv))
        shape4 = (1,) * (4 - bias.ndim) + bias.shape
        axes = tuple(a for a in range(4) if shape4[a] == 1)
        dbias = jnp.sum(ds, axis=axes, keepdims=True).reshape(bias.shape).astype(bias.dtype)
        return dq, dk, dv, dbias

    @jax.custom_vjp
    def attention(q, k, v, bias):
        return forward(q, k, v, bias)[0]

    def fwd(q, k, v, bias):
        out, lse = forward(q, k, v, bias)
        return out, (q, k, v, bias, out, lse)

    def bwd(residuals, do):
        return backward(*residuals, do)

    attention.defvjp(fwd, bwd)
    if has_bias:
        return attention
    return lambda q, k, v: attention(q, k, v, None)


def _attention(case: Case, config: Any) -> Stated:
    a, p = case.arrays, case.params
    skv, sq = a["k"].shape[1], a["q"].shape[1]
    fn = attention_reference(
        causal=p["causal"],
        sm_scale=p["sm_scale"],
        has_bias="bias" in a,
        mask=a.get("mask"),
        block_k=getattr(config, "block_k", None) or skv,
        block_q_bwd=getattr(config, "block_q_bwd", None) or sq,
        block_k_bwd=getattr(config, "block_k_bwd", None) or skv,
    )
    args = tuple(a[n] for n in ("q", "k", "v", "bias") if n in a)
    return Stated(fn, args, Facts(), tuple(range(len(args))), ("dq", "dk", "dv", "dbias")[: len(args)])


# ------------------------------------------------------------------------ cross-entropy


class _TokenLoss(NamedTuple):
    losses: Callable[..., Any]  # (z [T, V] f32, labels) -> (loss [T] (0 where ignored), (m, log s))
    dlogits: Callable[..., Any]  # (z, labels, m, log s, g [T]) -> f32 dlogits


def _token_loss(*, label_smoothing: float, ignore_index: int, block_v: int) -> _TokenLoss:
    """kernels/cross_entropy.py per token: the online logsumexp over vocabulary tiles
    of ``block_v`` (running max m, sum s of exp(z - m), target t, sd = sum(z - m)),
    finished as (log s + c1 (m - t)) + c2 (-(sd / V)); its backward
    g ((exp((z - m) - log s) - c1 onehot) - c3), 0 where g is."""
    c1, c2 = (float(np.float32(c)) for c in (1.0 - label_smoothing, label_smoothing))

    def losses(z, labels):
        tokens, vocab = z.shape
        m = jnp.full((tokens, 1), NEG_INF, F32)
        s, t, sd = (jnp.zeros((tokens, 1), F32) for _ in range(3))
        for cols in _blocks(vocab, block_v):
            tile = z[:, cols]
            ids = jnp.arange(vocab)[cols][None, :]
            m_new = jnp.maximum(m, jnp.max(tile, axis=1, keepdims=True))
            old, new = _guard(m), _guard(m_new)
            s = s * jnp.exp(m - new) + jnp.sum(jnp.exp(tile - new), axis=1, keepdims=True)
            t = t + jnp.sum(jnp.where(ids == labels[:, None], tile, 0.0), axis=1, keepdims=True)
            if c2 != 0.0:
                sd = sd + F32(cols.start) * (old - new)
                sd = sd + jnp.sum(tile - new, axis=1, keepdims=True)
            m = m_new
        log_s = jnp.log(s[:, 0])
        loss = log_s
        if c1 != 0.0:
            loss = loss + F32(c1) * (m[:, 0] - t[:, 0])
        if c2 != 0.0:
            loss = loss + F32(c2) * -(sd[:, 0] / F32(vocab))
        return jnp.where(labels == ignore_index, 0.0, loss), (m[:, 0], log_s)

    def dlogits(z, labels, m, log_s, g):
        g = jnp.where(labels == ignore_index, 0.0, g)[:, None]
        ids = jnp.arange(z.shape[1])[None, :]
        d = jnp.exp((z - m[:, None]) - log_s[:, None]) - jnp.where(ids == labels[:, None], F32(c1), 0.0)
        if label_smoothing != 0.0:
            d = d - F32(label_smoothing / z.shape[1])
        return jnp.where(g == 0.0, 0.0, g * d)

    return _TokenLoss(losses, dlogits)


def _reduced(loss, labels, ignore_index: int, reduction: str):
    """kernels/cross_entropy.reduce: f32 losses summed in any order, "mean" over the
    tokens not ignored."""
    if reduction == "none":
        return loss
    total = jnp.sum(loss)
    if reduction == "sum":
        return total
    count = jnp.sum((labels != ignore_index).astype(jnp.int32))
    return total / jnp.maximum(count, 1).astype(F32)


def cross_entropy_reference(
    *, label_smoothing: float, ignore_index: int, reduction: str, block_v: int
) -> Callable[..., Any]:
    """kernels/cross_entropy.py: (logits, labels) -> loss; the per-token loss and its
    backward (rounded to the logits' dtype) as a custom_vjp, then the reduction."""
    parts = _token_loss(label_smoothing=label_smoothing, ignore_index=ignore_index, block_v=block_v)

    @jax.custom_vjp
    def token_losses(z, labels):
        return parts.losses(z.astype(F32), labels)[0]

    def fwd(z, labels):
        loss, (m, log_s) = parts.losses(z.astype(F32), labels)
        return loss, (z, labels, m, log_s)

    def bwd(residuals, g):
        z, labels, m, log_s = residuals
        d = parts.dlogits(z.astype(F32), labels, m, log_s, g)
        return d.astype(z.dtype), np.zeros(labels.shape, jax.dtypes.float0)

    token_losses.defvjp(fwd, bwd)

    def cross_entropy(logits, labels):
        flat = labels.reshape(-1).astype(jnp.int32)
        loss = token_losses(logits.reshape(-1, logits.shape[-1]), flat)
        out = _reduced(loss, flat, ignore_index, reduction)
        return out.reshape(labels.shape) if reduction == "none" else out

    return cross_entropy


def linear_cross_entropy_reference(
    *, label_smoothing: float, ignore_index: int, reduction: str, block_t: int, block_v: int, block_h: int
) -> Callable[..., Any]:
    """kernels/linear_cross_entropy.py: (x [T, H], w [H, V], labels) -> loss. The
    logits z = sum over H chunks of ``block_h`` of x[:, chunk] @ w[chunk] (f32), then
    the cross-entropy kernel's per-token loss. Backward (custom_vjp): dlogits in f32
    rounded to the input dtype; dx summed over vocabulary tiles of ``block_v``, dw over
    token blocks of ``block_t``, each a dot in f32, rounded once to the input dtype."""
    parts = _token_loss(label_smoothing=label_smoothing, ignore_index=ignore_index, block_v=block_v)

    def logits(x, w):
        z = jnp.zeros((x.shape[0], w.shape[1]), F32)
        for chunk in _blocks(x.shape[1], block_h):
            z = z + jnp.dot(x[:, chunk], w[chunk], preferred_element_type=F32)
        return z

    @jax.custom_vjp
    def token_losses(x, w, labels):
        return parts.losses(logits(x, w), labels)[0]

    def fwd(x, w, labels):
        loss, (m, log_s) = parts.losses(logits(x, w), labels)
        return loss, (x, w, labels, m, log_s)

    def bwd(residuals, g):
        x, w, labels, m, log_s = residuals
        d = parts.dlogits(logits(x, w), labels, m, log_s, g).astype(x.dtype)
        dx = jnp.zeros(x.shape, F32)
        for cols in _blocks(w.shape[1], block_v):
            dx = dx + jnp.dot(d[:, cols], w[:, cols].T, preferred_element_type=F32)
        dw = jnp.zeros(w.shape, F32)
        for rows in _blocks(x.shape[0], block_t):
            dw = dw + jnp.dot(x[rows].T, d[rows], preferred_element_type=F32)
        return dx.astype(x.dtype), dw.astype(w.dtype), np.zeros(labels.shape, jax.dtypes.float0)

    token_losses.defvjp(fwd, bwd)

    def linear_cross_entropy(x, w, labels):
        flat = labels.astype(jnp.int32)
        return _reduced(token_losses(x, w, flat), flat, ignore_index, reduction)

    return linear_cross_entropy


def _linear_cross_entropy(case: Case, config: Any) -> Stated:
    a, p = case.arrays, case.params
    (t, h), v = a["x"].shape, a["w"].shape[1]
    fn = linear_cross_entropy_reference(
        label_smoothing=p["label_smoothing"],
        ignore_index=p["ignore_index"],
        reduction=p["reduction"],
        block_t=getattr(config, "block_t", None) or t,
        block_v=getattr(config, "block_v", None) or v,
        block_h=getattr(config, "block_h", None) or h,
    )
    return Stated(fn, (a["x"], a["w"], a["labels"]), Facts(), (0, 1), ("dx", "dw"))


def _cross_entropy(case: Case, config: Any) -> Stated:
    a, p = case.arrays, case.params
    fn = cross_entropy_reference(
        label_smoothing=p["label_smoothing"],
        ignore_index=p["ignore_index"],
        reduction=p["reduction"],
        block_v=getattr(config, "block_v", None) or a["logits"].shape[-1],
    )
    return Stated(fn, (a["logits"], a["labels"]), Facts(), (0,), ("dlogits",))


# ------------------------------------------------------------------------ top-k


def _top_k(case: Case, config: Any) -> Stated:
    """Selection only: the values are copies of the inputs (no arithmetic), the output
    the values and the indices side by side as the spec encodes them."""
    k = case.params["k"]

    def fn(x):
        values, indices = lax.top_k(x, k)
        return jnp.concatenate([values.astype(F32), indices.astype(F32)], axis=-1)

    return Stated(fn, (case.arrays["logits"],), Facts(), comparable=False)


# ------------------------------------------------------------------------ matmul family, norms


def _inputs_dtype(config: Any) -> Facts:
    """A tiled dot: the K loop in blocks of block_k; the backward feeds its dots dz
    rounded to the input dtype (kernels/matmul.py)."""
    return Facts(order=SEQUENTIAL if config is None else blocked(config.block_k), dot_operands="inputs")


def _matmul(case: Case, config: Any) -> Stated:
    from pallascheck.kernels.activations import get_activation

    act, out_dtype = get_activation(case.params["activation"]), case.params["out_dtype"]
    fn = lambda x, y: act(jnp.dot(x, y, preferred_element_type=F32)).astype(out_dtype)  # noqa: E731
    facts = dataclasses.replace(_inputs_dtype(config), out_dtype=out_dtype)
    return Stated(fn, (case.arrays["x"], case.arrays["y"]), facts, (0, 1), ("dx", "dy"))


def _glu(case: Case, config: Any) -> Stated:
    from pallascheck.kernels.activations import get_activation

    act = get_activation(case.params["activation"])

    def fn(x, weights):
        gate = jnp.dot(x, weights[:, 0, :], preferred_element_type=F32)
        up = jnp.dot(x, weights[:, 1, :], preferred_element_type=F32)
        return (act(gate) * up).astype(x.dtype)

    return Stated(fn, (case.arrays["x"], case.arrays["weights"]), _inputs_dtype(config), (0, 1), ("dx", "dweights"))


def _ragged_dot(case: Case, config: Any) -> Stated:
    def fn(lhs, rhs, group_sizes):
        """Each row's product with its group's matrix: every group's product, the row's
        one picked by a gather (the row's group: the group ends at or before it)."""
        ends = jnp.cumsum(group_sizes)
        group = jnp.sum(jnp.arange(lhs.shape[0])[:, None] >= ends[None, :], axis=1)
        products = jnp.einsum("mk,gkn->gmn", lhs, rhs, preferred_element_type=F32)
        # rows past the last group's end are 0 (the kernel writes zeros there)
        return jnp.take_along_axis(products, group[None, :, None], axis=0, mode="fill", fill_value=0)[0].astype(
            lhs.dtype
        )

    a = case.arrays
    return Stated(fn, (a["lhs"], a["rhs"], a["group_sizes"]), _inputs_dtype(config), (0, 1), ("dlhs", "drhs"))


def norm_reference(*, layer: bool, eps: float, names: Sequence[str], block_rows: int) -> Callable[..., Any]:
    """kernels/norms.py over rows of D features, f32: mean = sum(x) / D, c = x - mean
    (layer norm; else c = x), rstd = rsqrt(sum(c c) / D + eps), y = (c rstd) scale +
    offset, stored in x's dtype. Backward (custom_vjp): xhat = c rstd, gs = g scale,
    proj = sum(gs xhat) / D, dx = rstd (gs - sum(gs) / D - xhat proj) (no mean term for
    RMS norm); dscale and doffset: partial sums over blocks of ``block_rows`` rows,
    then the sum of the partials. scale and offset are optional (``names``)."""

    def statistics(x2):
        if layer:
            mean = jnp.sum(x2, axis=1, keepdims=True) / x2.shape[1]
            c = x2 - mean
        else:
            c = x2
        return c, lax.rsqrt(jnp.sum(c * c, axis=1, keepdims=True) / x2.shape[1] + eps)

    def unpack(values):
        a = dict(zip(names, values))
        x = a["x"]
        x2 = x.reshape(-1, x.shape[-1]).astype(F32)
        ones = jnp.ones((x.shape[-1],), F32)
        return a, x, x2, a["scale"].astype(F32) if "scale" in a else ones

    def forward(*values):
        a, x, x2, scale = unpack(values)
        c, rstd = statistics(x2)
        y = (c * rstd) * scale
        if "offset" in a:
            y = y + a["offset"].astype(F32)
        return y.reshape(x.shape).astype(x.dtype)

    def backward(values, g):
        a, x, x2, scale = unpack(values)
        c, rstd = statistics(x2)
        g2 = g.reshape(x2.shape).astype(F32)
        xhat = c * rstd
        gs = g2 * scale
        d = x2.shape[1]
        proj = jnp.sum(gs * xhat, axis=1, keepdims=True) / d
        inner = gs - jnp.sum(gs, axis=1, keepdims=True) / d - xhat * proj if layer else gs - xhat * proj
        grads = {"x": (rstd * inner).reshape(x.shape).astype(x.dtype)}

        def partial_sums(terms):
            partials = [jnp.sum(terms[rows], axis=0) for rows in _blocks(terms.shape[0], block_rows)]
            return jnp.sum(jnp.stack(partials), axis=0)

        if "scale" in a:
            grads["scale"] = partial_sums(g2 * xhat).astype(a["scale"].dtype)
        if "offset" in a:
            grads["offset"] = partial_sums(g2).astype(a["offset"].dtype)
        return tuple(grads[n] for n in names)

    norm = jax.custom_vjp(forward)
    norm.defvjp(lambda *values: (forward(*values), values), backward)
    return norm


def _norm(layer: bool) -> Callable[[Case, Any], Stated]:
    def stated(case: Case, config: Any) -> Stated:
        names = [n for n in ("x", "scale", "offset") if n in case.arrays]
        rows = int(np.prod(case.arrays["x"].shape[:-1]))
        fn = norm_reference(
            layer=layer, eps=case.params["eps"], names=names, block_rows=getattr(config, "block_rows", None) or rows
        )
        return Stated(
            fn, tuple(case.arrays[n] for n in names), Facts(), tuple(range(len(names))), tuple(f"d{n}" for n in names)
        )

    return stated


REFERENCES: dict[str, Callable[[Case, Any], Stated]] = {
    "matmul": _matmul,
    "gated_linear_unit": _glu,
    "ragged_dot": _ragged_dot,
    "rms_norm": _norm(False),
    "layer_norm": _norm(True),
    "attention": _attention,
    "cross_entropy": _cross_entropy,
    "linear_softmax_cross_entropy": _linear_cross_entropy,
    "top_k": _top_k,
}


# ------------------------------------------------------------------------ judged specs


def _masked(d: derive.Derived, i: int) -> np.ndarray:
    return np.where(d.unverifiable[i], np.nan, d.bounds[i])


def judged(spec: KernelSpec, stated: Callable[[Case, Any], Stated]) -> KernelSpec:
    """``spec`` with the bounds of its values, contract and gradient checks derived from
    ``stated(case, config)``: the kernel's facts for a config; for the contract the
    contract's facts (derived_spec.CONTRACT: f32, any order, dots fed in the input dtype)
    over the reference with every loop in one block (config None).

    The spec's oracle computes with exact constants where the reference states the
    kernel's f32 ones (sm_scale, 1 - eps): the bound is the derived one plus the gap
    between the two exact values, |reference - oracle| <= the constants' rounding, by the
    triangle inequality (``reference_gap`` reports its size)."""

    def derived(case: Case, config: Any, arith: Arithmetic, grads: bool) -> derive.Derived:
        s = stated(case, None if config == "contract" else config)
        facts = CONTRACT if config == "contract" else s.facts
        if not grads:
            return derive.derive(s.fn, s.args, facts=facts, arith=arith)
        return derive.derive(
            derive.vjp_function(s.fn, s.wrt),
            s.args + (case.arrays["cotangent"],),
            facts=dataclasses.replace(facts, out_dtype=None),
            arith=arith,
        )

    def bound(case: Case, ref: Any, config: Any, arith: Arithmetic) -> np.ndarray:
        expected = np.asarray(spec.expected(ref), np.float64)
        d = derived(case, config, arith, False)
        gap = reference_gap(d.values[0], expected) if stated(case, None).comparable else 0.0
        return _masked(d, 0).reshape(expected.shape) + gap

    def gradient_bound(case: Case, ref: Any, grads: Any, config: Any, arith: Arithmetic) -> dict[str, np.ndarray]:
        s = stated(case, None)
        d = derived(case, config, arith, True)
        return {
            n: _masked(d, i) + reference_gap(d.values[i], np.asarray(grads[n], np.float64))
            for i, n in enumerate(s.names)
        }

    gradients = spec.gradients and dataclasses.replace(
        spec.gradients,
        bound=gradient_bound,
        contract=lambda case, ref, grads, arith: gradient_bound(case, ref, grads, "contract", arith),
    )
    return dataclasses.replace(
        spec, bound=bound, contract=lambda case, ref, arith: bound(case, ref, "contract", arith), gradients=gradients
    )


def reference_gap(derived_value: np.ndarray, oracle: np.ndarray) -> np.ndarray:
    """|reference's exact value - oracle| (0 where both are the same infinity)."""
    value = np.asarray(derived_value, np.float64).reshape(oracle.shape)
    with np.errstate(invalid="ignore"):
        gap = np.abs(value - oracle)
    return np.where(np.isnan(gap) & (value == oracle), 0.0, gap)
