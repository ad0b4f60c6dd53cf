"""The softmax family (softmax over the last axis): a spec for a user's kernel, built
with ``softmax_like``. pallascheck ships no softmax kernel of its own (attention and
cross-entropy fuse theirs); the oracle and bounds are in oracles/softmax.py.

Input kinds are cross-entropy's adversarial logits (``cross_entropy_spec.logits_of``):
normal, 1e4-scale, large per-row offsets, near the dtype's maximum, one finite
entry per row among -inf (at a tile boundary), and ties.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels.backends import GENERIC, Backend, get_backend
from pallascheck.oracles import softmax as oracle
from pallascheck.oracles.tolerance import Arithmetic, arithmetic_for
from pallascheck.properties import builders, relations, strategies
from pallascheck.properties.families.cross_entropy import LOGIT_KINDS, logits_of
from pallascheck.properties.spec import (
    BadInput,
    Case,
    GradientSpec,
    KernelSpec,
    config_fields,
)

LEADING_SHAPES = ((1,), (5,), (3, 11))  # rows 1, 5, 33
FEATURES = (7, 64, 100, 256)  # 7 and 100: a row shorter than its power-of-two block


@dataclasses.dataclass(frozen=True)
class Domain:
    leading: tuple[tuple[int, ...], ...] = LEADING_SHAPES
    features: tuple[int, ...] = FEATURES
    kinds: tuple[str, ...] = LOGIT_KINDS


@dataclasses.dataclass(frozen=True)
class Blocks:
    """What the bound needs to know of a softmax kernel: the block of its row sum
    (None, unknown: one block, any order) and whether it subtracts the row max before
    upcasting, in the input dtype ("input") or after, in f32 ("float32")."""

    block: int | None = None
    shift_dtype: str = "float32"


def cases(dtype: str, backend: Backend, domain: Domain = Domain()) -> st.SearchStrategy[Case]:
    @st.composite
    def draw(draw_) -> Case:
        leading = draw_(strategies.layout_choice("softmax.leading", domain.leading))
        n = draw_(strategies.layout_choice("softmax.n", domain.features))
        kind = draw_(strategies.element_kinds(domain.kinds))
        seed = draw_(strategies.seeds())
        rows = int(np.prod(leading))
        x, _ = logits_of(seed, rows, n, dtype, kind)
        rng = np.random.default_rng(seed + 1)
        return Case(
            arrays={
                "x": x.reshape(leading + (n,)),
                "cotangent": strategies.elements(seed + 2, leading + (n,), dtype, "normal"),
                "shift": (rng.uniform(-50, 50, leading + (1,)) * rng.choice([0.0, 1.0, 100.0])),
            },
            params={"kind": kind},
        )

    return draw()


def _oracle(case: Case) -> oracle.SoftmaxOracle:
    return oracle.oracle(case.arrays["x"])


def _bound(case: Case, ref: oracle.SoftmaxOracle, config: Any, arith: Arithmetic) -> np.ndarray:
    dtype = case.arrays["x"].dtype
    if config is None:  # xla_reference: everything in the input dtype
        return oracle.bound(ref, dtype=dtype, arith=arith, shift_dtype=dtype, block=None, reference=True)
    shift = dtype if config.shift_dtype == "input" else np.float32
    return oracle.bound(ref, dtype=dtype, arith=arith, shift_dtype=shift, block=config.block)


def _contract(case: Case, ref: oracle.SoftmaxOracle, arith: Arithmetic) -> np.ndarray:
    return oracle.contract(ref, dtype=case.arrays["x"].dtype, arith=arith)


def _gradient_bound(case: Case, ref, grads, config: Any, arith: Arithmetic) -> dict[str, np.ndarray]:
    """The kernel's backward in f32 from its forward output (within the forward's
    implementation bound); xla_reference's autodiff in its dtype."""
    dtype = case.arrays["x"].dtype
    compute = dtype if config is None else np.float32
    forward = _bound(case, ref, config, arith)
    return {
        "dx": oracle.gradient_bound(
            ref, case.arrays["cotangent"], forward, dtype=dtype, arith=arith, compute_dtype=compute
        )
    }


def _gradient_contract(case: Case, ref, grads, arith: Arithmetic) -> dict[str, np.ndarray]:
    dtype = case.arrays["x"].dtype
    forward = _contract(case, ref, arith)
    return {
        "dx": oracle.gradient_bound(
            ref, case.arrays["cotangent"], forward, dtype=dtype, arith=arith, compute_dtype=np.float32
        )
    }


