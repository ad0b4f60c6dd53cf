"""KernelSpec for kernels/matmul.py."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels import matmul, mosaic_gpu_matmul
from pallascheck.kernels.backends import GENERIC, MOSAIC_GPU, Backend, get_backend
from pallascheck.oracles import chunks
from pallascheck.oracles import matmul as oracle
from pallascheck.oracles.tolerance import Arithmetic, arithmetic_for
from pallascheck.properties import builders, checks, production, relations, strategies
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
    config_fields,
)

M_DIMS = (1, 17, 64)
N_DIMS = (16, 33)
K_DIMS = (7, 64, 100)  # 7 and 100 leave a ragged last K tile for block_k 16 and 32


def _check_bytes(m: int, k: int, n: int, *, held: bool) -> int:
    """The check's device bytes at x [m, k] @ y [k, n] (the production tier's memory
    rule, properties/production.py), whole-size arrays in bytes an element. The check
    streams (oracles/chunks.py); xla_reference is a dense dot no larger than the kernel.
    With its float64 results held on the host (``held``), per element of out (m n):
    the kernel's and xla_reference's outputs (8), the cotangent (4) and its float64
    copy (8), the kernel's saved f32 preactivation (4); per element of x (m k), and
    of y alike: the input (4), the kernel's and xla_reference's gradients (8), the
    float64 copies one oracle function holds at a time and their transposes (|x| and
    its subnormal part, one being made: 24); plus one span's temporaries, two spans'
    results on their way to the host and the comparison's blocks. With them on the
    device, per element of out: the oracle's 4 float64 arrays (32), the four forward
    bounds the runner keeps (kernel, probabilistic, xla_reference's which is the
    contract, default config: 32), exact dz (8), the float64 cotangent (8), out and
    cotangent in the inputs' dtype (2); per element of x and of y: the input (4), |x|
    and its subnormal part in float64 in the gradient bound (16), exact dx (8), two
    gradient bounds (kernel, xla_reference's which is the contract: 16), the spans'
    parts beside their concatenation (8); plus one span's temporaries."""
    if held:
        return 24 * m * n + 36 * (m * k + k * n) + chunks.SPAN_BYTES + chunks.HELD_SPANS_BYTES + checks.HELD_BYTES
    return 82 * m * n + 52 * (m * k + k * n) + chunks.SPAN_BYTES


def _results_on_device_bytes(case: Case) -> int:
    (m, k), n = case.arrays["x"].shape, case.arrays["y"].shape[1]
    return _check_bytes(m, k, n, held=False)


def production_layouts() -> tuple[Layout, ...]:
    """The production tier's layouts of real models (properties/production.py: the
    memory rule, with the results held on the host where the device's share needs it)."""

    def layout(name: str, m: int, k: int, n: int) -> Layout:
        needs, on_device = _check_bytes(m, k, n, held=True), _check_bytes(m, k, n, held=False)
        return Layout(f"{name}: {m}x{k} @ {k}x{n}", dict(m=(m,), n=(n,), k=(k,)), needs, on_device=on_device)

    return (
        layout("square 8192", 8192, 8192, 8192),
        layout("llama-3 8B MLP up, 8k tokens", 8192, 4096, 14336),
        layout("llama-2 7B MLP up, unaligned tokens", 4000, 4096, 11008),
        layout("llama-3 70B MLP down, decode", 1, 28672, 8192),
        layout("llama-3 8B MLP up, decode batch 16", 16, 4096, 14336),
        layout("llama-3 8B MLP up, decode batch 64", 64, 4096, 14336),
    )


LAYOUTS_PRODUCTION = production_layouts()


@dataclasses.dataclass(frozen=True)
class Domain:
    """The inputs a kernel accepts: the default is everything kernels/matmul.py accepts."""

    m: tuple[int, ...] = M_DIMS
    n: tuple[int, ...] = N_DIMS
    k: tuple[int, ...] = K_DIMS
    activations: tuple[str, ...] | None = None  # None: every one the backend's kernel has
    out_float32: tuple[bool, ...] = (False, True)  # out in the input dtype / in f32


DOMAIN = Domain()
# The Mosaic GPU kernel's tiles are 64 rows and 64/128 columns (the warp-specialised
# form: two consumers of 64 columns each): 100 rows make 2 row tiles, 150 columns make
# 3 column tiles of 64 (2 of 128) so that both consumers of a CTA hold real columns, and
# the last CTA's second consumer none (docs/shape_tiers.md).
MOSAIC_GPU_DOMAIN = Domain(m=(1, 17, 100), n=(33, 150))


def cases(dtype: str, backend: Backend, domain: Domain = DOMAIN) -> st.SearchStrategy[Case]:
    if backend.is_mosaic_gpu and domain is DOMAIN:  # a builder's domain is the user's own
        domain = MOSAIC_GPU_DOMAIN

    @st.composite
    def draw(draw_) -> Case:
        m, n, k = (
            draw_(strategies.layout_choice(f"matmul.{a}", b))
            for a, b in (("m", domain.m), ("n", domain.n), ("k", domain.k))
        )
        activations = domain.activations or matmul.supported_activations(backend)
        activation = draw_(strategies.layout_choice("matmul.activation", activations))
        out_dtype = draw_(
            strategies.layout(
                "matmul.out_dtype", st.sampled_from(sorted({"float32" if f32 else dtype for f32 in domain.out_float32}))
            )
        )
        # gelu_tanh promises accuracy only for |x @ y| <= matmul.GELU_TANH_RANGE.
        kinds = ("normal", "large", "subnormal", "few_distinct", "positive")
        kind = draw_(strategies.element_kinds([c for c in kinds if not (c == "large" and activation == "gelu_tanh")]))
        seed = draw_(strategies.seeds())
        # "large" cotangents would overflow the backward products; use N(0,1) ones.
        return Case(
            arrays={
                "x": strategies.elements(seed, (m, k), dtype, kind, reduction=k),
                "y": strategies.elements(seed + 1, (k, n), dtype, kind, reduction=k),
                "cotangent": strategies.elements(seed + 2, (m, n), out_dtype, "normal"),
            },
            params={"activation": activation, "out_dtype": out_dtype},
        )

    return draw()


def _run(kernel: Callable[..., jax.Array], case: Case, config: Any, backend: Backend) -> jax.Array:
    p = case.params
    return kernel(
        jnp.asarray(case.arrays["x"]),
        jnp.asarray(case.arrays["y"]),
        activation=p["activation"],
        out_dtype=p["out_dtype"],
        config=config,
        backend=backend,
    )


def _reference(case: Case) -> jax.Array:
    p = case.params
    return matmul.xla_reference(
        jnp.asarray(case.arrays["x"]),
        jnp.asarray(case.arrays["y"]),
        activation=p["activation"],
        out_dtype=p["out_dtype"],
    )


def _streams(case: Case) -> bool:
    """Whether the case's oracle and bounds take more than one span (oracles/chunks.py)."""
    (m, k), n = case.arrays["x"].shape, case.arrays["y"].shape[1]
    return chunks.streams(n, max(m, k)) or chunks.streams(m, max(k, n))


_per_layout = functools.partial(device_programs.per_layout, streams=_streams)


@_per_layout
def _oracle(case: Case) -> oracle.MatmulOracle:
    return oracle.oracle(case.arrays["x"], case.arrays["y"], activation=case.params["activation"])


def _block_k(config: Any, case: Case) -> int | None:
    # config None: XLA's dot, order unknown; a block of None: all of K, in any order
    return None if config is None else config.block_k or case.arrays["x"].shape[1]


@_per_layout
def _bound(case: Case, ref: oracle.MatmulOracle, config: Any, arith: Arithmetic) -> np.ndarray:
    return oracle.bound(
        ref,
        activation=case.params["activation"],
        operand_dtype=case.arrays["x"].dtype,
        out_dtype=case.params["out_dtype"],
        arith=arith,
        block_k=_block_k(config, case),
    )


def _vjp(fn, case: Case) -> dict[str, jax.Array]:
    _, pullback = jax.vjp(fn, jnp.asarray(case.arrays["x"]), jnp.asarray(case.arrays["y"]))
    dx, dy = pullback(jnp.asarray(case.arrays["cotangent"]))
    return {"dx": dx, "dy": dy}


def _kernel_vjp(kernel: Callable[..., jax.Array], case: Case, config: Any, backend: Backend) -> dict[str, jax.Array]:
    p = case.params
    return _vjp(
        lambda x, y: kernel(x, y, activation=p["activation"], out_dtype=p["out_dtype"], config=config, backend=backend),
        case,
    )


def _reference_vjp(case: Case) -> dict[str, jax.Array]:
    p = case.params
    return _vjp(lambda x, y: matmul.xla_reference(x, y, activation=p["activation"], out_dtype=p["out_dtype"]), case)


@_per_layout
def _oracle_vjp(case: Case, ref: oracle.MatmulOracle) -> dict[str, np.ndarray]:
    a = case.arrays
    return oracle.oracle_vjp(a["x"], a["y"], a["cotangent"], activation=case.params["activation"])


@_per_layout
def _gradient_bound(case, ref, grads, config, arith) -> dict[str, np.ndarray]:
    a = case.arrays
    return oracle.gradient_bound(
        ref,
        grads,
        a["x"],
        a["y"],
        a["cotangent"],
        activation=case.params["activation"],
        operand_dtype=a["x"].dtype,
        arith=arith,
        block_k=_block_k(config, case),
    )


def _bad_inputs() -> list[BadInput]:
    f32 = jnp.ones((4, 8), jnp.float32)
    bf16 = f32.astype(jnp.bfloat16)
    return [
        BadInput(
            "rank-3 x",
            lambda: matmul.matmul(jnp.ones((2, 4, 8)), jnp.ones((8, 4))),
            ValueError,
            r"x must have rank 2.*vmap",
        ),
        BadInput(
            "contracting mismatch",
            lambda: matmul.matmul(f32, jnp.ones((7, 4))),
            ValueError,
            r"contracting dimensions must match",
        ),
        BadInput(
            "integer x",
            lambda: matmul.matmul(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 4), jnp.int32)),
            TypeError,
            r"x must have dtype in",
        ),
        BadInput("mixed dtypes", lambda: matmul.matmul(f32, jnp.ones((8, 4), jnp.bfloat16)), TypeError, r"same dtype"),
        BadInput(
            "unknown activation",
            lambda: matmul.matmul(f32, f32.T, activation="swish2"),
            ValueError,
            r"activation must be one of",
        ),
        BadInput(
            "block not power of two",
            lambda: matmul.Config(block_m=24),
            ValueError,
            r"config.block_m must be a power of two",
        ),
        BadInput(
            "block below 16",
            lambda: matmul.Config(block_k=8),
            ValueError,
            r"config.block_k must be a power of two >= 16",
        ),
        BadInput(
            "config type",
            lambda: matmul.matmul(f32, f32.T, config=cast(Any, {"block_m": 16})),
            TypeError,
            r"config must be of type matmul.Config",
        ),
        BadInput(
            "empty x",
            lambda: matmul.matmul(jnp.ones((0, 8)), jnp.ones((8, 4))),
            ValueError,
            r"x must not have a zero-sized",
        ),
        BadInput(
            "integer out_dtype",
            lambda: matmul.matmul(f32, f32.T, out_dtype=jnp.int8),
            TypeError,
            r"out_dtype must have dtype in",
        ),
        BadInput(
            "f32 on Mosaic GPU",
            lambda: matmul.matmul(f32, f32.T, backend="mosaic_gpu_interpret"),
            TypeError,
            r"bfloat16 or float16 inputs, got float32",
        ),
        BadInput(
            "generic config on Mosaic GPU",
            lambda: matmul.matmul(bf16, bf16.T, config=matmul.Config(), backend="mosaic_gpu_interpret"),
            TypeError,
            r"config must be of type mosaic_gpu_matmul.Config on backend mosaic_gpu_interpret",
        ),
        BadInput(
            "Mosaic GPU tile_m",
            lambda: mosaic_gpu_matmul.Config(tile_m=32),
            ValueError,
            r"config.tile_m must be 64 or 128",
        ),
        BadInput(
            "exact gelu on Mosaic GPU",
            lambda: matmul.matmul(bf16, bf16.T, activation="gelu", backend="mosaic_gpu_interpret"),
            ValueError,
            r"not supported on backend mosaic_gpu_interpret",
        ),
    ]


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The tiling of a kernel that is not ours: its block along K (None, unknown: all
    of K in any order, the contract)."""

    block_k: int | None = None


def _paths(blocks: Blocks | None, domain: Domain) -> tuple[CodePath, ...]:
    """The code paths every small-tier run reaches (docs/shape_tiers.md, made a rule)."""
    k_tail = CodePath(
        "several K tiles and a ragged last one",
        lambda case, config: builders.ragged_tiles(case.arrays["x"].shape[1], builders.reduction_block(config)),
    )
    if blocks is not None:  # a user's kernel: what its declared tiling makes of the draws
        reachable = blocks.block_k and builders.tiles_reachable(domain.k, blocks.block_k)
        return (dataclasses.replace(k_tail, required=False),) if reachable else ()
    ws = ("mosaic_gpu", "mosaic_gpu_interpret")
    return (
        k_tail,
        CodePath(
            "several row tiles and a ragged last one",
            lambda case, config: builders.ragged_tiles(case.arrays["x"].shape[0], builders.row_block(config)),
        ),
        CodePath(
            "several column tiles and a ragged last one",
            lambda case, config: builders.ragged_tiles(case.arrays["y"].shape[1], builders.column_block(config)),
        ),
        # the warp-specialised CTA spans consumers x tile_n columns, tile_n a consumer
        CodePath(
            "warp-specialised, second consumer on real columns",
            lambda case, config: config.consumers == 2 and case.arrays["y"].shape[1] > config.tile_n,
            backends=ws,
        ),
        CodePath(
            "warp-specialised, second consumer on padding only",
            lambda case, config: (
                config.consumers == 2 and 0 < case.arrays["y"].shape[1] % (2 * config.tile_n) <= config.tile_n
            ),
            backends=ws,
        ),
    )


def _parameters(blocks: Blocks | None) -> tuple[Parameter, ...]:
    """The discrete parameters whose pairs every small-tier run meets (ours only: a
    user's kernel has one config, and its domain may narrow the rest)."""
    if blocks is not None:
        return ()
    return (
        builders.config_parameter(builders.reduction_name, ("K block 16", "K block 32"), builders.GENERIC_INTERPRETED),
        builders.config_parameter(builders.warpgroups, builders.WARPGROUPS, MOSAIC_GPU),
        Parameter(
            "K tail",
            (False, True),
            lambda case, config: (case.arrays["x"].shape[1] % (builders.reduction_block(config) or 1) != 0,),
        ),
        *builders.activation_parameters(GENERIC + MOSAIC_GPU),
        builders.input_kind(builders.DOT_KINDS),
    )


def make_spec(
    kernel: Callable[..., jax.Array] = matmul.matmul,
    name: str = "matmul",
    differentiable: bool = True,
    *,
    domain: Domain = DOMAIN,
    blocks: Blocks | None = None,
    dtypes: Sequence[str] = strategies.DTYPES,
    backends: Sequence[str] = GENERIC + MOSAIC_GPU,
    bad_inputs: Callable[[], Sequence[BadInput]] | None = None,
) -> KernelSpec:
    """The matmul spec, for ``kernel`` (any callable with matmul.matmul's signature);
    ``differentiable=False`` drops the gradient checks (forward-only kernels);
    ``blocks``: the tiling of a kernel that is not ours (one "config"; the default
    checks ours over its config space)."""

    def configs(case: Case, backend: Backend) -> Sequence[Any]:
        x, y = case.arrays["x"], case.arrays["y"]
        return matmul.configs(
            x.shape[0],
            y.shape[1],
            x.shape[1],
            backend,
            itemsize=x.dtype.itemsize,
            out_itemsize=jnp.dtype(case.params["out_dtype"]).itemsize,
        )

    gradients = GradientSpec(
        functools.partial(_kernel_vjp, kernel),
        _oracle_vjp,
        _gradient_bound,
        reference_vjp=_reference_vjp,
        contract=any_order_gradient_contract(_gradient_bound),
    )
    return KernelSpec(
        name=name,
        dtypes=dtypes,
        cases=functools.partial(cases, domain=domain),
        production=production.production_cases("matmul", LAYOUTS_PRODUCTION, cases, domain),
        production_layouts=LAYOUTS_PRODUCTION,
        results_on_device_bytes=_results_on_device_bytes,
        kernel=functools.partial(_run, kernel),
        reference=_reference,
        oracle=_oracle,
        expected=lambda ref: ref.out,
        bound=_bound,
        contract=any_order_contract(_bound),
        backends=backends,
        paths=_paths(blocks, domain),
        parameters=_parameters(blocks),
        **config_fields(blocks, configs, matmul.Config(), mosaic_gpu_matmul.Config()),
        gradients=gradients if differentiable else None,
        relations=(
            relations.row_permutation(
                ("x", "cotangent"),
                functools.partial(_run, kernel),
                lambda case, config, backend: _bound(case, _oracle(case), config, arithmetic_for(backend)),
            ),
            relations.power_of_two_scaling(
                functools.partial(_run, kernel),
                "x",
                "y",
                lambda case: case.params["activation"] in ("none", "relu"),
            ),
        ),
        bad_inputs=bad_inputs or _bad_inputs,
    )


SPEC = make_spec()


# ------------------------------------------------------------------------ builder


def matmul_like(
    fn: Callable[..., jax.Array],
    *,
    name: str,
    out_float32: bool = False,
    m: Sequence[int] = M_DIMS,
    n: Sequence[int] = N_DIMS,
    k: Sequence[int] = K_DIMS,
    blocks: Blocks = Blocks(),
    dtypes: Sequence[str] = strategies.DTYPES,
    differentiable: bool = True,
    backends: Sequence[str] = GENERIC,
    interpret: str | None = None,
) -> KernelSpec:
    """The spec of a user's ``fn(x, y) -> x @ y`` for x [m, k] and y [k, n], products
    and sums in f32, the output in the inputs' dtype (``out_float32``: in f32).

    - ``m``, ``n``, ``k``: the sizes it accepts (e.g. multiples of its tiles);
    - ``blocks``: its block along K, for the implementation bound;
    - ``backends`` / ``interpret``: see ``builders.call_on``.
    """

    def adapted(x, y, *, activation="none", out_dtype=None, config=None, backend=None):
        del activation, out_dtype, config  # the domain draws no activation and fn's own out dtype
        return builders.call_on(fn, get_backend(backend), backends, interpret, x, y)

    def bad() -> list[BadInput]:
        chosen = builders.checking_backend(backends)
        x = jnp.ones((max(m), max(k)), dtypes[-1])
        return [
            builders.must_refuse(
                "contracting dimensions differ",
                lambda: adapted(x, jnp.ones((max(k) + 8, max(n)), dtypes[-1]), backend=chosen),
            )
        ]

    domain = Domain(tuple(m), tuple(n), tuple(k), activations=("none",), out_float32=(out_float32,))
    spec = make_spec(
        adapted, name, differentiable, domain=domain, blocks=blocks, dtypes=dtypes, backends=backends, bad_inputs=bad
    )
    return builders.backward_on_backend(spec, interpret)
