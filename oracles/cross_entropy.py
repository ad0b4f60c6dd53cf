"""Float64 oracle and error bounds for softmax cross-entropy (kernels/cross_entropy.py).

Convention checked here (PyTorch / Transformer Engine): per token
``loss = lse - (1 - eps) z_y - eps * mean_j z_j`` (= (1-eps)(lse - z_y) + eps(lse -
mean z)); ignored tokens 0; "mean" divides by the non-ignored count (0 if none).

Forward bound (``loss_bound``), replaying the kernel per token in f32 (u = 2^-24,
t = the transcendental relative error, oracles/tolerance.py). Let the vocabulary be
split into D shards (D = 1 unless vocab-parallel), each scanned in tiles of b columns;
m_k is the running max after tile k of a shard (replayed exactly: max is exact), M_d
the shard's max and M the global max. A term j in tile k reaches the sum as
    exp(fl(z_j - m_k)) * prod_{rescales} exp(fl(m_i - m_{i+1}))   [ * exp(fl(M_d - M)) ]
whose exact product is e_j = exp(z_j - M). Each difference rounds (u |difference|),
and an exp that scales its argument (exp2(x log2 e) on Triton) rounds once more, so
the arguments err by at most a_j = 2u[(m_k - z_j) + (M_d - m_k) + (M - M_d)]
(the rescale differences telescope); each of the <= R = tiles - 1 (+1 across shards)
rescales adds an exp (t) and a multiply (u). So term j has relative error
    rho_j = e^{a_j} (1 + t)^{1+R} (1 + u)^R - 1.
The sum runs within a tile (any order: b - 1 additions), then sequentially across
tiles (tiles - 1) and shards (D - 1): depth k = (b - 1) + (tiles - 1) + (D - 1), so
    |s^ - S| <= sum_j rho_j e_j + gamma_k sum_j e_j (1 + rho_j) + (V + R) * floor,
with S = sum e_j >= 1 (the max term is 1). log: |log s^ - log S| <= -log(1 - E/S),
plus t |log s^|. The target logit is exact (one term plus exact zeros); the shifted
sum sd = sum (z_j - M) errs by gamma_k' sum |z_j - M| (``_shifted_sum``). The finish
replays (log s + c1 (M - t)) + c2 (-(sd / V)) with the f32 constants c1 = f32(1-eps),
c2 = f32(eps) carrying their exactly known representation error: every rounding is
relative to a term >= 0, none to |z|. "sum"/"mean": a sum of T f32 terms in unknown
order (gamma_{T-1}) and one division by the count.

``xla_reference`` is the same sum with one tile of all V columns (no rescales) in
unknown order (depth V - 1), then its own finish (lse - c1 t) - c2 (sum z / V):
lse = M + log s rounds once at the size of the logits and the logit sum errs by
gamma_{V-1} sum |z_j|, so its bound grows with |z| and it keeps few digits of the
loss at large logits: within that bound, outside the accuracy contract.

Gradient bound (``gradient_bound``): p_j = exp(fl(fl(z_j - M) - log s^)) with log s^
within E, so its argument errs by E + u (|z_j - M| + |z_j - lse|) (the two
subtractions), a relative error expm1 of that, then t; then d = (p - c1 onehot) - c3 with
c3 = f32(eps / V), times the per-token cotangent g (for "mean" g / count, one f32
division), each step rounding in f32 (oracles/algebra.py), and one rounding to the
logits dtype.

Accuracy contract (``contract_bound``, ``gradient_contract``): what the op allows,
whatever a kernel's tiling. It is the bound above for the canonical backward-stable
algorithm: subtract the row's max from every logit, exp, sum the V terms in any order
(one tile of V columns: gamma_{V-1}, no rescales), log, and finish with the
differences to the max, (log s + c1 (M - z_y)) + c2 (-(sum (z - M)) / V); the
gradient as exp((z - M) - log s). Every rounding is relative to |z - M|, to log s or
to the loss, never to |z|: a kernel whose error grows with the logits' magnitude
(``lse - z_y``, xla_reference) meets its own bound and fails this one. The online
kernel is inside it: its R = tiles - 1 rescales add R (t + u) to a term's relative
error and save R (b - 1) u of summation depth against gamma_{V-1}, and t = 6u <=
(b - 2) u for every block_v >= 16 that Config allows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.oracles import algebra
from pallascheck.oracles.algebra import Bounded, underflow_floor
from pallascheck.oracles.gradients import vjp64
from pallascheck.oracles.tolerance import (
    Arithmetic,
    gamma,
    largest_finite,
    unit_roundoff,
)

F32 = np.float32
U32 = unit_roundoff(F32)


def _f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def reference64(z, labels, *, eps: float, ignore_index: int, reduction: str):
    """The float64 function of the logits z [T, V] (numpy or jax.numpy; labels numpy)."""
    return loss64(z, *label_parts(labels, ignore_index), eps, reduction)


def label_parts(labels: Any, ignore_index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``loss64``'s label arrays: the labels with an ignored token's set to 0, the
    ignored tokens, and the count of the others (at least 1, as float64)."""
    ignored = np.asarray(labels) == ignore_index
    return np.where(ignored, 0, labels), ignored, np.asarray(max(int((~ignored).sum()), 1), dtype=np.float64)


