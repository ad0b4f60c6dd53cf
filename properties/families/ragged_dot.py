"""KernelSpec for kernels/ragged_dot.py (grouped matmul for mixture-of-experts)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels import mosaic_gpu_ragged_dot, ragged_dot
from pallascheck.kernels.backends import GENERIC, MOSAIC_GPU, Backend, get_backend
from pallascheck.oracles import chunks
from pallascheck.oracles import ragged_dot as oracle
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
    config_fields,
)

M_DIMS = (17, 40)  # never a multiple of the 16/32/64 row tiles
N_DIMS = (16, 33)
K_DIMS = (7, 64)  # 7 leaves a ragged last K tile
GROUP_COUNTS = (1, 3, 6)
DTYPES = ("float32", "bfloat16", "float16")

# How rows are split into groups; each layout is a bug class of its own.
GROUP_LAYOUTS = (
    "random",  # uneven sizes, boundaries anywhere (straddling tiles)
    "with_empty",  # some groups empty, including the first (and the last)
    "singletons",  # groups of one row
    "one_group",  # every row in one group, the others empty
    "short",  # sum(group_sizes) < m: trailing rows in no group
)


def _check_bytes(m: int, k: int, n: int, groups: int, *, held: bool) -> int:
    """The check's device bytes at lhs [m, k] and rhs [groups, k, n] (the production
    tier's memory rule, properties/production.py), whole-size arrays in bytes an
    element. The check streams (oracles/chunks.py; rhs in float64 one group at a
    time); xla_reference is apart (``_reference_bytes``). With its float64 results
    held on the host (``held``), per element of out (m n): the kernel's output (4),
    the cotangent (4) and its float64 copy (8); per element of lhs (m k): the input
    (4), the kernel's gradient (4), the float64 copies one oracle function holds at a
    time and their transposes (|lhs| and its subnormal part, one being made: 24); per
    element of rhs (g k n): the input and the kernel's gradient (8); per element of
    one group's rhs (k n): six float64 arrays a span's products use at once (the
    group's copy, magnitude and subnormal part and their transposes: 48; a Mixtral
    expert's [4096, 14336] is 3.5 spans' elements, and held its results peaked at
    10.2 GiB where the rule without it said 10.0, an H200, docs/results.md); plus one
    span's temporaries, two spans' results on their way to the host and the
    comparison's blocks. With them on the device, per element of out: the oracle's 3 float64
    arrays (24), four forward bounds the runner keeps (kernel, probabilistic,
    xla_reference's which is the contract, default config: 32), the float64
    cotangent (8), out and cotangent in the inputs' dtype (4); per element of lhs: the
    input (4), |lhs| and its subnormal part in float64 in the gradient bound (16),
    exact dlhs (8), two gradient bounds (kernel, contract: 16), the spans' parts
    beside their concatenation (8); per element of rhs: the input and the kernel's
    drhs (4), exact drhs (8), two gradient bounds (16), the groups' parts beside their
    stack (8); per element of one group's rhs, as held (48); plus one span's
    temporaries."""
    if held:
        return (
            16 * m * n
            + 32 * m * k
            + 8 * groups * k * n
            + 48 * k * n
            + chunks.SPAN_BYTES
            + chunks.HELD_SPANS_BYTES
            + checks.HELD_BYTES
        )
    return 68 * m * n + 52 * m * k + 36 * groups * k * n + 48 * k * n + chunks.SPAN_BYTES


def _results_on_device_bytes(case: Case) -> int:
    (m, k), (groups, _, n) = case.arrays["lhs"].shape, case.arrays["rhs"].shape
    return _check_bytes(m, k, n, groups, held=False)


def production_layouts() -> tuple[Layout, ...]:
    """The production tier's layouts of real models (properties/production.py: the
    memory rule, with the results held on the host where the device's share needs it)."""

    def layout(name: str, m: int, k: int, n: int, groups: int) -> Layout:
        needs, on_device = _check_bytes(m, k, n, groups, held=True), _check_bytes(m, k, n, groups, held=False)
        fields = dict(m=(m,), n=(n,), k=(k,), groups=(groups,))
        return Layout(f"{name}: m{m} k{k} n{n} g{groups}", fields, needs, on_device=on_device)

    return (
        layout("Mixtral 8x7B", 8192, 4096, 14336, 8),
        layout("1024 rows per group", 8192, 2048, 1024, 8),
        layout("Qwen1.5-MoE 60 experts", 32768, 2048, 1408, 64),
        layout("DeepSeek-V3 256 experts", 16384, 7168, 256, 256),
        layout("64k tokens, 32 experts", 65536, 1024, 1024, 32),
    )


LAYOUTS_PRODUCTION = production_layouts()


def _reference_bytes(case: Case) -> int:
    """xla_reference's device memory: lax.ragged_dot runs densely on a GPU; at m32768
    k2048 n1408 g64 its VJP asked for an f32 [g, m, k] (16 GiB) and for 27.7 GiB in one
    buffer, 10.9 bytes per element of g x m x max(k, n) (16 allowed)."""
    (m, k), (groups, _, n) = case.arrays["lhs"].shape, case.arrays["rhs"].shape
    return 16 * groups * m * max(k, n)


def group_sizes(seed: int, m: int, groups: int, layout: str) -> np.ndarray:
    """int32 sizes of ``groups`` groups over at most ``m`` rows, in ``layout``."""
    rng = np.random.default_rng(seed)
    if layout == "random":
        sizes = rng.multinomial(m, rng.dirichlet(np.ones(groups)))
    elif layout == "with_empty":  # first (and with 3+ groups last) group empty; one other alive
        alive = rng.random(groups) < 0.5
        alive[[0, -1]] = False
        if groups > 1:
            alive[rng.integers(1, groups - 1) if groups > 2 else 1] = True
        weights = np.where(alive, rng.dirichlet(np.ones(groups)), 0.0)
        sizes = rng.multinomial(m, weights / weights.sum()) if alive.any() else np.zeros(groups, np.int64)
    elif layout == "singletons":
        sizes = np.minimum(np.ones(groups, np.int64), m)
    elif layout == "one_group":
        sizes = np.zeros(groups, np.int64)
        sizes[rng.integers(groups)] = m
    elif layout == "short":
        sizes = rng.multinomial(int(rng.integers(0, m)), rng.dirichlet(np.ones(groups)))
    else:
        raise ValueError(f"layout must be one of {GROUP_LAYOUTS}, got {layout!r}")
    return np.asarray(sizes, dtype=np.int32)


@dataclasses.dataclass(frozen=True)
class Domain:
    """The inputs a kernel accepts: the default is everything kernels/ragged_dot.py accepts."""

    m: tuple[int, ...] = M_DIMS
    n: tuple[int, ...] = N_DIMS
    k: tuple[int, ...] = K_DIMS
    groups: tuple[int, ...] = GROUP_COUNTS
    layouts: tuple[str, ...] = GROUP_LAYOUTS
    # the groups cover every row: rows left over go to the last group (for kernels
    # that promise nothing for rows past sum(group_sizes))
    cover_all_rows: bool = False


# k 100: 2-7 K tiles of 16-64 with a ragged last one (the builder keeps K_DIMS: a
# user's kernel may take aligned K only)
DOMAIN = Domain(k=(7, 100))
# The Mosaic GPU kernels' tiles are 64 rows (forward row tiles, drhs row steps) and
# 64/128 columns: 150 rows make 3 row tiles, so uneven groups straddle a row tile; n
# 100 makes 2 column tiles; k 100 makes 4 (tile_k 32) or 2 (tile_k 64) K tiles with a
# ragged last one (docs/shape_tiers.md).
MOSAIC_GPU_DOMAIN = Domain(m=(17, 40, 150), n=(33, 100), k=(7, 100))


def cases(dtype: str, backend: Backend, domain: Domain = DOMAIN) -> st.SearchStrategy[Case]:
    if backend.is_mosaic_gpu and domain is DOMAIN:  # a builder's domain is the user's own
        domain = MOSAIC_GPU_DOMAIN

    @st.composite
    def draw(draw_) -> Case:
        m, n, k = (
            draw_(strategies.layout_choice(f"ragged_dot.{a}", bucket))
            for a, bucket in (("m", domain.m), ("n", domain.n), ("k", domain.k))
        )
        groups = draw_(strategies.layout_choice("ragged_dot.groups", domain.groups))
        layout = draw_(st.sampled_from(domain.layouts))
        kind = draw_(strategies.element_kinds(("normal", "large", "subnormal", "few_distinct", "positive")))
        seed = draw_(strategies.seeds())
        sizes = group_sizes(seed + 2, m, groups, layout)
        if domain.cover_all_rows:
            sizes[-1] += m - sizes.sum()
        return Case(
            arrays={
                "lhs": strategies.elements(seed, (m, k), dtype, kind, reduction=k),
                "rhs": strategies.elements(seed + 1, (groups, k, n), dtype, kind, reduction=k),
                "group_sizes": sizes,
                # "large" cotangents would overflow the backward products; use N(0,1) ones.
                "cotangent": strategies.elements(seed + 3, (m, n), dtype, "normal"),
            },
            # the group layout lives in group_sizes, an array: a param would be part of
            # the compiled program's key (layout_programs.py), and the cases of one
            # layout, which draw their group layouts independently, would each compile
            params={},
        )

    return draw()


def _args(case: Case) -> tuple[jax.Array, jax.Array, jax.Array]:
    a = case.arrays
    return jnp.asarray(a["lhs"]), jnp.asarray(a["rhs"]), jnp.asarray(a["group_sizes"])


def _run(kernel: Callable[..., jax.Array], case: Case, config: Any, backend: Backend) -> jax.Array:
    return kernel(*_args(case), config=config, backend=backend)


def _streams(case: Case) -> bool:
    """Whether the case's oracle, bounds or drhs take more than one span (oracles/chunks.py)."""
    (m, k), (groups, _, n) = case.arrays["lhs"].shape, case.arrays["rhs"].shape
    return chunks.streams(m, max(k, n)) or groups * k * n > chunks.CHUNK_ELEMENTS


_per_layout = functools.partial(device_programs.per_layout, streams=_streams)


@_per_layout
def _oracle(case: Case) -> oracle.RaggedDotOracle:
    a = case.arrays
    return oracle.oracle(a["lhs"], a["rhs"], a["group_sizes"])


def _block_k(config: Any, case: Case) -> int | None:
    # config None: XLA's dot, order unknown; a block of None: all of K, in any order
    return None if config is None else config.block_k or case.arrays["lhs"].shape[1]


@_per_layout
def _bound(case: Case, ref: oracle.RaggedDotOracle, config: Any, arith: Arithmetic) -> np.ndarray:
    return oracle.bound(ref, operand_dtype=case.arrays["lhs"].dtype, arith=arith, block_k=_block_k(config, case))


def _vjp(fn: Callable[..., jax.Array], case: Case) -> dict[str, jax.Array]:
    lhs, rhs, sizes = _args(case)
    _, pullback = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
    dlhs, drhs = pullback(jnp.asarray(case.arrays["cotangent"]))
    return {"dlhs": dlhs, "drhs": drhs}


@_per_layout
def _oracle_vjp(case: Case, ref: oracle.RaggedDotOracle) -> dict[str, np.ndarray]:
    a = case.arrays
    return oracle.oracle_vjp(a["lhs"], a["rhs"], a["group_sizes"], a["cotangent"])


@_per_layout
def _gradient_bound(case, ref, grads, config, arith) -> dict[str, np.ndarray]:
    a = case.arrays
    return oracle.gradient_bound(
        ref,
        grads,
        a["lhs"],
        a["rhs"],
        a["cotangent"],
        operand_dtype=a["lhs"].dtype,
        arith=arith,
        block_k=_block_k(config, case),
        block_rows=None if config is None else config.block_rows or a["lhs"].shape[0],
    )


def _bad_inputs() -> list[BadInput]:
    lhs, rhs = jnp.ones((8, 4), jnp.float32), jnp.ones((3, 4, 5), jnp.float32)
    sizes = jnp.array([2, 0, 3], jnp.int32)
    call = ragged_dot.ragged_dot
    return [
        BadInput(
            "group count mismatch",
            lambda: call(lhs, rhs, jnp.array([2, 3], jnp.int32)),
            ValueError,
            r"group count must match",
        ),
        BadInput(
            "sum > m",
            lambda: call(lhs, rhs, jnp.array([4, 4, 1], jnp.int32)),
            ValueError,
            r"sum\(group_sizes\)=9 must be <= lhs.shape\[0\]=8",
        ),
        BadInput(
            "negative size",
            lambda: call(lhs, rhs, jnp.array([4, -1, 1], jnp.int32)),
            ValueError,
            r"group_sizes must be >= 0",
        ),
        BadInput(
            "float group_sizes",
            lambda: call(lhs, rhs, jnp.array([2.0, 0.0, 3.0])),
            TypeError,
            r"group_sizes must have an integer dtype",
        ),
        BadInput(
            "integer lhs",
            lambda: call(lhs.astype(jnp.int32), rhs.astype(jnp.int32), sizes),
            TypeError,
            r"lhs must have dtype in",
        ),
        BadInput("mixed dtypes", lambda: call(lhs, rhs.astype(jnp.bfloat16), sizes), TypeError, r"same dtype"),
        BadInput("rank-2 rhs", lambda: call(lhs, jnp.ones((4, 5)), sizes), ValueError, r"rhs must have rank 3"),
        BadInput(
            "contracting mismatch",
            lambda: call(lhs, jnp.ones((3, 6, 5)), sizes),
            ValueError,
            r"contracting dimensions must match",
        ),
        BadInput(
            "config type",
            lambda: call(lhs, rhs, sizes, config=cast(Any, {"block_m": 16})),
            TypeError,
            r"config must be of type ragged_dot.Config",
        ),
        BadInput(
            "f32 on Mosaic GPU",
            lambda: call(lhs, rhs, sizes, backend="mosaic_gpu_interpret"),
            TypeError,
            r"bfloat16 or float16 inputs, got float32",
        ),
        BadInput(
            "generic config on Mosaic GPU",
            lambda: call(
                lhs.astype(jnp.bfloat16),
                rhs.astype(jnp.bfloat16),
                sizes,
                config=ragged_dot.Config(),
                backend="mosaic_gpu_interpret",
            ),
            TypeError,
            r"config must be of type mosaic_gpu_ragged_dot.Config on backend mosaic_gpu_interpret",
        ),
        BadInput(
            "Mosaic GPU tile_rows",
            lambda: mosaic_gpu_ragged_dot.Config(tile_rows=32),
            ValueError,
            r"config.tile_rows must be 64 or 128",
        ),
    ]


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The tiling of a kernel that is not ours: its block along K and the rows per
    block of the backward's drhs sums (None, unknown: all of them, in any order)."""

    block_k: int | None = None
    block_rows: int | None = None


def _straddles(case: Case, rows: int | None) -> bool:
    """A group of rows that crosses a boundary of ``rows``-row tiles."""
    if not rows:
        return False
    ends = np.cumsum(np.asarray(case.arrays["group_sizes"], np.int64))
    starts = ends - np.asarray(case.arrays["group_sizes"], np.int64)
    return any(e > s and s // rows != (e - 1) // rows for s, e in zip(starts, ends))


def _paths(blocks: Blocks | None, domain: Domain) -> tuple[CodePath, ...]:
    """The code paths every small-tier run reaches (docs/shape_tiers.md, made a rule)."""
    k_tail = CodePath(
        "several K tiles and a ragged last one",
        lambda case, config: builders.ragged_tiles(case.arrays["lhs"].shape[1], builders.reduction_block(config)),
    )
    if blocks is not None:  # a user's kernel: what its declared tiling makes of the draws
        reachable = blocks.block_k and builders.tiles_reachable(domain.k, blocks.block_k)
        return (dataclasses.replace(k_tail, required=False),) if reachable else ()
    return (
        k_tail,
        CodePath(
            "a group straddling a row tile",
            lambda case, config: _straddles(case, builders.row_block(config)),
        ),
        CodePath("an empty group", lambda case, config: bool((np.asarray(case.arrays["group_sizes"]) == 0).any())),
        CodePath(
            "rows past the last group",
            lambda case, config: int(np.sum(case.arrays["group_sizes"])) < case.arrays["lhs"].shape[0],
        ),
    )


def group_layout(case: Case) -> str:
    """The form of a case's group sizes, as ``GROUP_LAYOUTS`` names them, the first
    that holds: every group one row, rows past the last group ("short"), one group
    holding every row, an empty group, else "random". Read from the sizes, not the
    layout drawn: a "random" draw may leave a group empty, which is the form the
    kernel sees."""
    sizes = np.asarray(case.arrays["group_sizes"], np.int64)
    if (sizes == 1).all():
        return "singletons"
    if sizes.sum() < case.arrays["lhs"].shape[0]:
        return "short"
    if len(sizes) > 1 and (sizes > 0).sum() == 1:
        return "one_group"
    return "with_empty" if (sizes == 0).any() else "random"


def _parameters(blocks: Blocks | None) -> tuple[Parameter, ...]:
    """The discrete parameters whose pairs every small-tier run meets (ours only: a
    user's kernel has one config, and its domain may narrow the rest)."""
    if blocks is not None:
        return ()
    return (
        Parameter("group layout", GROUP_LAYOUTS, lambda case, config: (group_layout(case),)),
        builders.config_parameter(builders.reduction_name, ("K block 16", "K block 32"), builders.GENERIC_INTERPRETED),
        builders.config_parameter(builders.reduction_name, ("K block 32", "K block 64"), ("mosaic_gpu_interpret",)),
        builders.input_kind(builders.DOT_KINDS),
    )


def make_spec(
    kernel: Callable[..., jax.Array] = ragged_dot.ragged_dot,
    name: str = "ragged_dot",
    differentiable: bool = True,
    *,
    domain: Domain = DOMAIN,
    blocks: Blocks | None = None,
    dtypes: Sequence[str] = DTYPES,
    backends: Sequence[str] = GENERIC + MOSAIC_GPU,
    bad_inputs: Callable[[], Sequence[BadInput]] | None = None,
) -> KernelSpec:
    """The ragged_dot spec for ``kernel`` (ragged_dot.ragged_dot's signature);
    ``differentiable=False`` drops the gradient checks (forward-only kernels);
    ``blocks``: the tiling of a kernel that is not ours (one "config"; the default
    checks ours over its config space)."""

    def configs(case: Case, backend: Backend) -> Sequence[Any]:
        lhs, rhs = case.arrays["lhs"], case.arrays["rhs"]
        return ragged_dot.configs(
            lhs.shape[0], rhs.shape[2], lhs.shape[1], backend, itemsize=lhs.dtype.itemsize, groups=rhs.shape[0]
        )

    gradients = GradientSpec(
        lambda case, config, backend: _vjp(functools.partial(kernel, config=config, backend=backend), case),
        _oracle_vjp,
        _gradient_bound,
        reference_vjp=lambda case: _vjp(ragged_dot.xla_reference, case),
        contract=any_order_gradient_contract(_gradient_bound),
    )
    return KernelSpec(
        name=name,
        dtypes=dtypes,
        cases=functools.partial(cases, domain=domain),
        production=production.production_cases("ragged_dot", LAYOUTS_PRODUCTION, cases, domain),
        production_layouts=LAYOUTS_PRODUCTION,
        results_on_device_bytes=_results_on_device_bytes,
        kernel=functools.partial(_run, kernel),
        reference=lambda case: ragged_dot.xla_reference(*_args(case)),
        oracle=_oracle,
        expected=lambda ref: ref.out,
        bound=_bound,
        contract=any_order_contract(_bound),
        backends=backends,
        paths=_paths(blocks, domain),
        parameters=_parameters(blocks),
        **config_fields(blocks, configs, ragged_dot.Config(), mosaic_gpu_ragged_dot.Config()),
        gradients=gradients if differentiable else None,
        bad_inputs=bad_inputs or _bad_inputs,
        reference_bytes=_reference_bytes,
    )


SPEC = make_spec()


# ------------------------------------------------------------------------ builder


def grouped_matmul_like(
    fn: Callable[..., jax.Array],
    *,
    name: str,
    m: Sequence[int] = M_DIMS,
    n: Sequence[int] = N_DIMS,
    k: Sequence[int] = K_DIMS,
    groups: Sequence[int] = GROUP_COUNTS,
    rows_outside_groups: str = "zero",
    blocks: Blocks = Blocks(),
    dtypes: Sequence[str] = DTYPES,
    differentiable: bool = True,
    backends: Sequence[str] = GENERIC,
    interpret: str | None = None,
) -> KernelSpec:
    """The spec of a user's grouped (ragged) matmul ``fn(lhs, rhs, group_sizes)``:
    rows ``[offset_g, offset_g + group_sizes[g])`` of ``lhs[m, k]`` times ``rhs[g]`` (``[k, n]``),
    rows in no group 0 (``jax.lax.ragged_dot``'s semantics), output in the inputs' dtype.

    - ``m``, ``n``, ``k``, ``groups``: the sizes it accepts;
    - ``rows_outside_groups``: "zero" (as above), or "unwritten": it promises nothing
      for rows past sum(group_sizes), and cases have groups covering every row;
    - ``blocks``: its block along K (and the backward's row block), for the bound;
    - ``backends`` / ``interpret``: see ``builders.call_on``.
    """

    def adapted(lhs, rhs, group_sizes, *, config=None, backend=None):
        del config  # the blocks are fixed
        return builders.call_on(fn, get_backend(backend), backends, interpret, lhs, rhs, group_sizes)

    def bad() -> list[BadInput]:
        chosen = builders.checking_backend(backends)
        lhs, rhs = jnp.ones((max(m), max(k)), dtypes[-1]), jnp.ones((2, max(k), max(n)), dtypes[-1])
        sizes = jnp.array([max(m) // 2, max(m) - max(m) // 2], jnp.int32)
        return [
            builders.must_refuse("group count differs from rhs", lambda: adapted(lhs, rhs, sizes[:1], backend=chosen))
        ]

    if rows_outside_groups not in ("zero", "unwritten"):
        raise ValueError(f"rows_outside_groups must be 'zero' or 'unwritten', got {rows_outside_groups!r}")
    layouts = GROUP_LAYOUTS if rows_outside_groups == "zero" else tuple(x for x in GROUP_LAYOUTS if x != "short")
    domain = Domain(tuple(m), tuple(n), tuple(k), tuple(groups), layouts, rows_outside_groups == "unwritten")
    spec = make_spec(
        adapted, name, differentiable, domain=domain, blocks=blocks, dtypes=dtypes, backends=backends, bad_inputs=bad
    )
    return builders.backward_on_backend(spec, interpret)
