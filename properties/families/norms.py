"""KernelSpecs for kernels/norms.py: layer_norm and rms_norm."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels import norms
from pallascheck.kernels.backends import GENERIC, Backend, get_backend
from pallascheck.oracles import norms as oracle
from pallascheck.oracles.tolerance import Arithmetic, arithmetic_for
from pallascheck.properties import builders, relations, strategies
from pallascheck.properties.spec import (
    BadInput,
    Case,
    GradientSpec,
    KernelSpec,
    config_fields,
)

LEADING_SHAPES = ((1,), (5,), (3, 11), (33,))  # flattened rows 1, 5, 33, 33
FEATURES = (1, 7, 64, 100, 256)  # D; 7 and 100 leave padding columns
EPS = (1e-6, 1e-5, 1e-2)


@dataclasses.dataclass(frozen=True)
class Domain:
    """The inputs a kernel accepts: the default is everything kernels/norms.py accepts."""

    leading: tuple[tuple[int, ...], ...] = LEADING_SHAPES
    features: tuple[int, ...] = FEATURES
    eps: tuple[float, ...] = EPS
    x_kinds: tuple[str, ...] = strategies.ELEMENT_KINDS  # a variant aimed at one part of the input space
    optional_params: bool = True  # False: scale (and offset) always given


DOMAIN = Domain()


def cases(kind: str, dtype: str, backend: Backend, domain: Domain = DOMAIN) -> st.SearchStrategy[Case]:
    @st.composite
    def draw(draw_) -> Case:
        shape = draw_(strategies.layout_choice(f"{kind}.leading", domain.leading)) + (
            draw_(strategies.layout_choice(f"{kind}.d", domain.features)),
        )
        d = shape[-1]
        given = st.booleans() if domain.optional_params else st.just(True)
        has_scale = draw_(strategies.layout(f"{kind}.scale", given))
        has_offset = kind == "layer_norm" and draw_(strategies.layout(f"{kind}.offset", given))
        eps = draw_(strategies.layout_choice(f"{kind}.eps", domain.eps))
        kind_of_x = draw_(strategies.element_kinds(domain.x_kinds))
        seed = draw_(strategies.seeds())
        arrays = {
            "x": strategies.elements(seed, shape, dtype, kind_of_x, reduction=d),
            "cotangent": strategies.elements(seed + 1, shape, dtype, "normal"),
        }
        if has_scale:
            arrays["scale"] = strategies.elements(seed + 2, (d,), dtype, "normal")
        if has_offset:
            arrays["offset"] = strategies.elements(seed + 3, (d,), dtype, "normal")
        return Case(arrays, {"eps": eps})

    return draw()


def _params(case: Case) -> tuple[list[str], list[jax.Array]]:
    names = [k for k in ("x", "scale", "offset") if k in case.arrays]
    return names, [jnp.asarray(case.arrays[k]) for k in names]


def _call(fn: Callable[..., jax.Array], kind: str, names: list[str], eps: float, **kw: Any):
    def run(*values):
        args = dict(zip(names, values))
        if kind == "layer_norm":
            return fn(args["x"], args.get("scale"), args.get("offset"), eps=eps, **kw)
        return fn(args["x"], args.get("scale"), eps=eps, **kw)

    return run


def _oracle(kind: str, case: Case) -> oracle.NormOracle:
    a = case.arrays
    return oracle.oracle(kind, a["x"], a.get("scale"), a.get("offset"), case.params["eps"])


def _bound(case: Case, ref: oracle.NormOracle, config: Any, arith: Arithmetic) -> np.ndarray:
    dtype = case.arrays["x"].dtype
    compute = np.float32 if config is not None else dtype  # xla_reference computes in x's dtype
    return oracle.bound(ref, out_dtype=dtype, arith=arith, compute_dtype=compute).reshape(case.arrays["x"].shape)


def _contract(case: Case, ref: oracle.NormOracle, arith: Arithmetic) -> np.ndarray:
    """The two-pass algorithm in f32 with sums in any order, one rounding to x's dtype:
    the kernel's own arithmetic (oracles/norms.py), and the canonical backward-stable
    one, whose error grows with |mean| / std (a backward error relative to |x|)."""
    return _bound(case, ref, Blocks(), arith)


def _gradient_contract(case: Case, ref, grads, arith: Arithmetic) -> dict[str, np.ndarray]:
    """The same for the gradients, the parameter sums over all rows in any order."""
    return _gradient_bound(case, ref, grads, Blocks(), arith)


def _shifted_rows(case: Case) -> Case:
    """x + c for a constant c per row (0, up to 100 or up to 1e4): layer norm ignores it."""
    x = case.arrays["x"]
    rng = np.random.default_rng(x.size)
    shift = rng.uniform(-1.0, 1.0, x.shape[:-1] + (1,)) * rng.choice([0.0, 100.0, 1e4])
    with np.errstate(over="ignore"):
        return Case({**case.arrays, "x": (x.astype(np.float64) + shift).astype(x.dtype)}, case.params)


def _kernel_vjp(fn, kind: str, case: Case, config: Any, backend: Backend) -> dict[str, jax.Array]:
    names, values = _params(case)
    _, pullback = jax.vjp(_call(fn, kind, names, case.params["eps"], config=config, backend=backend), *values)
    grads = pullback(jnp.asarray(case.arrays["cotangent"]))
    return {f"d{n}": g for n, g in zip(names, grads)}


def _oracle_vjp(case: Case, ref: oracle.NormOracle) -> dict[str, np.ndarray]:
    grads = oracle.oracle_vjp(ref, case.arrays["cotangent"], with_offset=True)
    grads["dx"] = grads["dx"].reshape(case.arrays["x"].shape)
    return grads


def _gradient_bound(case: Case, ref, grads, config: Any, arith: Arithmetic) -> dict[str, np.ndarray]:
    x = case.arrays["x"]
    bounds = oracle.gradient_bound(
        ref,
        case.arrays["cotangent"],
        x_dtype=x.dtype,
        param_dtype=x.dtype,
        block_rows=config.block_rows or int(np.prod(x.shape[:-1])),
        arith=arith,
        with_offset=True,
    )
    bounds["dx"] = bounds["dx"].reshape(x.shape)
    return bounds


def _bad_inputs(kind: str, fn: Callable[..., jax.Array]) -> Callable[[], list[BadInput]]:
    def bad() -> list[BadInput]:
        x = jnp.ones((4, 8), jnp.float32)
        return [
            BadInput("rank-0 x", lambda: fn(jnp.float32(1.0)), ValueError, r"x must have rank >= 1"),
            BadInput("empty x", lambda: fn(jnp.ones((0, 8))), ValueError, r"x must not have a zero-sized"),
            BadInput("integer x", lambda: fn(jnp.ones((4, 8), jnp.int32)), TypeError, r"x must have dtype in"),
            BadInput(
                "scale shape",
                lambda: fn(x, jnp.ones((7,))),
                ValueError,
                r"scale must have shape \(D,\) with D = x.shape\[-1\] = 8",
            ),
            BadInput("negative eps", lambda: fn(x, eps=-1.0), ValueError, r"eps must be a positive"),
            BadInput("config type", lambda: fn(x, config=(8,)), TypeError, r"config must be a norms.Config"),
            BadInput(
                "block_rows",
                lambda: norms.Config(block_rows=3),
                ValueError,
                r"config.block_rows must be a power of two",
            ),
        ]

    return bad


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The tiling of a norm kernel that is not ours: rows per block of the backward's
    scale/offset sums (None, unknown: all rows, any order)."""

    block_rows: int | None = None


