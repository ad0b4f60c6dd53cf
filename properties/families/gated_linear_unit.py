"""KernelSpec for kernels/gated_linear_unit.py (SwiGLU, GeGLU, bilinear, ...)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels import gated_linear_unit as glu
from pallascheck.kernels import matmul, mosaic_gpu_glu
from pallascheck.kernels.backends import GENERIC, MOSAIC_GPU, Backend
from pallascheck.oracles import chunks
from pallascheck.oracles import gated_linear_unit as oracle
from pallascheck.oracles.tolerance import Arithmetic
from pallascheck.properties import builders, checks, production, strategies
from pallascheck.properties.device import programs as device_programs
from pallascheck.properties.spec import (
    BadInput,
    Case,
    CodePath,
    GradientSpec,
    KernelSpec,
    Layout,
    Parameter,
    any_order_contract,
    any_order_gradient_contract,
)

LEADING_SHAPES = ((17,), (2, 20))  # T = 17 or 40 tokens: never a multiple of the row tile
D_DIMS = (7, 100)  # 7: one ragged K tile; 100: 2-7 K tiles of 16-64 and a ragged last one
F_DIMS = (16, 33)
# The Mosaic GPU forward tiles by 64 tokens and 64/128 features: 100 tokens and 100
# features make two tiles each, with a ragged last one (docs/shape_tiers.md).
MOSAIC_GPU_LEADING_SHAPES = ((17,), (2, 50))
MOSAIC_GPU_F_DIMS = (33, 100)
DTYPES = ("float32", "bfloat16", "float16")


def _check_bytes(t: int, d: int, f: int, *, held: bool) -> int:
    """The check's device bytes at t tokens of d inputs and f outputs (the production
    tier's memory rule, properties/production.py), whole-size arrays in bytes an
    element. The check streams (oracles/chunks.py); xla_reference is two dense dots no
    larger than the kernel's. With its float64 results held on the host (``held``), per
    element of out (t f): the kernel's and xla_reference's outputs (8), the cotangent
    (4) and its float64 copy (8), the f32 gate and up the kernel saves for its
    backward (8) and xla_reference's (8); per element of x (t d), and of the weights
    (d 2f) alike: the input (4), the kernel's and xla_reference's gradients (8), the
    float64 copies one oracle function holds at a time (the weights, their magnitudes
    and subnormal parts: 24); plus one span's temporaries, two spans' results on their
    way to the host and the comparison's blocks. With them on the device, per element
    of the [t, 2f] projections: the oracle's 7 float64 [t, f] arrays (28), four forward
    bounds the runner keeps ([t, f]; xla_reference's is the contract: 16), exact dgate
    and dup (8), the float64 cotangent (4), the cotangent in the inputs' dtype (1): 60
    allowed; per element of x and of the weights: the input (4), |x| and its subnormal
    part in float64 in the gradient bound (16), exact dx (8), two gradient bounds
    (kernel, contract: 16), the spans' parts beside their concatenation (8); plus one
    span's temporaries."""
    if held:
        return 36 * t * f + 36 * (t * d + d * 2 * f) + chunks.SPAN_BYTES + chunks.HELD_SPANS_BYTES + checks.HELD_BYTES
    return 60 * t * 2 * f + 52 * (t * d + d * 2 * f) + chunks.SPAN_BYTES


def _results_on_device_bytes(case: Case) -> int:
    x, w = case.arrays["x"], case.arrays["weights"]
    return _check_bytes(math.prod(x.shape[:-1]), x.shape[-1], w.shape[2], held=False)


def production_layouts() -> tuple[Layout, ...]:
    """The production tier's layouts of real models (properties/production.py: the
    memory rule, with the results held on the host where the device's share needs it)."""

    def layout(name: str, tokens: tuple[int, ...], d: int, f: int) -> Layout:
        needs = _check_bytes(math.prod(tokens), d, f, held=True)
        return Layout(
            f"{name}: tokens {tokens} d{d} f{f}",
            dict(leading=(tokens,), d=(d,), f=(f,), fan_in_weights=True),
            needs,
            on_device=_check_bytes(math.prod(tokens), d, f, held=False),
        )

    return (
        layout("llama-3 8B, 8k tokens", (8192,), 4096, 14336),
        layout("llama-2 13B, batch 2 x 2000", (2, 2000), 5120, 13824),
        layout("llama-3 8B, decode batch 16", (16,), 4096, 14336),
        layout("Mixtral 8x7B expert, 4k tokens", (4096,), 4096, 14336),
    )


LAYOUTS_PRODUCTION = production_layouts()


def _reduction(kind: str, d: int, dtype: str) -> float:
    """The output multiplies two d-term dots, so "large" inputs are scaled for each
    dot to reach about sqrt(max) / 8 (elements() scales one dot to max / (8 r)),
    keeping the product, not each factor, below the dtype's range."""
    if kind != "large":
        return d
    return d * float(np.sqrt(float(ml_dtypes.finfo(strategies.np_dtype(dtype)).max)))


@dataclasses.dataclass(frozen=True)
class Domain:
    """The inputs cases are drawn from: token shapes, model and hidden widths."""

    leading: tuple[tuple[int, ...], ...] = LEADING_SHAPES
    d: tuple[int, ...] = D_DIMS
    f: tuple[int, ...] = F_DIMS
    # Weights at a model's initial scale, 1/sqrt(d) (a power of two near it, so the
    # drawn values scale exactly), for every kind but "large" and "subnormal", which set
    # their own magnitudes. Without it, at d 4096 in float16 the gate and up dots of
    # "positive" entries are each about d/4 and their product, about 1e6, overflows
    # (65504): the output is inf and no bound can judge it. The production tier sets it.
    fan_in_weights: bool = False


DOMAIN = Domain()
MOSAIC_GPU_DOMAIN = Domain(leading=MOSAIC_GPU_LEADING_SHAPES, f=MOSAIC_GPU_F_DIMS)


def cases(dtype: str, backend: Backend, domain: Domain = DOMAIN) -> st.SearchStrategy[Case]:
    if backend.is_mosaic_gpu and domain is DOMAIN:
        domain = MOSAIC_GPU_DOMAIN

    @st.composite
    def draw(draw_) -> Case:
        lead = draw_(strategies.layout_choice("gated_linear_unit.leading", domain.leading))
        d, f = (
            draw_(strategies.layout_choice(f"gated_linear_unit.{a}", bucket))
            for a, bucket in (("d", domain.d), ("f", domain.f))
        )
        activation = draw_(
            strategies.layout_choice("gated_linear_unit.activation", matmul.supported_activations(backend))
        )
        # gelu_tanh promises accuracy only for |x @ W| <= matmul.GELU_TANH_RANGE.
        kinds = ("normal", "large", "subnormal", "few_distinct", "positive")
        kind = draw_(strategies.element_kinds([c for c in kinds if not (c == "large" and activation == "gelu_tanh")]))
        seed = draw_(strategies.seeds())
        r = _reduction(kind, d, dtype)
        weights = strategies.elements(seed + 1, (d, 2, f), dtype, kind, reduction=r)
        if domain.fan_in_weights and kind not in ("large", "subnormal"):
            # a power of two: exact, and cast back (numpy promotes a bfloat16 array
            # times a Python float to float32, which the kernel refuses)
            weights = (weights * 2.0 ** -round(np.log2(np.sqrt(d)))).astype(weights.dtype)
        return Case(
            arrays={
                "x": strategies.elements(seed, lead + (d,), dtype, kind, reduction=r),
                "weights": weights,
                "cotangent": strategies.elements(seed + 2, lead + (f,), dtype, "normal"),
            },
            params={"activation": activation},
        )

    return draw()


def _run(kernel: Callable[..., jax.Array], case: Case, config: Any, backend: Backend) -> jax.Array:
    a = case.arrays
    return kernel(
        jnp.asarray(a["x"]),
        jnp.asarray(a["weights"]),
        activation=case.params["activation"],
        config=config,
        backend=backend,
    )


def _streams(case: Case) -> bool:
    """Whether the case's oracle and bounds take more than one span (oracles/chunks.py)."""
    x, f = case.arrays["x"], case.arrays["weights"].shape[2]
    t, d = math.prod(x.shape[:-1]), x.shape[-1]
    return chunks.streams(t, max(d, 2 * f)) or chunks.streams(f, 2 * max(t, d))


_per_layout = functools.partial(device_programs.per_layout, streams=_streams)


@_per_layout
def _oracle(case: Case) -> oracle.GluOracle:
    return oracle.oracle(case.arrays["x"], case.arrays["weights"], activation=case.params["activation"])


def _block_k(config: Any) -> int | None:
    return None if config is None else config.block_k


@_per_layout
def _bound(case: Case, ref: oracle.GluOracle, config: Any, arith: Arithmetic) -> np.ndarray:
    return oracle.bound(
        ref,
        activation=case.params["activation"],
        operand_dtype=case.arrays["x"].dtype,
        arith=arith,
        block_k=_block_k(config),
    )


def _kernel_vjp(kernel: Callable[..., jax.Array], case: Case, config: Any, backend: Backend) -> dict[str, jax.Array]:
    a, act = case.arrays, case.params["activation"]
    _, pullback = jax.vjp(
        lambda x, w: kernel(x, w, activation=act, config=config, backend=backend),
        jnp.asarray(a["x"]),
        jnp.asarray(a["weights"]),
    )
    dx, dw = pullback(jnp.asarray(a["cotangent"]))
    return {"dx": dx, "dweights": dw}


@_per_layout
def _oracle_vjp(case: Case, ref: oracle.GluOracle) -> dict[str, np.ndarray]:
    a = case.arrays
    return oracle.oracle_vjp(a["x"], a["weights"], a["cotangent"], activation=case.params["activation"])


@_per_layout
def _gradient_bound(case, ref, grads, config, arith) -> dict[str, np.ndarray]:
    a = case.arrays
    return oracle.gradient_bound(
        ref,
        grads,
        a["x"],
        a["weights"],
        a["cotangent"],
        activation=case.params["activation"],
        operand_dtype=a["x"].dtype,
        arith=arith,
        block_k=_block_k(config),
    )


def _bad_inputs() -> list[BadInput]:
    x, w = jnp.ones((4, 8), jnp.float32), jnp.ones((8, 2, 16), jnp.float32)
    call = glu.gated_linear_unit
    return [
        BadInput(
            "weights not [d, 2, f]", lambda: call(x, jnp.ones((8, 3, 16))), ValueError, r"weights.shape\[1\] must be 2"
        ),
        BadInput("rank-2 weights", lambda: call(x, jnp.ones((8, 32))), ValueError, r"weights must have rank 3"),
        BadInput(
            "contracting mismatch",
            lambda: call(x, jnp.ones((7, 2, 16))),
            ValueError,
            r"contracting dimensions must match",
        ),
        BadInput(
            "integer x", lambda: call(x.astype(jnp.int32), w.astype(jnp.int32)), TypeError, r"x must have dtype in"
        ),
        BadInput("mixed dtypes", lambda: call(x, w.astype(jnp.bfloat16)), TypeError, r"same dtype"),
        BadInput(
            "unknown activation", lambda: call(x, w, activation="swish2"), ValueError, r"activation must be one of"
        ),
        BadInput(
            "exact gelu on triton",
            lambda: call(x, w, activation="gelu", backend="triton"),
            ValueError,
            r"no erf; use 'gelu_tanh'",
        ),
        BadInput(
            "config type",
            lambda: call(x, w, config=cast(Any, {"block_m": 16})),
            TypeError,
            r"config must be of type gated_linear_unit.Config",
        ),
        BadInput("empty x", lambda: call(jnp.ones((0, 8)), w), ValueError, r"x must not have a zero-sized"),
        BadInput(
            "f32 on Mosaic GPU",
            lambda: call(x, w, backend="mosaic_gpu_interpret"),
            TypeError,
            r"bfloat16 or float16 inputs, got float32",
        ),
        BadInput(
            "generic config on Mosaic GPU",
            lambda: call(
                x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), config=glu.Config(), backend="mosaic_gpu_interpret"
            ),
            TypeError,
            r"config must be of type mosaic_gpu_glu.Config on backend mosaic_gpu_interpret",
        ),
    ]