def _vjp(fn: Callable[[jax.Array], jax.Array], case: Case) -> dict[str, jax.Array]:
    _, pullback = jax.vjp(fn, jnp.asarray(case.arrays["x"]))
    (dx,) = pullback(jnp.asarray(case.arrays["cotangent"]))
    return {"dx": dx}


def _shifted(case: Case) -> Case | None:
    """x + c per row (up to 5000): softmax ignores it."""
    x = case.arrays["x"]
    with np.errstate(over="ignore", invalid="ignore"):
        moved = (x.astype(np.float64) + case.arrays["shift"]).astype(x.dtype)
    if not np.array_equal(np.isfinite(moved), np.isfinite(x)):
        return None  # the shift overflowed the dtype: another input, not a shifted one
    return Case({**case.arrays, "x": moved}, case.params)


def _reference(case: Case) -> jax.Array:
    return jax.nn.softmax(jnp.asarray(case.arrays["x"]), axis=-1)


def make_spec(
    kernel: Callable[..., jax.Array],
    name: str,
    *,
    blocks: Blocks,
    domain: Domain = Domain(),
    dtypes: Sequence[str] = strategies.DTYPES,
    differentiable: bool = True,
    backends: Sequence[str] = GENERIC,
    bad_inputs: Callable[[], Sequence[BadInput]] = lambda: (),
) -> KernelSpec:
    """The softmax spec for ``kernel(x, *, config, backend)``; ``blocks`` states its
    row-sum block and shift dtype (the one "config")."""

    def run(case: Case, config: Any, backend: Backend) -> jax.Array:
        return kernel(jnp.asarray(case.arrays["x"]), config=config, backend=backend)

    def row_bound(case: Case, config: Any, backend: Backend) -> np.ndarray:
        return _bound(case, _oracle(case), config, arithmetic_for(backend))

    def kernel_vjp(case: Case, config: Any, backend: Backend) -> dict[str, jax.Array]:
        return _vjp(lambda x: kernel(x, config=config, backend=backend), case)

    def reference_vjp(case: Case) -> dict[str, jax.Array]:
        return _vjp(lambda x: jax.nn.softmax(x, axis=-1), case)

    return KernelSpec(
        name=name,
        dtypes=dtypes,
        cases=lambda dtype, backend: cases(dtype, backend, domain),
        kernel=run,
        reference=_reference,
        oracle=_oracle,
        expected=lambda ref: ref.out,
        bound=_bound,
        contract=_contract,
        gradients=GradientSpec(
            kernel_vjp,
            lambda case, ref: {"dx": oracle.oracle_vjp(ref, case.arrays["cotangent"])},
            _gradient_bound,
            reference_vjp=reference_vjp,
            contract=_gradient_contract,
        )
        if differentiable
        else None,
        relations=(
            relations.row_permutation(("x", "cotangent"), run, row_bound),
            relations.invariance_within_contract("shift_invariance", run, _shifted, _oracle, _contract),
        ),
        bad_inputs=bad_inputs,
        backends=backends,
        **config_fields(blocks),
    )


# ------------------------------------------------------------------------ builder


def softmax_like(
    fn: Callable[..., jax.Array],
    *,
    name: str,
    blocks: Blocks = Blocks(),
    leading: Sequence[tuple[int, ...]] = LEADING_SHAPES,
    features: Sequence[int] = FEATURES,
    dtypes: Sequence[str] = strategies.DTYPES,
    differentiable: bool = True,
    backends: Sequence[str] = GENERIC,
    interpret: str | None = None,
) -> KernelSpec:
    """The spec of a user's softmax over the last axis, ``fn(x) -> y`` (y in x's dtype).

    - ``blocks``: its row-sum block and the dtype it subtracts the row max in;
    - ``leading``, ``features``: the shapes ([*leading, features]) it accepts;
    - ``backends`` / ``interpret``: see ``builders.call_on``.
    """
    if blocks.shift_dtype not in ("float32", "input"):
        raise ValueError(f"blocks.shift_dtype must be 'float32' or 'input', got {blocks.shift_dtype!r}")

    def adapted(x, *, config=None, backend=None):
        del config  # the blocks are fixed
        return builders.call_on(fn, get_backend(backend), backends, interpret, x)

    def bad() -> list[BadInput]:
        chosen = builders.checking_backend(backends)
        return [builders.must_refuse("zero-length rows", lambda: adapted(jnp.ones((4, 0), dtypes[-1]), backend=chosen))]

    spec = make_spec(
        adapted,
        name,
        blocks=blocks,
        domain=Domain(tuple(leading), tuple(features)),
        dtypes=dtypes,
        differentiable=differentiable,
        backends=backends,
        bad_inputs=bad,
    )
    return builders.backward_on_backend(spec, interpret)
