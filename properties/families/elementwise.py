"""KernelSpecs for elementwise activations ``y = f(x)``: y has x's shape and dtype, f
is one of oracles/activations.py's models (none, relu, gelu, gelu_tanh, silu,
sigmoid). pallascheck ships no elementwise kernel: ``elementwise_like`` checks a
user's, ``make_spec`` any function with the adapted signature ``kernel(x, *, backend)``.

Every output element depends on its own input element alone, and that input is
exact: the whole error is f's evaluation (the ActivationModel's, derived in
oracles/activations.py and measured on a dense grid by tests/test_activation_models.py)
plus how the result is stored; the oracle and both bounds are oracles/elementwise.py's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels.activations import get_activation
from pallascheck.kernels.backends import GENERIC, Backend, get_backend
from pallascheck.kernels.matmul import GELU_TANH_RANGE
from pallascheck.oracles import elementwise
from pallascheck.oracles.activations import activation_model
from pallascheck.oracles.elementwise import ElementwiseOracle
from pallascheck.oracles.tolerance import (
    Arithmetic,
    arithmetic_for,
    gamma,
    unit_roundoff,
)
from pallascheck.properties import builders, strategies
from pallascheck.properties.device import layout_programs
from pallascheck.properties.spec import (
    Case,
    GradientSpec,
    KernelSpec,
    Relation,
    config_fields,
)

# (1,) and (7,): a lone element and a ragged vector; (3, 33) rows with an odd tail;
# (8, 128): one aligned TPU tile; (2, 3, 64): rank 3. Few buckets, because interpret
# mode compiles once per shape and dtype.
SHAPES = ((1,), (7,), (3, 33), (8, 128), (2, 3, 64))
# strategies.ELEMENT_KINDS reach saturation (large, offset_rows), the transition
# (normal, positive, few_distinct) and the normals' edge (subnormal); "all_scales"
# adds deep subnormals and exact zeros (relu's kink) and every octave between.
X_KINDS = strategies.ELEMENT_KINDS + ("all_scales",)
# Where f(x) = a f(-x) + b x + c holds exactly: (a, b, c).
REFLECTIONS = {
    "none": (-1.0, 0.0, 0.0),  # odd
    "relu": (1.0, 1.0, 0.0),  # max(x, 0) - max(-x, 0) = x
    "gelu": (1.0, 1.0, 0.0),  # x Phi(x) - (-x) Phi(-x) = x (Phi(x) + Phi(-x) = 1)
    "gelu_tanh": (1.0, 1.0, 0.0),  # the same with 0.5 (1 + tanh(s(x))), s odd
    "silu": (1.0, 1.0, 0.0),  # the same with sigma(x) + sigma(-x) = 1
    "sigmoid": (-1.0, 0.0, 1.0),  # sigma(x) = 1 - sigma(-x)
}


@dataclasses.dataclass(frozen=True)
class Compute:
    """The one "config" of an elementwise kernel: no tiling changes its arithmetic
    (each element is computed alone), only the dtype it evaluates f in. Kernels
    evaluate in f32 (the default); ``None`` stands for xla_reference, f in x's dtype."""

    dtype: str = "float32"


def _largest(dtype: str, activation: str) -> float:
    """The largest |x| drawn: 1/8 of the dtype's range, the headroom strategies.elements
    keeps for "large" (overflow is a different property from accuracy); gelu_tanh
    promises accuracy only up to GELU_TANH_RANGE, beyond which its f32 z**3 overflows
    and its gradient is NaN (kernels/matmul.py)."""
    largest = float(ml_dtypes.finfo(strategies.np_dtype(dtype)).max) / 8.0
    return min(largest, GELU_TANH_RANGE) if activation == "gelu_tanh" else largest


def _elements(seed: int, shape: tuple[int, ...], dtype: str, kind: str, activation: str) -> np.ndarray:
    """x of ``kind``: strategies.elements, or "all_scales": magnitudes log-uniform from
    the dtype's smallest subnormal to ``_largest``, random signs, and an eighth of the
    elements exact zeros of either sign."""
    if kind != "all_scales":
        return strategies.elements(seed, shape, dtype, kind)
    rng = np.random.default_rng(seed)
    smallest = float(ml_dtypes.finfo(strategies.np_dtype(dtype)).smallest_subnormal)
    octaves = rng.uniform(np.log2(smallest), np.log2(_largest(dtype, activation)), shape)
    values = np.exp2(octaves) * rng.choice([-1.0, 1.0], shape)
    values = np.where(rng.random(shape) < 1 / 8, 0.0 * values, values)
    return values.astype(strategies.np_dtype(dtype))


