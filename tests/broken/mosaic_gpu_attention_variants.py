"""Deliberately broken Mosaic GPU flash-attention variants for the sensitivity meta-test.

Each variant swaps one step function of ``kernels/mosaic_gpu_attention.py`` through
``attention.make_attention(mosaic_bodies=Bodies(...))``: a copy of the real step with
one line changed, so the tiling, the TMA pipeline, the custom_vjp wiring and the public
signature stay the real ones and the harness must catch the bug from the numbers.
The Mosaic GPU steps run only on the Mosaic GPU backends (see ``NOT_ON``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallascheck.kernels import attention
from pallascheck.kernels import mosaic_gpu_attention as mga
from pallascheck.kernels.backends import MOSAIC_GPU, Backend
from pallascheck.kernels.mosaic_gpu_attention import (
    Bodies,
    as_lhs,
    guard_neg_inf,
    mma,
    mma_onto,
    rows_of,
)
from pallascheck.properties.families.attention import make_spec


def _kv_blocks_without_diagonal(t, q_block):
    """kv_blocks_seen, but a causal q block stops before its diagonal kv block."""
    total = pl.cdiv(t.seq_kv, t.block_kv)
    if not t.causal:
        return total
    last_col = jnp.minimum((q_block + 1) * t.block_q, t.seq_q) + t.offset  # exclusive
    return jnp.clip(lax.div(last_col + t.block_kv - 1, t.block_kv) - 1, 0, total)  # BUG: - 1


def _forward_step_missing_rescale(t, pipe, r, step, carry):
    """forward_step without the alpha rescale of the accumulator."""
    m, l, acc = carry
    slot = pipe.slot(step)
    kv_start = pipe.block(step) * t.block_kv
    pipe["k"].wait(slot)
    s = mma(r.q, pipe["k"].tile(slot).transpose((1, 0)), (t.block_q, t.block_kv), pipe.qk_issued)
    bias = None
    if t.bias_dims is not None:
        pipe["bias"].wait(slot)
        bias = plgpu.load(pipe["bias"].tile(slot), layout=plgpu.Layout.WGMMA)
    s = t.logits(s, r.q_start, kv_start, bias)
    m_new = jnp.maximum(m, s.max(axis=1))
    m_safe = guard_neg_inf(m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - rows_of(m_safe, s.shape, 0))
    l = alpha * l + p.sum(axis=1)
    lhs = as_lhs(t, p, r.lhs)  # BUG: no acc = acc * alpha: acc keeps its old scale
    pipe.pv_ready(slot)
    acc = mma_onto(t, acc, lhs, pipe["v"].tile(slot))
    pipe.refill(step)
    return m_new, l, acc


def _dkdv_step_late_wait(t, pipe, r, step, carry):
    """dkdv_step that reads its slot's lse before waiting for the slot's TMA copies:
    the barrier wait comes one stage (the logits) too late."""
    dk, dv = carry
    slot = pipe.slot(step)
    q_start = pipe.block(step) * t.block_q
    shape = (t.block_kv, t.block_q)
    q, do = pipe["q"].tile(slot), pipe["do"].tile(slot)
    lse = plgpu.load(pipe["lse"].tile(slot), layout=plgpu.Layout.WGMMA.reduce(0))
    for name in ("q", "do", "lse", "delta"):  # BUG: after the lse was read
        pipe[name].wait(slot)
    s = mma(r.k, q.transpose((1, 0)), shape)
    bias = None
    if t.bias_dims is not None:
        pipe["bias"].wait(slot)
        bias = plgpu.load(pipe["bias"].tile(slot), layout=plgpu.Layout.WGMMA)
    s = t.logits(s, q_start, r.kv_start, bias, transposed=True)
    p = jnp.exp(s - rows_of(lse, shape, 1))
    dv = mma_onto(t, dv, as_lhs(t, p, r.lhs), do)
    dp = mma(r.v, do.transpose((1, 0)), shape)
    delta = plgpu.load(pipe["delta"].tile(slot), layout=plgpu.Layout.WGMMA.reduce(0))
    ds = p * (dp - rows_of(delta, shape, 1))
    dk = mma_onto(t, dk, as_lhs(t, ds, r.lhs), q)
    if r.ds is not None:
        mga.store_ds(t, r, ds, q_start)
    pipe.refill(step)
    return dk, dv


def _second_consumer_reads_first_rows(cta_first_row, consumer, block):
    """consumer_first_row without the consumer's offset: the warp-specialised forward's
    second warpgroup reads (and masks as) the first one's q rows, and stores the
    first one's output in its own rows."""
    del consumer, block  # BUG: + consumer * block dropped
    return cta_first_row


