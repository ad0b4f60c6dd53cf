"""KernelSpec for kernels/linear_cross_entropy.py (fused x @ w + cross-entropy).

Inputs: x [T, H] and w [H, V] from the shared element kinds (normal, large, few
distinct, positive); "large" scales both so the logits reach ~1e3-1e4 and the loss
cancels lse against z_y; "offset" sets x[:, 0] = 1 and one row of w to a constant c,
|c| in [1e4, 2e4], so every logit carries the same large offset over an O(1) loss
(what the accuracy contract is about: see oracles/cross_entropy.py). Labels uniform or pinned to 0 / V-1, a fraction ignored
(0, 30 %, all), smoothing {0, 0.1, 1}, every reduction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels import linear_cross_entropy as lce
from pallascheck.kernels.backends import Backend
from pallascheck.oracles import linear_cross_entropy as oracle
from pallascheck.oracles.tolerance import Arithmetic
from pallascheck.properties import strategies
from pallascheck.properties.families.cross_entropy import IGNORE_INDEX, SMOOTHING
from pallascheck.properties.spec import BadInput, Case, GradientSpec, KernelSpec

DTYPES = ("float32", "bfloat16", "float16")
TOKENS = (1, 16, 33)
HIDDEN = (16, 40)  # 40 leaves a partial H chunk
VOCABS = (64, 100)  # 100 leaves a partial vocabulary tile
KINDS = ("normal", "large", "offset", "few_distinct", "positive")


def cases(dtype: str, backend: Backend) -> st.SearchStrategy[Case]:
    @st.composite
    def draw(draw_) -> Case:
        t, h, v = (
            draw_(strategies.layout_choice(f"linear_cross_entropy.{a}", bucket))
            for a, bucket in (("t", TOKENS), ("h", HIDDEN), ("v", VOCABS))
        )
        reduction = draw_(strategies.layout_choice("linear_cross_entropy.reduction", lce.ce.REDUCTIONS))
        eps = draw_(strategies.layout_choice("linear_cross_entropy.label_smoothing", SMOOTHING))
        kind = draw_(st.sampled_from(KINDS))
        seed = draw_(strategies.seeds())
        rng = np.random.default_rng(seed + 7)
        scale = {"large": 30.0}.get(kind, 1.0)  # logits up to ~H * 30^2 * 16
        base = kind if kind in ("few_distinct", "positive") else "normal"
        x = strategies.elements(seed, (t, h), "float64", base) * scale
        w = strategies.elements(seed + 1, (h, v), "float64", base) * scale
        if kind == "offset":  # x[:, 0] = 1 and one w row constant: every logit of a row + c, |c| in [1e4, 2e4]
            x[:, 0] = 1.0
            w[0, :] = rng.choice([-1.0, 1.0]) * rng.uniform(1e4, 2e4)
        pinned = draw_(st.sampled_from(("uniform", "first", "last")))
        labels = {"uniform": rng.integers(0, v, t), "first": np.zeros(t, np.int64), "last": np.full(t, v - 1)}[pinned]
        ignored = rng.random(t) < draw_(st.sampled_from((0.0, 0.3, 1.0)))
        np_dtype = strategies.np_dtype(dtype)
        return Case(
            arrays={
                "x": x.astype(np_dtype),
                "w": w.astype(np_dtype),
                "labels": np.where(ignored, IGNORE_INDEX, labels).astype(np.int32),
                "cotangent": rng.standard_normal(t if reduction == "none" else ()).astype(np.float32),
            },
            params={"label_smoothing": eps, "ignore_index": IGNORE_INDEX, "reduction": reduction},
        )

    return draw()


def _kwargs(case: Case) -> dict[str, Any]:
    p = case.params
    return dict(label_smoothing=p["label_smoothing"], ignore_index=p["ignore_index"], reduction=p["reduction"])


def _args(case: Case) -> tuple[jax.Array, jax.Array, jax.Array]:
    return jnp.asarray(case.arrays["x"]), jnp.asarray(case.arrays["w"]), jnp.asarray(case.arrays["labels"])


def _oracle(case: Case) -> oracle.LinearCrossEntropyOracle:
    p = case.params
    return oracle.oracle(
        case.arrays["x"],
        case.arrays["w"],
        case.arrays["labels"],
        eps=p["label_smoothing"],
        ignore_index=p["ignore_index"],
        reduction=p["reduction"],
    )


def _bound(case: Case, ref, config: Any, arith: Arithmetic) -> np.ndarray:
    return oracle.loss_bound(ref, operand_dtype=case.arrays["x"].dtype, arith=arith, config=config)


def _gradient_bound(case: Case, ref, grads, config: Any, arith: Arithmetic) -> dict[str, np.ndarray]:
    return oracle.gradient_bound(
        ref,
        case.arrays["cotangent"],
        operand_dtype=case.arrays["x"].dtype,
        arith=arith,
        block_h=config.block_h,
        block_v=config.block_v,
        block_t=config.block_t,
    )


def _contract(case: Case, ref, arith: Arithmetic) -> np.ndarray:
    return oracle.contract_bound(ref, operand_dtype=case.arrays["x"].dtype, arith=arith)


def _gradient_contract(case: Case, ref, grads, arith: Arithmetic) -> dict[str, np.ndarray]:
    return oracle.gradient_contract(ref, case.arrays["cotangent"], operand_dtype=case.arrays["x"].dtype, arith=arith)


def make_spec(
    kernel: Callable[..., jax.Array] = lce.linear_softmax_cross_entropy, name: str = "linear_softmax_cross_entropy"
) -> KernelSpec:
    def run(case: Case, config: Any, backend: Backend) -> jax.Array:
        return kernel(*_args(case), config=config, backend=backend, **_kwargs(case))

    def kernel_vjp(case: Case, config: Any, backend: Backend) -> dict[str, jax.Array]:
        x, w, labels = _args(case)
        fn = lambda a, b: kernel(a, b, labels, config=config, backend=backend, **_kwargs(case))  # noqa: E731
        _, pullback = jax.vjp(fn, x, w)
        dx, dw = pullback(jnp.asarray(case.arrays["cotangent"]))
        return {"dx": dx, "dw": dw}

    return KernelSpec(
        name=name,
        dtypes=DTYPES,
        cases=cases,
        kernel=run,
        reference=lambda case: lce.xla_reference(*_args(case), **_kwargs(case)),
        oracle=_oracle,
        expected=lambda ref: ref.out,
        bound=_bound,
        contract=_contract,
        configs=lambda case, backend: lce.configs(
            *cast(tuple[int, int], case.arrays["x"].shape), case.arrays["w"].shape[1], backend
        ),
        default_config=lce.Config(),
        gradients=GradientSpec(
            kernel_vjp,
            lambda case, ref: oracle.oracle_vjp(ref, case.arrays["cotangent"]),
            _gradient_bound,
            contract=_gradient_contract,
        ),
        bad_inputs=_bad_inputs(kernel),
    )


def _bad_inputs(fn: Callable[..., jax.Array]) -> Callable[[], list[BadInput]]:
    def bad() -> list[BadInput]:
        x, w, y = jnp.zeros((4, 16)), jnp.zeros((16, 32)), jnp.zeros((4,), jnp.int32)
        return [
            BadInput(
                "contracting dims",
                lambda: fn(x, jnp.zeros((8, 32)), y),
                ValueError,
                r"x.shape\[1\]=16 != w.shape\[0\]=8",
            ),
            BadInput(
                "mixed dtypes", lambda: fn(x, w.astype(jnp.bfloat16), y), TypeError, r"x and w must have the same dtype"
            ),
            BadInput("rank-3 x", lambda: fn(jnp.zeros((2, 4, 16)), w, y), ValueError, r"x must have rank 2"),
            BadInput(
                "float labels", lambda: fn(x, w, y.astype(jnp.float32)), TypeError, r"labels must have an integer dtype"
            ),
            BadInput(
                "labels shape", lambda: fn(x, w, jnp.zeros((5,), jnp.int32)), ValueError, r"labels must have shape"
            ),
            BadInput("label >= V", lambda: fn(x, w, y.at[0].set(32)), ValueError, r"labels\[0\] = 32"),
            BadInput("reduction", lambda: fn(x, w, y, reduction="avg"), ValueError, r"reduction must be one of"),
            BadInput(
                "block_h", lambda: lce.Config(block_h=8), ValueError, r"config.block_h must be a power of two >= 16"
            ),
        ]

    return bad


SPEC = make_spec()