def cases(
    activation: str, dtype: str, backend: Backend, shapes: Sequence[tuple[int, ...]] = SHAPES
) -> st.SearchStrategy[Case]:
    # gelu_tanh: no "large" (up to 1e19 in f32 and bf16, past GELU_TANH_RANGE); its
    # saturation is reached by offset_rows and all_scales.
    kinds = [k for k in X_KINDS if not (k == "large" and activation == "gelu_tanh")]

    @st.composite
    def draw(draw_) -> Case:
        shape = draw_(strategies.layout_choice("elementwise.shape", tuple(shapes)))
        kind = draw_(strategies.element_kinds(kinds))
        seed = draw_(strategies.seeds())
        return Case(
            arrays={
                "x": _elements(seed, shape, dtype, kind, activation),
                "cotangent": strategies.elements(seed + 1, shape, dtype, "normal"),
            },
            params={"activation": activation},
        )

    return draw()


# ------------------------------------------------------------------ oracle and bounds
# oracles/elementwise.py, on the Case's arrays: f evaluated in the config's dtype
# (x's for xla_reference, config None), stored in x's dtype.


def _compute(config: Compute | None) -> str | None:
    return None if config is None else config.dtype


def oracle(case: Case) -> ElementwiseOracle:
    return elementwise.oracle(case.arrays["x"], case.params["activation"])


def bound(case: Case, ref: ElementwiseOracle, config: Compute | None, arith: Arithmetic) -> np.ndarray:
    return elementwise.bound(
        ref, case.params["activation"], compute_dtype=_compute(config), out_dtype=case.arrays["x"].dtype, arith=arith
    )


def contract(case: Case, ref: ElementwiseOracle, arith: Arithmetic) -> np.ndarray:
    """f in f32, rounded once to x's dtype (elementwise.contract)."""
    return elementwise.contract(ref, case.params["activation"], out_dtype=case.arrays["x"].dtype, arith=arith)


def oracle_vjp(case: Case, ref: ElementwiseOracle) -> dict[str, np.ndarray]:
    return elementwise.oracle_vjp(ref, case.params["activation"], case.arrays["cotangent"])


def gradient_bound(
    case: Case,
    ref: ElementwiseOracle,
    grads: Mapping[str, np.ndarray],
    config: Compute | None,
    arith: Arithmetic,
) -> dict[str, np.ndarray]:
    return elementwise.gradient_bound(
        ref,
        case.params["activation"],
        grads["slope"],
        case.arrays["cotangent"],
        compute_dtype=_compute(config),
        out_dtype=case.arrays["x"].dtype,
        arith=arith,
    )


def gradient_contract(
    case: Case, ref: ElementwiseOracle, grads: Mapping[str, np.ndarray], arith: Arithmetic
) -> dict[str, np.ndarray]:
    """dx = f'(x) g in f32, rounded once to x's dtype (elementwise.gradient_contract)."""
    return elementwise.gradient_contract(
        ref,
        case.params["activation"],
        grads["slope"],
        case.arrays["cotangent"],
        out_dtype=case.arrays["x"].dtype,
        arith=arith,
    )


# ------------------------------------------------------------------------ relations


BoundOf = Callable[[Case, Any, Backend], np.ndarray]


def element_permutation(run: Callable[[Case, Any, Backend], Any], bound_of: BoundOf) -> Relation:
    """f(P x) = P f(x) for a permutation P of *all* elements (relations.row_permutation
    moves whole rows; an elementwise op must not care in which block, row or lane an
    element sits). Each side is within its bound of the same oracle element, so they
    agree within twice the bound. The shape is unchanged: the compiled kernel is reused."""

    def relation(case: Case, config: Any, backend: Backend, out: np.ndarray):
        shape = case.arrays["x"].shape
        perm = np.random.default_rng(case.arrays["x"].size).permutation(case.arrays["x"].size)

        def permuted(a: np.ndarray) -> np.ndarray:
            return np.asarray(a).reshape(-1)[perm].reshape(shape)

        moved = Case({k: permuted(v) for k, v in case.arrays.items()}, case.params)
        return (
            np.asarray(layout_programs.run_kernel(run, moved, config, backend)),
            permuted(out).astype(np.float64),
            2.0 * permuted(bound_of(case, config, backend)),
        )

    return Relation("element_permutation", relation)


