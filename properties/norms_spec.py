"""KernelSpecs for kernels/norms.py: layer_norm and rms_norm."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels import norms
from pallascheck.kernels.backends import Backend
from pallascheck.oracles import norms as oracle
from pallascheck.oracles.tolerance import Arithmetic, arithmetic_for

from . import relations, strategies
from .spec import BadInput, Case, GradientSpec, KernelSpec

LEADING_SHAPES = ((1,), (5,), (3, 11), (33,))  # flattened rows 1, 5, 33, 33
FEATURES = (1, 7, 64, 100, 256)  # D; 7 and 100 leave padding columns
EPS = (1e-6, 1e-5, 1e-2)


def cases(kind: str, dtype: str, backend: Backend,
          x_kinds: tuple[str, ...] = strategies.ELEMENT_KINDS) -> st.SearchStrategy[Case]:
    """Drawn cases; ``x_kinds`` narrows the element kinds of x (a variant aimed at
    one part of the input space)."""
    @st.composite
    def draw(draw_) -> Case:
        shape = (draw_(strategies.layout(f"{kind}.leading", st.sampled_from(LEADING_SHAPES)))
                 + (draw_(strategies.layout(f"{kind}.d", strategies.dims(FEATURES))),))
        d = shape[-1]
        has_scale = draw_(strategies.layout(f"{kind}.scale", st.booleans()))
        has_offset = kind == "layer_norm" and draw_(strategies.layout(f"{kind}.offset", st.booleans()))
        eps = draw_(strategies.layout(f"{kind}.eps", st.sampled_from(EPS)))
        kind_of_x = draw_(strategies.element_kinds(x_kinds))
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
    dtype = case.arrays["x"].dtype
    return oracle.bound(ref, out_dtype=dtype, arith=arith, compute_dtype=np.float32).reshape(case.arrays["x"].shape)


def _gradient_contract(case: Case, ref, grads, arith: Arithmetic) -> dict[str, np.ndarray]:
    """The same for the gradients, the parameter sums over all rows in any order."""
    x = case.arrays["x"]
    bounds = oracle.gradient_bound(
        ref, case.arrays["cotangent"], x_dtype=x.dtype, param_dtype=x.dtype,
        block_rows=int(np.prod(x.shape[:-1])), arith=arith, with_offset=True,
    )
    bounds["dx"] = bounds["dx"].reshape(x.shape)
    return bounds


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
        ref, case.arrays["cotangent"], x_dtype=x.dtype, param_dtype=x.dtype,
        block_rows=config.block_rows, arith=arith, with_offset=True,
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
            BadInput("scale shape", lambda: fn(x, jnp.ones((7,))), ValueError, r"scale must have shape \(D,\) with D = x.shape\[-1\] = 8"),
            BadInput("negative eps", lambda: fn(x, eps=-1.0), ValueError, r"eps must be a positive"),
            BadInput("config type", lambda: fn(x, config=(8,)), TypeError, r"config must be a norms.Config"),
            BadInput("block_rows", lambda: norms.Config(block_rows=3), ValueError, r"config.block_rows must be a power of two"),
        ]

    return bad


def make_spec(
    kind: str, kernel: Callable[..., jax.Array] | None = None, name: str | None = None,
    differentiable: bool = True,
) -> KernelSpec:
    """The spec of ``kind`` ("layer_norm" or "rms_norm") for ``kernel`` (default: the
    shipped one; any callable with the same signature)."""
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
        return _bound(case, oracle_of(case), config, arithmetic_for(backend.name))

    return KernelSpec(
        name=name or kind,
        dtypes=strategies.DTYPES,
        cases=functools.partial(cases, kind),
        kernel=run,
        reference=run_reference,
        oracle=oracle_of,
        expected=lambda ref: ref.out,
        bound=_bound,
        contract=_contract,
        configs=lambda case, backend: norms.configs(
            int(np.prod(case.arrays["x"].shape[:-1])), case.arrays["x"].shape[-1], backend
        ),
        default_config=norms.Config(),
        gradients=GradientSpec(functools.partial(_kernel_vjp, kernel, kind), _oracle_vjp, _gradient_bound,
                               contract=_gradient_contract)
        if differentiable else None,
        relations=(relations.row_permutation(("x", "cotangent"), run, row_bound),)
        + ((relations.invariance_within_contract("shift_invariance", run, _shifted_rows, oracle_of, _contract),)
           if kind == "layer_norm" else ()),
        bad_inputs=_bad_inputs(kind, kernel),
    )


LAYER_NORM = make_spec("layer_norm")
RMS_NORM = make_spec("rms_norm")
