"""Deliberately broken ragged_dot and gated_linear_unit kernels. Each reuses the
real tiling (ragged_dot.grouped_call / drhs_call, gated_linear_unit.fused_call) and
changes one thing; the sensitivity test requires the checks to catch each."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels import block_io
from pallascheck.kernels import gated_linear_unit as glu
from pallascheck.kernels import ragged_dot as rd
from pallascheck.kernels.activations import get_activation
from pallascheck.kernels.backends import get_backend
from pallascheck.properties.families import gated_linear_unit as gated_linear_unit_spec
from pallascheck.properties.families import ragged_dot as ragged_dot_spec


def _forward_body(
    starts_ref,
    ends_ref,
    lhs_ref,
    rhs_ref,
    out_ref,
    *,
    m_size,
    n_size,
    k_size,
    block_k,
    num_groups,
    transpose_rhs,
    masked_io,
    inclusive_end=False,
    empty_reads_next=False,
):
    """kernels/ragged_dot.py's forward body (transpose_rhs=False only) with switches."""
    block_m, block_n = out_ref.shape
    first_row = pl.program_id(0) * block_m
    rows = first_row + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    cols = pl.program_id(1) * block_n + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    row_ok, col_ok = rows < m_size, cols < n_size
    starts, ends = starts_ref[...], ends_ref[...]
    real = lax.broadcasted_iota(jnp.int32, starts.shape, 0) < num_groups
    first_group = jnp.sum(jnp.where(real & (ends <= first_row), 1, 0))
    # inclusive_end needs the group before a boundary row too: one group earlier.
    if inclusive_end:
        first_group = jnp.maximum(first_group - 1, 0)
    last_group = jnp.sum(jnp.where(real & (starts < first_row + block_m), 1, 0))

    def group_step(group, acc):
        start, end = rd._scalar_at(starts, group), rd._scalar_at(ends, group)
        if inclusive_end:
            end = end + 1  # off by one: the next group's first row joins this group too
        if empty_reads_next:
            end = jnp.where(end == start, rd._scalar_at(ends, group + 1), end)
        in_group = row_ok & (rows >= start) & (rows < end)

        def k_step(i, acc):
            s = i * block_k
            kx = s + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
            kw = s + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
            x = block_io.load(lhs_ref.at[:, pl.ds(s, block_k)], in_group & (kx < k_size), masked_io=masked_io)
            w = block_io.load(rhs_ref.at[group, pl.ds(s, block_k), :], (kw < k_size) & col_ok, masked_io=masked_io)
            return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

        return lax.fori_loop(0, lhs_ref.shape[1] // block_k, k_step, acc)

    acc = lax.fori_loop(first_group, last_group, group_step, jnp.zeros((block_m, block_n), jnp.float32))
    block_io.store(out_ref, acc, row_ok & col_ok, masked_io=masked_io)


def _ragged_forward_variant(**switches: Any) -> Callable[..., jax.Array]:
    def run(lhs, rhs, group_sizes, *, config=None, backend=None):
        starts, ends = rd.group_offsets(group_sizes, lhs.shape[0])
        return rd.grouped_call(
            lhs,
            rhs,
            starts,
            ends,
            transpose_rhs=False,
            config=config or rd.Config(),
            backend=get_backend(backend),
            body=functools.partial(_forward_body, **switches),
        )

    return run


def _drhs_dropping_last_partial_tile(
    starts_ref, ends_ref, lhs_ref, dout_ref, out_ref, *, k_size, n_size, block_k, masked_io
):
    """kernels/ragged_dot.py's drhs body, its row-tile loop ending at floor(end / block_k)."""
    block_m, block_n = out_ref.shape
    group = pl.program_id(0)
    ks = pl.program_id(1) * block_m + lax.broadcasted_iota(jnp.int32, (1, block_m), 1)
    ns = pl.program_id(2) * block_n + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    start, end = rd._scalar_at(starts_ref[...], group), rd._scalar_at(ends_ref[...], group)

    def row_step(t, acc):
        rows = t * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        in_group = (rows >= start) & (rows < end)
        x = block_io.load(lhs_ref.at[pl.ds(t * block_k, block_k), :], in_group & (ks < k_size), masked_io=masked_io)
        dy = block_io.load(dout_ref.at[pl.ds(t * block_k, block_k), :], in_group & (ns < n_size), masked_io=masked_io)
        return acc + lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    acc = lax.fori_loop(start // block_k, end // block_k, row_step, jnp.zeros((block_m, block_n), jnp.float32))
    block_io.store(out_ref, acc, (ks.T < k_size) & (ns < n_size), masked_io=masked_io)


def _ragged_dot_short_drhs(lhs, rhs, group_sizes, *, config=None, backend=None):
    config, backend = config or rd.Config(), get_backend(backend)

    @jax.custom_vjp
    def f(lhs, rhs):
        return rd.ragged_dot(lhs, rhs, group_sizes, config=config, backend=backend)

    def bwd(res, g):
        lhs, rhs = res
        starts, ends = rd.group_offsets(group_sizes, lhs.shape[0])
        dlhs = rd.grouped_call(g, rhs, starts, ends, transpose_rhs=True, config=config, backend=backend)
        drhs = rd.drhs_call(
            lhs,
            g,
            starts,
            ends,
            rhs.shape[0],
            out_dtype=rhs.dtype,
            config=config,
            backend=backend,
            body=_drhs_dropping_last_partial_tile,
        )
        return dlhs, drhs

    f.defvjp(lambda lhs, rhs: (f(lhs, rhs), (lhs, rhs)), bwd)
    return f(lhs, rhs)


def _glu_gate_up_swapped(x, weights, *, activation=None, config=None, backend=None):
    """The real fused kernel reading weights[:, 1] as the gate and weights[:, 0] as up."""
    out = glu.fused_call(
        x.reshape(-1, x.shape[-1]),
        weights[:, ::-1, :],
        activation=glu.canonical_activation(activation),
        save_residuals=False,
        config=config or glu.Config(),
        backend=get_backend(backend),
    )
    return out.reshape(*x.shape[:-1], weights.shape[2])


def _glu_tanh_for_exact_gelu(x, weights, *, activation=None, config=None, backend=None):
    """Exact gelu requested, the tanh approximation computed."""
    activation = "gelu_tanh" if activation == "gelu" else activation
    return glu.gated_linear_unit(x, weights, activation=activation, config=config, backend=backend)


def _glu_missing_activation_derivative(x, weights, *, activation=None, config=None, backend=None):
    """Backward uses dgate = g * up, forgetting act'(gate)."""
    config, backend, name = config or glu.Config(), get_backend(backend), glu.canonical_activation(activation)

    @jax.custom_vjp
    def f(x, weights):
        return glu.gated_linear_unit(x, weights, activation=name, config=config, backend=backend)

    def fwd(x, weights):
        _, gate, up = glu.fused_call(
            x.reshape(-1, x.shape[-1]), weights, activation=name, save_residuals=True, config=config, backend=backend
        )
        return f(x, weights), (x, weights, gate, up)

    def bwd(res, g):
        x, weights, gate, up = res
        (d, _, nf), x2 = weights.shape, x.reshape(-1, x.shape[-1])
        g = g.reshape(-1, nf).astype(jnp.float32)
        dz = jnp.stack([g * up, g * get_activation(name)(gate)], axis=1).astype(x.dtype).reshape(-1, 2 * nf)
        w = weights.reshape(d, 2 * nf)
        dx = glu._matmul(dz, w.T, config, backend).reshape(x.shape)
        return dx, glu._matmul(x2.T, dz, config, backend).reshape(weights.shape)

    f.defvjp(fwd, bwd)
    return f(x, weights)


# name -> (spec maker, kernel, differentiable, dtypes where it is wrong)
_BROKEN = {
    "ragged_dot/group_boundary_off_by_one": (
        ragged_dot_spec.make_spec,
        _ragged_forward_variant(inclusive_end=True),
        False,
        ("float32",),
    ),
    "ragged_dot/empty_group_reads_next_rows": (
        ragged_dot_spec.make_spec,
        _ragged_forward_variant(empty_reads_next=True),
        False,
        ("float32",),
    ),
    "ragged_dot/drhs_drops_last_partial_tile": (ragged_dot_spec.make_spec, _ragged_dot_short_drhs, True, ("float32",)),
    "glu/gate_and_up_swapped": (gated_linear_unit_spec.make_spec, _glu_gate_up_swapped, False, ("float32",)),
    # gelu - gelu_tanh is below 3e-4 |z|: far above f32's bound, within bf16's.
    "glu/tanh_gelu_for_exact": (gated_linear_unit_spec.make_spec, _glu_tanh_for_exact_gelu, False, ("float32",)),
    "glu/missing_activation_derivative": (
        gated_linear_unit_spec.make_spec,
        _glu_missing_activation_derivative,
        True,
        ("float32",),
    ),
}
# Enough examples for Hypothesis to reach the triggering cases (an empty group, an activation).
EXAMPLES = 30
# Variants that cannot exist on a backend: variant -> {backend name: why}.
NOT_ON = {
    "glu/tanh_gelu_for_exact": {
        "triton": "exact gelu is refused on the GPU (no erf lowering in Triton), so no case asks for it",
    },
}

VARIANTS = {
    name: (make(fn, name=f"{name.split('/')[0]}[{name.split('/')[1]}]", differentiable=grads), dtypes, EXAMPLES)
    for name, (make, fn, grads, dtypes) in _BROKEN.items()
}