def reflection(run: Callable[[Case, Any, Backend], Any], bound_of: BoundOf) -> Relation:
    """f(x) = a f(-x) + b x + c (``REFLECTIONS``: gelu(x) - gelu(-x) = x, sigmoid(x) +
    sigmoid(-x) = 1, ...), no oracle needed. Negation is exact, so the reflected case
    is exact; each side is within its bound of the exact value, and the right side's
    two float64 additions err by gamma_2(u64) times its terms' magnitudes."""

    def relation(case: Case, config: Any, backend: Backend, out: np.ndarray):
        a, b, c = REFLECTIONS[case.params["activation"]]
        reflected = Case({**case.arrays, "x": -case.arrays["x"]}, case.params)
        mirrored = a * np.asarray(layout_programs.run_kernel(run, reflected, config, backend)).astype(np.float64)
        linear = b * np.asarray(case.arrays["x"], dtype=np.float64)
        allowed = (
            bound_of(case, config, backend)
            + abs(a) * bound_of(reflected, config, backend)
            + gamma(2, unit_roundoff(np.float64)) * (np.abs(mirrored) + np.abs(linear) + abs(c))
        )
        return np.asarray(out), mirrored + linear + c, allowed

    return Relation("reflection", relation)


# ------------------------------------------------------------------------ make_spec


def make_spec(
    kernel: Callable[..., jax.Array],
    *,
    name: str,
    activation: str,
    shapes: Sequence[tuple[int, ...]] = SHAPES,
    dtypes: Sequence[str] = strategies.DTYPES,
    differentiable: bool = True,
    backends: Sequence[str] = GENERIC,
    compute: Compute = Compute(),
) -> KernelSpec:
    """The spec of ``kernel(x, *, backend) = activation(x)``, same shape and dtype.

    ``compute``: the dtype it evaluates f in, for the implementation bound (the
    contract is f32 whatever it says). ``differentiable=False`` drops the gradient
    checks. No bad inputs: an activation is defined on every shape, and which dtypes
    a kernel takes is its author's choice (add refusals your kernel promises with
    ``dataclasses.replace(spec, bad_inputs=...)``)."""
    # an unknown activation or compute dtype fails here, not in the first check
    activation_model(activation)
    unit_roundoff(compute.dtype)

    def run(case: Case, config: Any, backend: Backend) -> jax.Array:
        return kernel(jnp.asarray(case.arrays["x"]), backend=backend)

    def kernel_vjp(case: Case, config: Any, backend: Backend) -> dict[str, jax.Array]:
        _, pullback = jax.vjp(lambda x: kernel(x, backend=backend), jnp.asarray(case.arrays["x"]))
        (dx,) = pullback(jnp.asarray(case.arrays["cotangent"]))
        return {"dx": dx}

    def bound_of(case: Case, config: Any, backend: Backend) -> np.ndarray:
        return bound(case, oracle(case), config, arithmetic_for(backend))

    reference = jax.jit(get_activation(activation))  # in x's dtype, as a user writes it
    return KernelSpec(
        name=name,
        dtypes=dtypes,
        cases=functools.partial(cases, activation, shapes=shapes),
        kernel=run,
        reference=lambda case: reference(jnp.asarray(case.arrays["x"])),
        oracle=oracle,
        expected=lambda ref: ref.out,
        bound=bound,
        contract=contract,
        **config_fields(compute),
        gradients=GradientSpec(kernel_vjp, oracle_vjp, gradient_bound, contract=gradient_contract)
        if differentiable
        else None,
        relations=(element_permutation(run, bound_of), reflection(run, bound_of)),
        backends=backends,
    )


# ------------------------------------------------------------------------ builder


def elementwise_like(
    fn: Callable[..., jax.Array],
    *,
    name: str,
    activation: str,
    shapes: Sequence[tuple[int, ...]] = SHAPES,
    dtypes: Sequence[str] = strategies.DTYPES,
    differentiable: bool = True,
    backends: Sequence[str] = GENERIC,
    interpret: str | None = None,
    compute: Compute = Compute(),
) -> KernelSpec:
    """The spec of a user's elementwise activation ``fn(x)``: ``activation`` (one of
    none, relu, gelu, gelu_tanh, silu, sigmoid) applied to every element, the result
    in x's shape and dtype.

    - ``shapes``: the shapes it accepts (e.g. multiples of its block);
    - ``compute``: the dtype it evaluates f in (default f32), for the implementation
      bound; the contract is f32 and one rounding to x's dtype;
    - ``differentiable``: its VJP (a ``jax.custom_vjp``: pallas_call has none) is checked;
    - ``backends`` / ``interpret``: see ``builders.call_on``.

    A result of another shape or dtype is refused by the adapter (TypeError): the
    bound models the store to x's dtype.
    """

    def adapted(x: jax.Array, *, backend: Any = None) -> jax.Array:
        y = builders.call_on(fn, get_backend(backend), backends, interpret, x)
        if y.shape != x.shape or y.dtype != x.dtype:
            raise TypeError(f"{name} must return x's shape and dtype {x.shape} {x.dtype}, got {y.shape} {y.dtype}")
        return y

    spec = make_spec(
        adapted,
        name=name,
        activation=activation,
        shapes=shapes,
        dtypes=dtypes,
        differentiable=differentiable,
        backends=backends,
        compute=compute,
    )
    return builders.backward_on_backend(spec, interpret)