def loss64(z, safe_labels, ignored, count, eps: float, reduction: str):
    """``reference64`` of the labels' parts: ``safe_labels`` (an ignored token's label
    replaced by 0), ``ignored`` and ``count`` (tokens not ignored, at least 1). They
    may be traced arrays: gradients.vjp64 compiles its VJP once per shape, not once
    per case's labels.

    The loss is ``log s + (1 - eps)(M - z_y) + eps mean(M - z)`` with M the row's max
    and s = sum exp(z - M), never ``lse - z_y`` with lse = M + log s rounded: at
    logits of 1e38 float64 spaces 2e22 apart, so M + log s rounds to M and the loss
    of a row whose max is its target and one more logit (exactly ln 2) came out 0.
    M - z_y of two inputs in a format of at most 24 bits is exact in float64 wherever
    it matters (an exponent gap over 29 bits makes it M's own size). M is a shift
    the loss does not depend on: it is held constant for the VJP."""
    xp = np if isinstance(z, np.ndarray) else jnp
    vocab = z.shape[1]
    top = xp.max(z, axis=1, keepdims=True)
    top = xp.where(xp.isfinite(top), top, 0.0)  # a row of -inf: no -inf - -inf
    if xp is jnp:
        top = jax.lax.stop_gradient(top)
    with np.errstate(divide="ignore"):
        loss = xp.log(xp.sum(xp.exp(z - top), axis=1))
    top = top[:, 0]
    if eps != 1.0:  # skipped terms: no 0 * (-inf) for masked logits
        target = xp.take_along_axis(z, safe_labels[:, None], axis=1)[:, 0]
        loss = loss + (1.0 - eps) * (top - target)
    if eps != 0.0:
        loss = loss + eps * xp.sum(top[:, None] - z, axis=1) / vocab
    loss = xp.where(ignored, 0.0, loss)
    if reduction == "none":
        return loss
    total = xp.sum(loss)
    return total if reduction == "sum" else total / count


@dataclasses.dataclass(frozen=True)
class CrossEntropyOracle:
    out: np.ndarray  # float64: the reduced loss (scalar) or per-token losses [T]
    z: np.ndarray  # logits [T, V], float64
    labels: np.ndarray  # [T] int64
    eps: float
    ignore_index: int
    reduction: str
    token_loss: np.ndarray  # [T]

    @property
    def ignored(self) -> np.ndarray:
        return self.labels == self.ignore_index

    @property
    def count(self) -> int:
        return max(int((~self.ignored).sum()), 1)


def oracle(logits: Any, labels: Any, *, eps: float, ignore_index: int, reduction: str) -> CrossEntropyOracle:
    z = _f64(logits).reshape(-1, np.shape(logits)[-1])
    y = np.asarray(labels).astype(np.int64).reshape(-1)
    kw: dict[str, Any] = dict(eps=eps, ignore_index=ignore_index)
    token = reference64(z, y, reduction="none", **kw)
    out = reference64(z, y, reduction=reduction, **kw)
    if reduction == "none":
        out = out.reshape(np.shape(labels))
    return CrossEntropyOracle(_f64(out), z, y, eps, ignore_index, reduction, token)


