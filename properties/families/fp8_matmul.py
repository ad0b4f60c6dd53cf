"""KernelSpecs for the block-scaled FP8 matmul (kernels/fp8_matmul.py) and the FP8
quantiser (kernels/fp8.py)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels import fp8, fp8_matmul, mosaic_gpu_fp8_matmul
from pallascheck.kernels.backends import MOSAIC_GPU, Backend
from pallascheck.oracles import fp8_matmul as oracle
from pallascheck.oracles.tolerance import Arithmetic
from pallascheck.properties import builders, production, strategies
from pallascheck.properties.device import programs as device_programs
from pallascheck.properties.spec import BadInput, Case, CodePath, KernelSpec, Layout, Parameter

BLOCK = fp8.SCALE_BLOCK
BACKENDS = ("interpret",) + MOSAIC_GPU
# 100 rows: 2 row tiles of 64 (Mosaic GPU), 4 of 32; 150 columns: 3 tiles of 64, 2 of 128,
# and two w_scale row blocks; K 300: three scale blocks, the last partial; K 100: one.
M_DIMS = (1, 17, 100)
N_DIMS = (33, 150)
K_DIMS = (100, 300)


@dataclasses.dataclass(frozen=True)
class Domain:
    m: tuple[int, ...] = M_DIMS
    n: tuple[int, ...] = N_DIMS
    k: tuple[int, ...] = K_DIMS


def _check_bytes(m: int, k: int, n: int) -> int:
    """The check's device bytes at x [m, k] @ w [n, k] (the production tier's memory
    rule, properties/production.py), every array counted live at once, in bytes an
    element. Per element of the operands (m k + n k): the FP8 inputs (1) and their
    scales (at most 1/8: one f32 a row of 128); xla_reference's dequantised f32 copies
    (4); the oracle's float64 scale broadcasts, dequantised operands and their
    magnitudes (24). Per element of out (m n): the kernel's, the second run's and
    xla_reference's bfloat16 outputs (6); the oracle's product and magnitude (16); a
    bound's result and as much again of temporaries (16); the comparison's float64
    difference, scaled error and mask-sized temporaries (24). XLA:CPU's buffer
    assignment of the oracle at DeepSeek-V3's attention out, 2.5 GiB in all (0.17 of
    inputs, 0.44 of outputs, 1.88 of temporaries, 8 (2 m k + n k) bytes), and of each
    bound, 0.22 GiB of output and none of temporaries, are within these counts. The
    oracle is not chunked: at the largest layout this is 6.7 GiB."""
    operands, out = m * k + n * k, m * n
    return int((1 + 1 / 8 + 4 + 24) * operands) + (6 + 16 + 16 + 24) * out


def production_layouts() -> tuple[Layout, ...]:
    """Layouts of real models; K >= 4096 is where a missing promotion shows (DeepSeek-V3, 3.3)."""

    def layout(name: str, m: int, k: int, n: int) -> Layout:
        return Layout(f"{name}: {m}x{k} @ {k}x{n}", dict(m=(m,), n=(n,), k=(k,)), _check_bytes(m, k, n))

    return (
        layout("square 4096", 4096, 4096, 4096),
        layout("DeepSeek-V3 attention out, 4k tokens", 4096, 16384, 7168),
        layout("DeepSeek-V3 MoE expert up, 4k tokens", 4096, 7168, 4096),
    )


LAYOUTS_PRODUCTION = production_layouts()


def cases(dtype: str, backend: Backend, domain: Domain = Domain()) -> st.SearchStrategy[Case]:
    @st.composite
    def draw(draw_) -> Case:
        m, n, k = (
            draw_(strategies.layout_choice(f"fp8_matmul.{a}", b))
            for a, b in (("m", domain.m), ("n", domain.n), ("k", domain.k))
        )
        # a kind per operand: the activations' and the weights' scales and outliers
        # vary apart, and a run of few examples (one case each in the interpreter)
        # draws every kind in half as many examples
        x_kind, w_kind = (draw_(strategies.element_kinds(strategies.FP8_KINDS)) for _ in range(2))
        seed = draw_(strategies.seeds())
        x, x_scale = strategies.fp8_blocks(seed, (m, k), dtype, x_kind, (1, BLOCK))
        w, w_scale = strategies.fp8_blocks(seed + 1, (n, k), dtype, w_kind, (BLOCK, BLOCK))
        return Case(arrays={"x": x, "x_scale": x_scale, "w": w, "w_scale": w_scale}, params={"out_dtype": "bfloat16"})

    return draw()


def _operands(case: Case) -> tuple[jax.Array, ...]:
    return tuple(jnp.asarray(case.arrays[name]) for name in ("x", "x_scale", "w", "w_scale"))


def _run(kernel: Callable[..., jax.Array], case: Case, config: Any, backend: Backend) -> jax.Array:
    return kernel(*_operands(case), out_dtype=case.params["out_dtype"], config=config, backend=backend)


def _reference(case: Case) -> jax.Array:
    return fp8_matmul.xla_reference(*_operands(case), out_dtype=case.params["out_dtype"])


@device_programs.per_layout
def _oracle(case: Case) -> oracle.Fp8MatmulOracle:
    a = case.arrays
    return oracle.oracle(a["x"], a["x_scale"], a["w"], a["w_scale"])


@device_programs.per_layout
def _bound(case: Case, ref: oracle.Fp8MatmulOracle, config: Any, arith: Arithmetic) -> np.ndarray:
    out_dtype = case.params["out_dtype"]
    if config is None:  # xla_reference
        return oracle.reference_bound(ref, arith=arith, out_dtype=out_dtype)
    return oracle.bound(ref, config=config, arith=arith, out_dtype=out_dtype)


@device_programs.per_layout
def _contract(case: Case, ref: oracle.Fp8MatmulOracle, arith: Arithmetic) -> np.ndarray:
    return oracle.contract(ref, arith=arith, out_dtype=case.params["out_dtype"])


def _bad_inputs() -> list[BadInput]:
    x = jnp.ones((4, 256), jnp.float8_e4m3fn)
    xs = jnp.ones((4, 2), jnp.float32)
    w = jnp.ones((8, 256), jnp.float8_e4m3fn)
    ws = jnp.ones((1, 2), jnp.float32)
    call = fp8_matmul.fp8_matmul
    return [
        BadInput("bf16 x", lambda: call(x.astype(jnp.bfloat16), xs, w, ws), TypeError, r"x must have dtype in"),
        BadInput("e5m2 w", lambda: call(x, xs, w.astype(jnp.float8_e5m2), ws), TypeError, r"w must have dtype in"),
        BadInput("bf16 scale", lambda: call(x, xs.astype(jnp.bfloat16), w, ws), TypeError, r"x_scale must have"),
        BadInput("w not K-major", lambda: call(x, xs, w.T, ws), ValueError, r"contracting dimensions must match"),
        BadInput("x_scale per tensor", lambda: call(x, xs[:1, :1], w, ws), ValueError, r"x_scale must have shape"),
        BadInput("w_scale per row", lambda: call(x, xs, w, jnp.ones((8, 2))), ValueError, r"w_scale must have shape"),
        BadInput("rank-3 x", lambda: call(x[None], xs, w, ws), ValueError, r"x must have rank 2"),
        BadInput("int8 out", lambda: call(x, xs, w, ws, out_dtype=jnp.int8), TypeError, r"out_dtype must have"),
        BadInput(
            "promotion across scale blocks",
            lambda: fp8_matmul.Config(promote_every=256),
            ValueError,
            r"config.promote_every must divide 128",
        ),
        BadInput(
            "Mosaic GPU promotion below one wgmma",
            lambda: mosaic_gpu_fp8_matmul.Config(promote_every=16),
            ValueError,
            r"config.promote_every must be 32, 64 or 128",
        ),
        BadInput(
            "Mosaic GPU consumer tile past its registers",
            lambda: mosaic_gpu_fp8_matmul.Config(tile_m=128, tile_n=128, consumers=2),
            ValueError,
            r"config.tile_m \* config.tile_n must be <= 8192 with consumers=2",
        ),
        BadInput(
            "generic config on Mosaic GPU",
            lambda: call(x, xs, w, ws, config=fp8_matmul.Config(), backend="mosaic_gpu_interpret"),
            TypeError,
            r"config must be of type mosaic_gpu_fp8_matmul.Config",
        ),
    ]


def _row_tile(config: Any) -> int | None:
    """The rows one tile (one CTA, with Mosaic GPU's consumers stacked) computes."""
    return getattr(config, "cta_m", None) or builders.row_block(config)


def _paths() -> tuple[CodePath, ...]:
    """The code paths every small-tier run reaches."""

    def k_of(case: Case) -> int:
        return case.arrays["x"].shape[1]

    def warp_specialised(config: Any) -> bool:
        return getattr(config, "consumers", 1) == 2

    def output_tiles(case: Case, config: Any) -> int:
        (m, _), n = case.arrays["x"].shape, case.arrays["w"].shape[0]
        return -(-m // config.cta_m) * -(-n // config.tile_n)

    return (
        CodePath("several scale blocks along K, the last partial", lambda case, config: k_of(case) > BLOCK),
        CodePath(
            "several promotions per scale block",
            lambda case, config: config.promote_every < BLOCK and k_of(case) > config.promote_every,
        ),
        CodePath(
            "several row tiles and a ragged last one",
            lambda case, config: builders.ragged_tiles(case.arrays["x"].shape[0], _row_tile(config)),
        ),
        CodePath(
            "several column tiles and a ragged last one",
            lambda case, config: builders.ragged_tiles(case.arrays["w"].shape[0], builders.column_block(config)),
        ),
        CodePath(
            "a warp-specialised CTA's second consumer on real rows",
            lambda case, config: warp_specialised(config) and case.arrays["x"].shape[0] > config.tile_m,
            backends=MOSAIC_GPU,
        ),
        CodePath(
            "a consumer promoting a span while the tensor core sums the next (two spans a step)",
            lambda case, config: getattr(config, "spans_per_step", 1) == 2 and k_of(case) > config.promote_every,
            backends=MOSAIC_GPU,
        ),
        CodePath(
            # persistent_ctas: 2 CTAs in the interpreter, one per SM on the GPU
            "a warp-specialised CTA walking several output tiles",
            lambda case, config: warp_specialised(config) and output_tiles(case, config) > 2,
            backends=("mosaic_gpu_interpret",),
        ),
    )


def _parameters() -> tuple[Parameter, ...]:
    """The discrete parameters whose pairs every small-tier run meets: the config (its
    tile; the interpreters' spaces do not depend on the shapes) and each operand's kind."""
    return (
        builders.config_parameter(
            lambda config: f"{config.block_m}x{config.block_n}x{config.block_k}",
            ("32x64x32", "32x128x16", "16x64x16"),
            builders.GENERIC_INTERPRETED,
        ),
        builders.config_parameter(
            lambda config: f"{config.tile_m}x{config.tile_n}", ("64x64", "64x128"), ("mosaic_gpu_interpret",)
        ),
        builders.input_kind(strategies.FP8_KINDS),
    )


def make_spec(kernel: Callable[..., jax.Array] = fp8_matmul.fp8_matmul, name: str = "fp8_matmul") -> KernelSpec:
    """The spec of ``kernel`` (any callable with fp8_matmul.fp8_matmul's signature)."""

    def configs(case: Case, backend: Backend) -> Sequence[Any]:
        x, w = case.arrays["x"], case.arrays["w"]
        return fp8_matmul.configs(x.shape[0], w.shape[0], x.shape[1], backend)

    return KernelSpec(
        name=name,
        dtypes=("float8_e4m3fn",),
        cases=cases,
        production=production.production_cases("fp8_matmul", LAYOUTS_PRODUCTION, cases, Domain()),
        production_layouts=LAYOUTS_PRODUCTION,
        kernel=functools.partial(_run, kernel),
        reference=_reference,
        oracle=_oracle,
        expected=lambda ref: ref.out,
        bound=_bound,
        contract=_contract,
        configs=configs,
        default_config=fp8_matmul.Config(),
        default_config_on={n: mosaic_gpu_fp8_matmul.Config() for n in MOSAIC_GPU},
        backends=BACKENDS,
        paths=_paths(),
        parameters=_parameters(),
        bad_inputs=_bad_inputs,
    )


SPEC = make_spec()


# ---------------------------------------------------------------- the quantiser

Q_M_DIMS = (1, 17, 130)  # 130 rows: two 128-row weight blocks, the last partial
Q_K_DIMS = (100, 300)


def quantize_cases(dtype: str, backend: Backend) -> st.SearchStrategy[Case]:
    @st.composite
    def draw(draw_) -> Case:
        m = draw_(strategies.layout_choice("fp8_quantize.m", Q_M_DIMS))
        k = draw_(strategies.layout_choice("fp8_quantize.k", Q_K_DIMS))
        block = draw_(strategies.layout_choice("fp8_quantize.block", fp8.BLOCKS))
        power_of_two = draw_(strategies.layout_choice("fp8_quantize.power_of_two_scales", (False, True)))
        input_dtype = draw_(strategies.layout_choice("fp8_quantize.input_dtype", ("float32", "bfloat16")))
        kind = draw_(strategies.element_kinds(strategies.QUANTIZE_KINDS))
        a = strategies.quantize_input(draw_(strategies.seeds()), (m, k), input_dtype, kind)
        return Case(
            arrays={"a": a},
            params={"block": list(block), "power_of_two_scales": power_of_two, "format": dtype},
        )

    return draw()


def _dequantized(q: Any, scale: Any, block: Sequence[int]) -> np.ndarray:
    q64 = np.asarray(q).astype(np.float64)
    full = np.repeat(np.repeat(np.asarray(scale, np.float64), block[0], 0), block[1], 1)
    return q64 * full[: q64.shape[0], : q64.shape[1]]


def _quantize_kwargs(case: Case) -> dict[str, Any]:
    p = case.params
    return {
        "block": tuple(p["block"]),
        "dtype": jnp.dtype(p["format"]),
        "power_of_two_scales": p["power_of_two_scales"],
    }


def make_quantize_spec(quantize: Callable[..., Any] = fp8.quantize, name: str = "fp8_quantize") -> KernelSpec:
    """The quantiser's spec: q * scale against the input, per element within the
    format's rounding (``oracle.quantize_bound``), at the scale the recipe defines."""

    def run(case: Case, config: Any, backend: Backend) -> np.ndarray:
        kw = _quantize_kwargs(case)
        q, scale = quantize(jnp.asarray(case.arrays["a"]), config=config, backend=backend, **kw)
        return _dequantized(q, scale, (kw["block"][0], BLOCK))

    def reference(case: Case) -> np.ndarray:
        kw = _quantize_kwargs(case)
        q, scale = fp8.xla_reference(jnp.asarray(case.arrays["a"]), **kw)
        return _dequantized(q, scale, (kw["block"][0], BLOCK))

    def bound(case: Case, ref: oracle.QuantizeOracle, config: Any, arith: Arithmetic) -> np.ndarray:
        # the scale the recipe defines, in f32 (XLA:CPU, exact IEEE division) per element
        kw = _quantize_kwargs(case)
        _, scale = fp8.xla_reference(jnp.asarray(case.arrays["a"]), **kw)
        full = np.repeat(np.repeat(np.asarray(scale, np.float64), kw["block"][0], 0), BLOCK, 1)
        a = case.arrays["a"]
        return oracle.quantize_bound(ref, full[: a.shape[0], : a.shape[1]], dtype=kw["dtype"])

    def configs(case: Case, backend: Backend) -> Sequence[Any]:
        return fp8.configs(tuple(case.params["block"]))

    return KernelSpec(
        name=name,
        dtypes=fp8.FORMAT_NAMES,
        cases=quantize_cases,
        kernel=run,
        reference=reference,
        oracle=lambda case: oracle.quantize_oracle(case.arrays["a"]),
        expected=lambda ref: ref.out,
        bound=bound,
        configs=configs,
        default_config=fp8.Config(),
        backends=("interpret",),
        bad_inputs=lambda: [
            BadInput(
                "int8 format",
                lambda: fp8.quantize(jnp.ones((4, 128)), dtype=jnp.int8),
                TypeError,
                r"dtype must have dtype in",
            ),
            BadInput(
                "block of 64",
                lambda: fp8.quantize(jnp.ones((4, 128)), block=(1, 64)),
                ValueError,
                r"block must be one of",
            ),
            BadInput("rank-1 input", lambda: fp8.quantize(jnp.ones((128,))), ValueError, r"a must have rank 2"),
            BadInput(
                "Mosaic GPU",
                lambda: fp8.quantize(jnp.ones((4, 128)), backend="mosaic_gpu_interpret"),
                NotImplementedError,
                r"no Mosaic GPU version",
            ),
        ],
    )


QUANTIZE_SPEC = make_quantize_spec()