def make_spec(
    kind: str,
    kernel: Callable[..., jax.Array] | None = None,
    name: str | None = None,
    differentiable: bool = True,
    *,
    domain: Domain = DOMAIN,
    blocks: Blocks | None = None,
    dtypes: Sequence[str] = strategies.DTYPES,
    backends: Sequence[str] = GENERIC,
    bad_inputs: Callable[[], Sequence[BadInput]] | None = None,
) -> KernelSpec:
    """The spec of ``kind`` ("layer_norm" or "rms_norm") for ``kernel`` (default: the
    shipped one; any callable with the same signature). ``blocks``: the tiling of a
    kernel that is not ours (one "config"; the default checks ours over its space)."""
    kernel = kernel or getattr(norms, kind)
    reference = getattr(norms, f"xla_reference_{kind}")
    oracle_of = functools.partial(_oracle, kind)

    def run(case: Case, config: Any, backend: Backend) -> jax.Array:
        names, values = _params(case)
        return _call(kernel, kind, names, case.params["eps"], config=config, backend=backend)(*values)

    def run_reference(case: Case) -> jax.Array:
        names, values = _params(case)
        return _call(reference, kind, names, case.params["eps"])(*values)

    def row_bound(case: Case, config: Any, backend: Backend) -> np.ndarray:
        return _bound(case, oracle_of(case), config, arithmetic_for(backend))

    def configs(case: Case, backend: Backend) -> Sequence[Any]:
        return norms.configs(int(np.prod(case.arrays["x"].shape[:-1])), case.arrays["x"].shape[-1], backend)

    return KernelSpec(
        name=name or kind,
        dtypes=dtypes,
        cases=functools.partial(cases, kind, domain=domain),
        kernel=run,
        reference=run_reference,
        oracle=oracle_of,
        expected=lambda ref: ref.out,
        bound=_bound,
        contract=_contract,
        **config_fields(blocks, configs, norms.Config()),
        gradients=GradientSpec(
            functools.partial(_kernel_vjp, kernel, kind), _oracle_vjp, _gradient_bound, contract=_gradient_contract
        )
        if differentiable
        else None,
        relations=(relations.row_permutation(("x", "cotangent"), run, row_bound),)
        + (
            (relations.invariance_within_contract("shift_invariance", run, _shifted_rows, oracle_of, _contract),)
            if kind == "layer_norm"
            else ()
        ),
        bad_inputs=bad_inputs or _bad_inputs(kind, kernel),
        backends=backends,
    )