def _paths() -> tuple[CodePath, ...]:
    """The code paths every small-tier run reaches (docs/shape_tiers.md, made a rule)."""

    return (
        CodePath(
            "several K tiles and a ragged last one",
            lambda case, config: builders.ragged_tiles(case.arrays["x"].shape[-1], builders.reduction_block(config)),
        ),
        CodePath(
            "several row tiles and a ragged last one",
            lambda case, config: builders.ragged_tiles(
                int(np.prod(case.arrays["x"].shape[:-1])), builders.row_block(config)
            ),
        ),
    )


def _parameters() -> tuple[Parameter, ...]:
    """The discrete parameters whose pairs every small-tier run meets."""
    return (
        builders.config_parameter(builders.reduction_name, ("K block 16", "K block 32"), builders.GENERIC_INTERPRETED),
        builders.config_parameter(builders.reduction_name, ("K block 32", "K block 64"), ("mosaic_gpu_interpret",)),
        *builders.activation_parameters(GENERIC + MOSAIC_GPU),
        builders.input_kind(builders.DOT_KINDS),
    )


def make_spec(
    kernel: Callable[..., jax.Array] = glu.gated_linear_unit,
    name: str = "gated_linear_unit",
    differentiable: bool = True,
) -> KernelSpec:
    """The GLU spec for ``kernel`` (gated_linear_unit's signature); ``differentiable=False``
    drops the gradient checks. xla_reference's autodiff graph (no rounding of dz,
    two dots summed for dx) is not the kernel's, so only its forward is checked."""
    gradients = GradientSpec(
        functools.partial(_kernel_vjp, kernel),
        _oracle_vjp,
        _gradient_bound,
        contract=any_order_gradient_contract(_gradient_bound),
    )
    return KernelSpec(
        name=name,
        dtypes=DTYPES,
        cases=cases,
        production=production.production_cases("gated_linear_unit", LAYOUTS_PRODUCTION, cases, DOMAIN),
        production_layouts=LAYOUTS_PRODUCTION,
        results_on_device_bytes=_results_on_device_bytes,
        kernel=functools.partial(_run, kernel),
        reference=lambda case: glu.xla_reference(
            jnp.asarray(case.arrays["x"]), jnp.asarray(case.arrays["weights"]), activation=case.params["activation"]
        ),
        oracle=_oracle,
        expected=lambda ref: ref.out,
        bound=_bound,
        contract=any_order_contract(_bound),
        configs=lambda case, backend: glu.configs(
            int(np.prod(case.arrays["x"].shape[:-1])),
            case.arrays["weights"].shape[2],
            case.arrays["x"].shape[-1],
            backend,
            itemsize=case.arrays["x"].dtype.itemsize,
        ),
        default_config=glu.Config(),
        gradients=gradients if differentiable else None,
        bad_inputs=_bad_inputs,
        backends=GENERIC + MOSAIC_GPU,
        paths=_paths(),
        parameters=_parameters(),
        dtypes_on={name: ("bfloat16", "float16") for name in MOSAIC_GPU},
        default_config_on={name: mosaic_gpu_glu.Config() for name in MOSAIC_GPU},
    )


SPEC = make_spec()
