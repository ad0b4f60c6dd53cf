"""Float64 oracle and error bounds for the fused linear cross-entropy
(kernels/linear_cross_entropy.py).

The logits z = x @ w are exact in float64. The kernel forms every logit tile as an
f32 dot of H terms: the matmul bound (oracles/algebra.py ``dot``: operands exact
for bf16/f16, tf32-rounded f32 on the GPU; gamma of the accumulation depth, blocked
by ``block_h`` on the interpreters and one chain on the GPU, times |x| @ |w|) gives
every logit's error. The cross-entropy bound (oracles/cross_entropy.py) then runs
with those logit errors: logsumexp is 1-Lipschitz in the max norm, the target logit
carries its own error, the logit sum carries the sum of them.

Gradients: the backward kernels recompute dlogits in f32 exactly as the
cross-entropy backward does (``dlogits_f32`` with the logit errors), round it to the
input dtype (the dot operands share a dtype), then
    dx = dlogits @ w^T  (V terms; one MMA per vocabulary tile, tiles in sequence)
    dw = x^T @ dlogits  (T terms; one MMA per token block, blocks in sequence)
each bounded as err(dlogits) @ |w|^T (resp. |x|^T @ err(dlogits)) plus the dot's own
accumulation error and one rounding to the output dtype.
``xla_reference`` (one XLA dot of unknown order, then cross-entropy in f32) is the
same model with sequential orders and one vocabulary tile.

Accuracy contract (``contract_bound``, ``gradient_contract``): logits from a dot of H
terms in any order (gamma_{H-1} |x| @ |w|, with the backend's product precision for
f32 inputs: tf32 on NVIDIA GPUs at default precision), then cross-entropy's contract
(oracles/cross_entropy.py) on those logits; for dx and dw, the contract's dlogits
contracted with dots of V (resp. T) terms in any order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pallascheck.oracles import algebra
from pallascheck.oracles import cross_entropy as ce_oracle
from pallascheck.oracles.algebra import Bounded
from pallascheck.oracles.gradients import vjp64
from pallascheck.oracles.tolerance import SEQUENTIAL, Arithmetic


def _f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyOracle:
    ce: ce_oracle.CrossEntropyOracle  # of the exact logits x @ w
    x: np.ndarray
    w: np.ndarray
    magnitude: np.ndarray  # |x| @ |w|
    flushed_magnitude: np.ndarray

    @property
    def out(self) -> np.ndarray:
        return self.ce.out


def oracle(x: Any, w: Any, labels: Any, *, eps: float, ignore_index: int, reduction: str) -> LinearCrossEntropyOracle:
    x64, w64 = _f64(x), _f64(w)
    ref = ce_oracle.oracle(x64 @ w64, labels, eps=eps, ignore_index=ignore_index, reduction=reduction)
    flushed = algebra.subnormal_part(x64) @ np.abs(w64) + np.abs(x64) @ algebra.subnormal_part(w64)
    return LinearCrossEntropyOracle(ref, x64, w64, np.abs(x64) @ np.abs(w64), flushed)


def _logit_err(
    ref: LinearCrossEntropyOracle, *, operand_dtype: Any, arith: Arithmetic, block_h: int | None
) -> np.ndarray:
    order = arith.dot_order(block_h) if block_h else SEQUENTIAL
    return algebra.dot(
        ref.ce.z,
        ref.magnitude,
        ref.x.shape[1],
        arith=arith,
        operand_dtype=operand_dtype,
        order=order,
        flushed_magnitude=ref.flushed_magnitude,
    ).err


def loss_bound(ref: LinearCrossEntropyOracle, *, operand_dtype: Any, arith: Arithmetic, config: Any) -> np.ndarray:
    """|kernel - oracle|; ``config`` None bounds xla_reference."""
    block_h = None if config is None else config.block_h
    block_v = None if config is None else config.block_v
    err = _logit_err(ref, operand_dtype=operand_dtype, arith=arith, block_h=block_h)
    return ce_oracle.loss_bound(ref.ce, arith=arith, block_v=block_v, logit_err=err)


def contract_bound(ref: LinearCrossEntropyOracle, *, operand_dtype: Any, arith: Arithmetic) -> np.ndarray:
    """The accuracy contract of the loss (module docstring)."""
    err = _logit_err(ref, operand_dtype=operand_dtype, arith=arith, block_h=None)
    return ce_oracle.contract_bound(ref.ce, arith=arith, logit_err=err)


def _loss64(x: Any, w: Any, safe_labels: Any, ignored: Any, count: Any, eps: float, reduction: str) -> Any:
    """The loss of the logits x @ w (cross_entropy.loss64), module-level so that
    gradients.vjp64 compiles its VJP once per shape."""
    return ce_oracle.loss64(x @ w, safe_labels, ignored, count, eps, reduction)


def oracle_vjp(ref: LinearCrossEntropyOracle, cotangent: Any) -> dict[str, np.ndarray]:
    c = ref.ce
    g = _f64(cotangent).reshape(-1) if c.reduction == "none" else _f64(cotangent)
    dx, dw = vjp64(
        _loss64,
        (ref.x, ref.w),
        g,
        constants=ce_oracle.label_parts(c.labels, c.ignore_index),
        static=(c.eps, c.reduction),
    )
    return {"dx": dx, "dw": dw}


def gradient_contract(
    ref: LinearCrossEntropyOracle, cotangent: Any, *, operand_dtype: Any, arith: Arithmetic
) -> dict[str, np.ndarray]:
    """The accuracy contract of dx and dw (module docstring): every blocked order of
    ``gradient_bound`` replaced by one tile in any order."""
    tokens, hidden = ref.x.shape
    return gradient_bound(
        ref,
        cotangent,
        operand_dtype=operand_dtype,
        arith=arith,
        block_h=None,
        block_v=ref.w.shape[1],
        block_t=tokens,
        any_order=True,
    )


def gradient_bound(
    ref: LinearCrossEntropyOracle,
    cotangent: Any,
    *,
    operand_dtype: Any,
    arith: Arithmetic,
    block_h: int | None,
    block_v: int,
    block_t: int,
    any_order: bool = False,
) -> dict[str, np.ndarray]:
    """dx, dw of the backward kernels with these blocks (``any_order``: every dot one
    chain in unknown order, as for the contract)."""
    err = _logit_err(ref, operand_dtype=operand_dtype, arith=arith, block_h=block_h)
    d = ce_oracle.dlogits_f32(ref.ce, cotangent, arith=arith, block_v=block_v, logit_err=err)
    d = algebra.round_to(d, operand_dtype, arith)  # the dot operand
    x, w = ref.x, ref.w
    d_abs, d_sub = d.magnitude, algebra.subnormal_part(d.value)

    def contract(propagated, magnitude, flushed, exact, n, block, out_dtype):
        order = SEQUENTIAL if any_order else arith.dot_order(block)
        dot = algebra.dot(
            exact, magnitude, n, arith=arith, operand_dtype=operand_dtype, order=order, flushed_magnitude=flushed
        )
        return algebra.round_to(Bounded(exact, dot.err + propagated), out_dtype, arith).err

    exact = oracle_vjp(ref, cotangent)
    w_abs, x_abs = np.abs(w), np.abs(x)
    mm = algebra.matmul  # d's error and magnitude may be unbounded where a weight is 0
    dx = contract(
        mm(d.err, w_abs.T),
        mm(d_abs, w_abs.T),
        mm(d_sub, w_abs.T) + mm(d_abs, algebra.subnormal_part(w).T),
        exact["dx"],
        w.shape[1],
        block_v,
        operand_dtype,
    )
    dw = contract(
        mm(x_abs.T, d.err),
        mm(x_abs.T, d_abs),
        mm(algebra.subnormal_part(x).T, d_abs) + mm(x_abs.T, d_sub),
        exact["dw"],
        x.shape[0],
        block_t,
        operand_dtype,
    )
    return {"dx": dx, "dw": dw}