LAYER_NORM = make_spec("layer_norm")
RMS_NORM = make_spec("rms_norm")


# ------------------------------------------------------------------------ builder


def norm_like(
    fn: Callable[..., jax.Array],
    *,
    name: str,
    kind: str = "layer_norm",
    optional_params: bool = False,
    leading: Sequence[tuple[int, ...]] = LEADING_SHAPES,
    features: Sequence[int] = FEATURES,
    eps: Sequence[float] = EPS,
    blocks: Blocks = Blocks(),
    dtypes: Sequence[str] = strategies.DTYPES,
    differentiable: bool = True,
    backends: Sequence[str] = GENERIC,
    interpret: str | None = None,
) -> KernelSpec:
    """The spec of a user's normalisation over the last axis, ``kind`` "layer_norm"
    (``fn(x, scale, offset, *, eps)``: (x - mean) * rsqrt(var + eps) * scale + offset)
    or "rms_norm" (``fn(x, scale, *, eps)``: x * rsqrt(mean(x^2) + eps) * scale).

    - ``optional_params``: it accepts None for scale/offset (else it gets ones/zeros);
    - ``leading``, ``features``, ``eps``: the shapes ([*leading, features]) and eps it accepts;
    - ``blocks``: rows per block of its backward's parameter sums, for the bound;
    - ``backends`` / ``interpret``: see ``builders.call_on``.
    """
    if kind not in ("layer_norm", "rms_norm"):
        raise ValueError(f"kind must be 'layer_norm' or 'rms_norm', got {kind!r}")

    def adapted(x, scale=None, offset=None, *, eps, config=None, backend=None):
        del config  # the blocks are fixed
        d = x.shape[-1]
        if not optional_params:
            scale = jnp.ones((d,), x.dtype) if scale is None else scale
            offset = jnp.zeros((d,), x.dtype) if offset is None else offset
        params = (scale,) if kind == "rms_norm" else (scale, offset)
        return builders.call_on(fn, get_backend(backend), backends, interpret, x, *params, eps=eps)

    if kind == "rms_norm":
        adapted_rms = lambda x, scale=None, *, eps, config=None, backend=None: adapted(  # noqa: E731
            x, scale, eps=eps, config=config, backend=backend
        )

    def bad() -> list[BadInput]:
        chosen = builders.checking_backend(backends)
        x = jnp.ones((4, 8), dtypes[-1])
        return [
            builders.must_refuse("scale of the wrong length", lambda: adapted(x, x[0, :7], backend=chosen, eps=1e-5))
        ]

    domain = Domain(tuple(leading), tuple(features), tuple(eps), optional_params=optional_params)
    spec = make_spec(
        kind,
        adapted if kind == "layer_norm" else adapted_rms,
        name,
        differentiable,
        domain=domain,
        blocks=blocks,
        dtypes=dtypes,
        backends=backends,
        bad_inputs=bad,
    )
    return builders.backward_on_backend(spec, interpret)
