"""Rules of ragged_dot and gated_linear_unit that the drawn properties do not reach:
traced group sizes, many groups, the activation aliases and leading axes, and that
every kernel lowers for Triton (checked on any machine). Each rule runs on every
backend of the session (``each_backend``: with the CPU default, the Pallas kernels in
``interpret`` and the Mosaic GPU kernels, bf16 only, in their interpreter)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallascheck.kernels import compat, mosaic_gpu_glu, mosaic_gpu_ragged_dot
from pallascheck.kernels import gated_linear_unit as glu
from pallascheck.kernels import ragged_dot as rd
from pallascheck.kernels.backends import Backend
from pallascheck.oracles import gated_linear_unit as glu_oracle
from pallascheck.oracles import ragged_dot as rd_oracle
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import checks, strategies

CONFIG = rd.Config(16, 16, 16)


def _config(backend: Backend) -> rd.Config | mosaic_gpu_ragged_dot.Config:
    return mosaic_gpu_ragged_dot.Config() if backend.is_mosaic_gpu else CONFIG


def _dtype(backend: Backend) -> str:
    return "bfloat16" if backend.is_mosaic_gpu else "float32"


def _ragged_inputs(m: int, groups: int, dtype: str, seed: int = 0):
    lhs = strategies.elements(seed, (m, 24), dtype, "normal")
    rhs = strategies.elements(seed + 1, (groups, 24, 16), dtype, "normal")
    return lhs, rhs


def _check_ragged(out, lhs, rhs, sizes, backend, name):
    ref = rd_oracle.oracle(lhs, rhs, sizes)
    b = rd_oracle.bound(ref, operand_dtype=lhs.dtype, arith=arithmetic_for(backend), block_k=_config(backend).block_k)
    checks.check_values(np.asarray(out), ref.out, b, context=checks.Context(kernel=name, backend=str(backend)))


def test_many_groups_mostly_empty(each_backend: Backend) -> None:
    """37 groups (offsets padded to 64), most empty, several inside one row tile."""
    backend = each_backend
    lhs, rhs = _ragged_inputs(40, 37, _dtype(backend))
    sizes = np.zeros(37, np.int32)
    sizes[[0, 3, 4, 5, 20, 36]] = [1, 2, 13, 7, 9, 6]  # 38 rows: the last 2 in no group
    out = rd.ragged_dot(
        jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes), config=_config(backend), backend=backend
    )
    _check_ragged(out, lhs, rhs, sizes, backend, "ragged_dot[37 groups]")


def test_traced_group_sizes_past_m_are_cut_at_m(each_backend: Backend) -> None:
    """Under jit the sizes cannot be checked: rows past m are dropped, as documented."""
    backend = each_backend
    lhs, rhs = _ragged_inputs(17, 3, _dtype(backend))
    run = jax.jit(lambda a, b, s: rd.ragged_dot(a, b, s, config=_config(backend), backend=backend))
    out = run(jnp.asarray(lhs), jnp.asarray(rhs), jnp.array([5, 10, 9], jnp.int32))
    _check_ragged(out, lhs, rhs, np.array([5, 10, 2], np.int32), backend, "ragged_dot[traced sum > m]")


def test_rows_in_no_group_get_zero_gradient(each_backend: Backend) -> None:
    backend = each_backend
    lhs, rhs = _ragged_inputs(33, 2, _dtype(backend))
    sizes = jnp.array([4, 20], jnp.int32)
    dlhs = jax.grad(
        lambda a: (
            rd.ragged_dot(a, jnp.asarray(rhs), sizes, config=_config(backend), backend=backend)
            .astype(jnp.float32)
            .sum()
        )
    )(jnp.asarray(lhs))
    assert np.all(np.asarray(dlhs)[24:] == 0) and np.all(np.asarray(dlhs)[:24] != 0)


def test_glu_activation_aliases_and_leading_axes(each_backend: Backend) -> None:
    backend = each_backend
    x = jnp.asarray(strategies.elements(0, (2, 3, 7), _dtype(backend), "normal"))
    w = jnp.asarray(strategies.elements(1, (7, 2, 16), _dtype(backend), "normal"))
    cfg = mosaic_gpu_glu.Config() if backend.is_mosaic_gpu else glu.Config(16, 16, 16)
    swish = glu.gated_linear_unit(x, w, activation="swish", config=cfg, backend=backend)
    silu = glu.gated_linear_unit(x, w, activation="silu", config=cfg, backend=backend)
    assert swish.shape == (2, 3, 16) and np.array_equal(np.asarray(swish), np.asarray(silu))
    bilinear = glu.gated_linear_unit(x, w, activation=None, config=cfg, backend=backend)
    ref = glu_oracle.oracle(np.asarray(x), np.asarray(w), activation="none")
    b = glu_oracle.bound(
        ref, activation="none", operand_dtype=x.dtype, arith=arithmetic_for(backend), block_k=cfg.block_k
    )
    checks.check_values(np.asarray(bilinear), ref.out, b, context=checks.Context(kernel="glu[bilinear]"))


def _lower_for_triton(fn, *args) -> None:
    """Pallas emits Triton IR while lowering, so lowering for CUDA on any machine
    catches what Triton's lowering rejects (chained indexers, unsupported ops). The
    abstract H100 stands in for the GPU whose compute capability the lowering asks."""
    with compat.abstract_gpu():
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_forward_and_backward_lower_for_triton() -> None:
    gpu = "triton"
    for dtype in (jnp.float32, jnp.bfloat16):
        lhs, rhs = jax.ShapeDtypeStruct((300, 72), dtype), jax.ShapeDtypeStruct((5, 72, 96), dtype)
        sizes = jax.ShapeDtypeStruct((5,), jnp.int32)
        for cfg in (rd.Config(64, 64, 32), rd.Config(128, 128, 64, num_warps=8, num_stages=4)):
            cot = jnp.ones((300, 96), dtype)
            _lower_for_triton(
                lambda a, b, s, cfg=cfg, cot=cot: jax.vjp(
                    lambda a, b: rd.ragged_dot(a, b, s, config=cfg, backend=gpu), a, b
                )[1](cot),
                lhs,
                rhs,
                sizes,
            )
        for activation in ("none", "silu", "gelu_tanh", "relu", "sigmoid"):
            cot = jnp.ones((100, 48), dtype)
            _lower_for_triton(
                lambda a, b, act=activation, cot=cot: jax.vjp(
                    lambda a, b: glu.gated_linear_unit(
                        a, b, activation=act, config=glu.Config(64, 64, 32), backend=gpu
                    ),
                    a,
                    b,
                )[1](cot),
                jax.ShapeDtypeStruct((100, 70), dtype),
                jax.ShapeDtypeStruct((70, 2, 48), dtype),
            )