def _dkdv_step_q_block_of_slot(t, pipe, r, step, carry):
    """dkdv_step that places its q block by the pipeline slot instead of the block:
    right for the first ``stages`` q blocks of a kv block's stream, wrong from the
    first refilled slot on (its causal mask and its ds tile go to the wrong q rows)."""
    dk, dv = carry
    slot = pipe.slot(step)
    q_start = slot * t.block_q  # BUG: pipe.slot(step), not pipe.block(step)
    shape = (t.block_kv, t.block_q)
    for name in ("q", "do", "lse", "delta"):
        pipe[name].wait(slot)
    q, do = pipe["q"].tile(slot), pipe["do"].tile(slot)
    s = mma(r.k, q.transpose((1, 0)), shape)
    bias = None
    if t.bias_dims is not None:
        pipe["bias"].wait(slot)
        bias = plgpu.load(pipe["bias"].tile(slot), layout=plgpu.Layout.WGMMA)
    s = t.logits(s, q_start, r.kv_start, bias, transposed=True)
    lse = plgpu.load(pipe["lse"].tile(slot), layout=plgpu.Layout.WGMMA.reduce(0))
    p = jnp.exp(s - rows_of(lse, shape, 1))
    dv = mma_onto(t, dv, as_lhs(t, p, r.lhs), do)
    dp = mma(r.v, do.transpose((1, 0)), shape)
    delta = plgpu.load(pipe["delta"].tile(slot), layout=plgpu.Layout.WGMMA.reduce(0))
    ds = p * (dp - rows_of(delta, shape, 1))
    dk = mma_onto(t, dk, as_lhs(t, ds, r.lhs), q)
    if r.ds is not None:
        mga.store_ds(t, r, ds, q_start)
    pipe.refill(step)
    return dk, dv


VARIANT_BODIES = {
    "causal_diagonal_block_dropped": Bodies(kv_blocks_seen=_kv_blocks_without_diagonal),
    "missing_rescale": Bodies(forward_step=_forward_step_missing_rescale),
    "barrier_waited_late": Bodies(dkdv_step=_dkdv_step_late_wait),
    "second_consumer_reads_first_rows": Bodies(forward_consumer_first_row=_second_consumer_reads_first_rows),
    "dkdv_q_block_of_slot": Bodies(dkdv_step=_dkdv_step_q_block_of_slot),
}
DTYPES = ("bfloat16",)
EXAMPLES = 12

# Variants that are wrong only on some inputs draw from those inputs: the dropped
# diagonal needs causal, the rescale needs a second kv block (blocks are >= 64 keys).
_ONLY = {
    "causal_diagonal_block_dropped": lambda case: case.params["causal"],
    "missing_rescale": lambda case: case.arrays["k"].shape[1] > 64,
    # the second warpgroup holds real rows; the configs drawn then are the
    # warp-specialised ones only (``_SPECIALISED``)
    "second_consumer_reads_first_rows": lambda case: case.arrays["q"].shape[1] > 64,
    # a q stream longer than the 2 or 3 slots (q blocks of 64), and something the q rows
    # decide: the causal mask or the ds tile of a bias
    "dkdv_q_block_of_slot": lambda case: (
        case.arrays["q"].shape[1] > 128 and (case.params["causal"] or "bias" in case.arrays)
    ),
}
# variants whose bug lives in the warp-specialised kernels only: drawn with those configs
_SPECIALISED = {"second_consumer_reads_first_rows"}


def _interpreter_raises_on_races() -> bool:
    """Whether the mosaic_gpu_interpret backend runs the race detector and fails the
    kernel on a race (``on_race`` exists from jax 0.12; 0.11.2 only prints races)."""
    try:
        params = Backend("mosaic_gpu_interpret").interpret_arg()
    except RuntimeError:  # no Mosaic GPU interpreter in this jax
        return False
    return bool(getattr(params, "detect_races", False)) and getattr(params, "on_race", None) == "raise"


BACKENDS = MOSAIC_GPU
NOT_ON: dict[str, dict[str, str]] = {}
if not _interpreter_raises_on_races():
    # The interpreter runs each TMA copy when it is issued, so a late wait reads the
    # right data; only its race detector sees the missing happens-before edge.
    NOT_ON["barrier_waited_late"] = {
        "mosaic_gpu_interpret": (
            "the interpreter completes TMA copies at issue and this jax's interpreter cannot "
            "raise on a race (InterpretGPUParams(on_race='raise') needs jax >= 0.12)"
        )
    }


def _cases_where(spec, keep):
    """spec with only the cases ``keep(case, backend)`` accepts."""
    base = spec.cases
    return dataclasses.replace(
        spec, cases=lambda dtype, backend: base(dtype, backend).filter(lambda case: keep(case, backend))
    )


def _spec(name: str, bodies: Bodies):
    spec = make_spec(attention.make_attention(mosaic_bodies=bodies), name=f"mosaic_gpu_attention[{name}]")
    if name in _ONLY:
        spec = _cases_where(spec, lambda case, backend: _ONLY[name](case))
    if name in _SPECIALISED:
        space = spec.configs

        def specialised(case, backend):
            return [c for c in space(case, backend) if c.consumers == 2]

        spec = dataclasses.replace(
            _cases_where(spec, lambda case, backend: bool(specialised(case, backend))), configs=specialised
        )
    return spec


VARIANTS = {name: (_spec(name, bodies), DTYPES, EXAMPLES) for name, bodies in VARIANT_BODIES.items()}