def _constant(exact: float) -> Bounded:
    """A constant the kernel holds as f32: its representation error is known exactly."""
    value, err = np.float64(exact), np.abs(np.float64(np.float32(exact)) - exact)
    return Bounded(cast(np.ndarray, value), cast(np.ndarray, err))  # numpy scalars, as 0-d arrays


def _log_sum(
    z: np.ndarray, *, arith: Arithmetic, block_v: int | None, shards: int, logit_err: np.ndarray | None = None
) -> tuple[Bounded, Bounded]:
    """(max M, log s) [T] as the kernel (block_v tiles per shard) or XLA (block_v None)
    computes them, s = sum exp(z - M); lse = M + log s.

    ``logit_err`` [T, V]: errors of computed logits (the fused kernel's dot). The
    replay then runs on the computed logits; logsumexp is 1-Lipschitz in the max norm,
    so they add max_j err_j, and every difference in the replay may grow by 2 max_j err_j.
    """
    tokens, vocab = z.shape
    worst = np.zeros(tokens) if logit_err is None else logit_err.max(axis=1)
    local = vocab // shards
    width = local if block_v is None else min(block_v, local)
    tiles = -(-local // width)
    t = arith.transcendental_rel(F32)
    floor = underflow_floor(F32, arith)
    with np.errstate(invalid="ignore", over="ignore"):
        # the last tile's padding is masked to -inf, as in the kernel
        padding = np.full((tokens, shards, tiles * width - local), -np.inf)
        zt = np.concatenate([z.reshape(tokens, shards, local), padding], axis=2).reshape(tokens, shards, tiles, width)
        running = np.maximum.accumulate(zt.max(axis=3), axis=2)  # m_k
        shard_max = running[:, :, -1]  # M_d
        big = shard_max.max(axis=1)  # M
        m_k = running[:, :, :, None]
        args = (
            (m_k - zt) + (shard_max[:, :, None, None] - m_k) + (big[:, None, None, None] - shard_max[:, :, None, None])
        )
        a = 2.0 * U32 * (args + 2.0 * worst[:, None, None, None])
        rescales = (tiles - 1) + (1 if shards > 1 else 0)
        e = np.exp(zt - big[:, None, None, None])
        ulps = (1 + t) ** (1 + rescales) * (1 + U32) ** rescales  # the exps and rescale multiplies
        rho = np.expm1(a) * ulps + (ulps - 1)  # e^a * ulps - 1
        perturbation = np.where(e == 0.0, 0.0, e * rho)
    e_sum = e.sum(axis=(1, 2, 3))
    depth = (width - 1) + (tiles - 1) + (shards - 1)
    err_s = perturbation.sum(axis=(1, 2, 3)) + gamma(depth, U32) * (e_sum + perturbation.sum(axis=(1, 2, 3)))
    err_s = err_s + (vocab + rescales) * floor
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = err_s / e_sum
        log_err = np.where(rel < 1.0, -np.log1p(-np.minimum(rel, 1.0)), np.inf)
    log_value = np.log(e_sum)
    log_err = log_err + t * (np.abs(log_value) + log_err) + floor
    return Bounded(big, worst), Bounded(log_value, log_err)


def _log_sum_exp(
    z: np.ndarray, *, arith: Arithmetic, block_v: int | None, shards: int, logit_err: np.ndarray | None = None
) -> Bounded:
    """lse = M + log s [T], rounded once to f32 (xla_reference's logsumexp)."""
    big, log_s = _log_sum(z, arith=arith, block_v=block_v, shards=shards, logit_err=logit_err)
    return algebra.add(big, log_s, arith=arith)


def _logit_sum(
    z: np.ndarray, *, arith: Arithmetic, block_v: int | None, shards: int, logit_err: np.ndarray | None = None
) -> Bounded:
    tokens, vocab = z.shape
    local = vocab // shards
    width = local if block_v is None else min(block_v, local)
    depth = (width - 1) + (-(-local // width) - 1) + (shards - 1)
    propagated = 0.0 if logit_err is None else logit_err.sum(axis=1)
    magnitude = np.abs(z).sum(axis=1) + propagated
    err = propagated + gamma(depth, U32) * magnitude + (vocab - 1) * underflow_floor(F32, arith)
    err = np.where(magnitude <= largest_finite(F32), err, np.inf)
    return Bounded(z.sum(axis=1), err)


def _shifted_sum(
    z: np.ndarray, big: Bounded, *, arith: Arithmetic, block_v: int, shards: int, logit_err: np.ndarray | None = None
) -> Bounded:
    """sd = sum_j (z_j - M) [T] as the kernel accumulates it (module docstring).

    Every piece added is <= 0: a tile's differences z_j - m_k (one rounding each), the
    re-pivots n (m_k - m_{k+1}) of the columns seen (two roundings: the difference,
    the product) and across shards V_local (M_d - M) (two). The pieces of term j
    telescope to z_j - M, so their magnitudes sum to sum_j |z_j - M|, and no piece
    passes through more than 2 + (b - 1) + 2 tiles + 2 D roundings (its own, the tile's
    sum, two additions per later tile, the shard re-pivot and the psum): that many
    factors (1 + u) bound every piece, gamma_k of the magnitude in all. Computed logits
    (``logit_err``) move each z_j by err_j and M by at most max err."""
    tokens, vocab = z.shape
    local = vocab // shards
    width = min(block_v, local)
    depth = 2 + (width - 1) + 2 * -(-local // width) + (2 * shards if shards > 1 else 0)
    propagated = 0.0 if logit_err is None else logit_err.sum(axis=1) + vocab * big.err
    with np.errstate(invalid="ignore"):
        magnitude = np.abs(z - big.value[:, None]).sum(axis=1) + propagated
    err = propagated + gamma(depth, U32) * magnitude + (vocab - 1) * underflow_floor(F32, arith)
    err = np.where(magnitude <= largest_finite(F32), err, np.inf)
    with np.errstate(invalid="ignore"):
        return Bounded((z - big.value[:, None]).sum(axis=1), err)


def _target(ref: CrossEntropyOracle, logit_err: np.ndarray | None) -> Bounded:
    """z_y [T] (exact: one term plus exact zeros) with the computed logit's error."""
    safe = np.where(ref.ignored, 0, ref.labels)
    err = np.zeros(len(safe)) if logit_err is None else np.take_along_axis(logit_err, safe[:, None], axis=1)[:, 0]
    return Bounded(np.take_along_axis(ref.z, safe[:, None], axis=1)[:, 0], err)


def _negated(b: Bounded) -> Bounded:
    return Bounded(-b.value, b.err)


FINISHES = ("stable", "textbook")


def token_loss_bound(
    ref: CrossEntropyOracle,
    *,
    arith: Arithmetic,
    block_v: int | None,
    shards: int = 1,
    logit_err: np.ndarray | None = None,
    finish: str | None = None,
) -> Bounded:
    """Per-token loss [T] with its error (0 where ignored), before any reduction.

    ``block_v``: the kernel's vocabulary tile (None: xla_reference, one tile in any
    order). ``finish``: "stable", the kernel's (log s + c1 (M - t)) + c2 (-(sd / V)),
    or "textbook", xla_reference's (lse - c1 t) - c2 (sum z / V); default: the
    kernel's for a ``block_v``, xla_reference's for None. ``logit_err``: errors of the
    computed logits (None: the logits are inputs, exact)."""
    finish = finish or ("textbook" if block_v is None else "stable")
    if finish not in FINISHES:
        raise ValueError(f"finish must be one of {FINISHES}, got {finish!r}")
    if finish == "textbook":
        return _textbook_token_loss(ref, arith=arith, block_v=block_v, shards=shards, logit_err=logit_err)
    kw: dict[str, Any] = dict(arith=arith, dtype=F32)
    big, log_s = _log_sum(ref.z, arith=arith, block_v=block_v, shards=shards, logit_err=logit_err)
    loss = log_s
    if np.float32(1.0 - ref.eps) != 0.0:
        gap = algebra.add(big, _negated(_target(ref, logit_err)), **kw)  # m - t >= 0
        loss = algebra.add(loss, algebra.multiply(_constant(1.0 - ref.eps), gap, **kw), **kw)
    if np.float32(ref.eps) != 0.0:
        if block_v is None:
            raise ValueError(
                'finish "stable" with label smoothing models the kernel\'s vocabulary tiles: give a block_v'
            )
        sd = _shifted_sum(ref.z, big, arith=arith, block_v=block_v, shards=shards, logit_err=logit_err)
        mean = algebra.divide(_negated(sd), Bounded.exact(ref.z.shape[1]), **kw)
        loss = algebra.add(loss, algebra.multiply(_constant(ref.eps), mean, **kw), **kw)
    return Bounded(np.where(ref.ignored, 0.0, ref.token_loss), np.where(ref.ignored, 0.0, loss.err))


def _textbook_token_loss(
    ref: CrossEntropyOracle, *, arith: Arithmetic, block_v: int | None, shards: int, logit_err: np.ndarray | None
) -> Bounded:
    """``(lse - c1 z_y) - c2 (sum z / V)`` with lse = M + log s rounded to f32 (its sum
    in tiles of ``block_v``, or one tile in any order for None)."""
    z = ref.z
    vocab = z.shape[1]
    kw: dict[str, Any] = dict(arith=arith, dtype=F32)
    lse = _log_sum_exp(z, arith=arith, block_v=block_v, shards=shards, logit_err=logit_err)
    loss = lse
    target = _target(ref, logit_err)
    if np.float32(1.0 - ref.eps) != 0.0:
        term = algebra.multiply(_constant(1.0 - ref.eps), target, **kw)
        loss = algebra.add(loss, Bounded(-term.value, term.err), **kw)
    if np.float32(ref.eps) != 0.0:
        total = _logit_sum(z, arith=arith, block_v=block_v, shards=shards, logit_err=logit_err)
        mean = algebra.divide(total, Bounded.exact(vocab), **kw)
        term = algebra.multiply(_constant(ref.eps), mean, **kw)
        loss = algebra.add(loss, Bounded(-term.value, term.err), **kw)
    return Bounded(np.where(ref.ignored, 0.0, ref.token_loss), np.where(ref.ignored, 0.0, loss.err))


def loss_bound(
    ref: CrossEntropyOracle,
    *,
    arith: Arithmetic,
    block_v: int | None,
    shards: int = 1,
    logit_err: np.ndarray | None = None,
    finish: str | None = None,
) -> np.ndarray:
    """|kernel - oracle| for the reduced (or per-token) loss; see the module docstring
    and ``token_loss_bound``."""
    token = token_loss_bound(ref, arith=arith, block_v=block_v, shards=shards, logit_err=logit_err, finish=finish)
    if ref.reduction == "none":
        return token.err.reshape(np.shape(ref.out))
    kw: dict[str, Any] = dict(arith=arith, dtype=F32)
    total = _sum_tokens(token, arith)
    if ref.reduction == "mean":
        total = algebra.divide(total, Bounded.exact(float(ref.count)), **kw)
    return np.asarray(total.err)


def _sum_tokens(token: Bounded, arith: Arithmetic) -> Bounded:
    """sum over T f32 terms, order unknown (XLA reduce): gamma_{T-1}."""
    n = token.value.shape[0]
    magnitude = token.magnitude.sum()
    err = token.err.sum() + gamma(max(n - 1, 0), U32) * magnitude + max(n - 1, 0) * underflow_floor(F32, arith)
    bounded = err if magnitude <= largest_finite(F32) else np.inf
    return Bounded(cast(np.ndarray, np.float64(token.value.sum())), cast(np.ndarray, bounded))  # scalars, as 0-d arrays


def token_cotangent(ref: CrossEntropyOracle, cotangent: Any, arith: Arithmetic) -> Bounded:
    """The per-token cotangent the backward kernel receives, with its f32 error."""
    g = _f64(cotangent)
    tokens = ref.z.shape[0]
    if ref.reduction == "none":
        value = g.reshape(tokens)
        err = np.zeros(tokens)
    elif ref.reduction == "sum":
        value, err = np.full(tokens, float(g)), np.zeros(tokens)
    else:  # d(total / count) = g / count: one f32 division
        value = np.full(tokens, float(g) / ref.count)
        err = U32 * np.abs(value) + underflow_floor(F32, arith)
    return Bounded(np.where(ref.ignored, 0.0, value), np.where(ref.ignored, 0.0, err))


def oracle_vjp(ref: CrossEntropyOracle, cotangent: Any) -> dict[str, np.ndarray]:
    g = _f64(cotangent).reshape(-1) if ref.reduction == "none" else _f64(cotangent)
    (dz,) = vjp64(
        loss64, (ref.z,), g, constants=label_parts(ref.labels, ref.ignore_index), static=(ref.eps, ref.reduction)
    )
    return {"dlogits": dz}


def dlogits_f32(
    ref: CrossEntropyOracle,
    cotangent: Any,
    *,
    arith: Arithmetic,
    block_v: int | None,
    shards: int = 1,
    logit_err: np.ndarray | None = None,
) -> Bounded:
    """dlogits [T, V] as the backward kernel computes it in f32, before its rounding."""
    z = ref.z
    vocab = z.shape[1]
    kw: dict[str, Any] = dict(arith=arith, dtype=F32)
    t = arith.transcendental_rel(F32)
    big, log_s = _log_sum(z, arith=arith, block_v=block_v, shards=shards, logit_err=logit_err)
    with np.errstate(invalid="ignore", over="ignore"):
        shifted = z - big.value[:, None]
        # never z - (M + log s): at logits of 1e38 that sum rounds to M in float64
        p = np.exp(shifted - log_s.value[:, None])
        # fl(fl(z - m) - log s): each difference rounds once, log s errs by its bound,
        # computed logits move z by err_j and m by at most big.err
        arg_err = log_s.err[:, None] * (1 + U32) + U32 * (np.abs(shifted) + np.abs(shifted - log_s.value[:, None]))
        if logit_err is not None:
            arg_err = arg_err + (logit_err + big.err[:, None]) * (1 + 2.0 * U32)
        rel = np.expm1(arg_err) * (1 + t) + t
        p_err = np.where(p == 0.0, 0.0, p * rel) + underflow_floor(F32, arith)
    d = Bounded(p, p_err)
    onehot = (np.arange(vocab)[None, :] == np.where(ref.ignored, -1, ref.labels)[:, None]).astype(np.float64)
    if ref.eps != 1.0:
        c1 = _constant(1.0 - ref.eps)
        d = algebra.add(d, Bounded(-onehot * c1.value, onehot * c1.err), **kw)
    if np.float32(ref.eps / vocab) != 0.0:
        c3 = _constant(ref.eps / vocab)
        d = algebra.add(d, Bounded(np.full_like(p, -c3.value), np.full_like(p, c3.err)), **kw)
    g = token_cotangent(ref, cotangent, arith)
    d = algebra.multiply(Bounded(g.value[:, None], g.err[:, None]), d, **kw)
    return Bounded(np.where(ref.ignored[:, None], 0.0, d.value), np.where(ref.ignored[:, None], 0.0, d.err))


def contract_bound(ref: CrossEntropyOracle, *, arith: Arithmetic, logit_err: np.ndarray | None = None) -> np.ndarray:
    """The accuracy contract of the loss (module docstring): ``loss_bound`` of the
    max-shifted algorithm with one tile of all V columns summed in any order."""
    return loss_bound(ref, arith=arith, block_v=ref.z.shape[1], logit_err=logit_err)


def gradient_contract(
    ref: CrossEntropyOracle, cotangent: Any, *, logits_dtype: Any, arith: Arithmetic
) -> dict[str, np.ndarray]:
    """The accuracy contract of dlogits: ``gradient_bound`` of the same algorithm."""
    return gradient_bound(ref, cotangent, logits_dtype=logits_dtype, arith=arith, block_v=ref.z.shape[1])


def gradient_bound(
    ref: CrossEntropyOracle,
    cotangent: Any,
    *,
    logits_dtype: Any,
    arith: Arithmetic,
    block_v: int | None,
    shards: int = 1,
) -> dict[str, np.ndarray]:
    """Bound on dlogits [T, V] of the backward kernel; see the module docstring."""
    d = dlogits_f32(ref, cotangent, arith=arith, block_v=block_v, shards=shards)
    out = algebra.round_to(d, logits_dtype, arith)
    return {"dlogits": np.where(ref.ignored[:, None], 0.0, out.err)}
