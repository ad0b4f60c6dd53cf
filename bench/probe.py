"""``pallascheck probe``: measure a backend's dot arithmetic with crafted inputs.

Every error bound here rests on assumptions about how a dot of bf16/f16 inputs with
an f32 result is computed: products exact, sums rounded to an f32 accumulator (24
significand bits) to nearest, or with a directed rounding that the model pays for
with a doubled unit roundoff (``Arithmetic.mma_unit_factor``), order unknown inside a
block. Studies of NVIDIA tensor cores (Fasi, Higham, Mikaitis, Pranesh 2021; FPRev)
found the matmul units do not add in IEEE round-to-nearest in a fixed order, so the
probe measures instead of assuming, the way those studies do: bf16 inputs whose
exact results are known, one [64, 32] @ [32, 64] call per property, the result read
in f32.

- products: (1 + i/128)(1 + 127/128) for i = 1..127 needs 16 significand bits; is it
  exact, or rounded?
- accumulator bits: 1 + 2^-k for k = 1..30: the largest k kept, plus one;
- rounding: +-(1 + 3 * 2^-25) (3/4 of an f32 ulp past 1) and 1 + 2^-24 (a tie):
  nearest-even, nearest-away, toward zero, down or up;
- order of the K sum (a small FPRev): row j holds M = 2^26 at position 0, -M at
  position j and ones elsewhere; the count of ones that survive depends only on
  which ones were added while M was in the sum, and is matched against sequential,
  reverse, pairwise and blocked orders simulated in numpy (f32), and against fused
  groups (g products added in one step, each truncated to the 24-bit grid of the
  group's largest, the groups then added in sequence: the tensor-core model);
- subnormals: a bf16 subnormal input (2^-130), and a product whose exact value is an
  f32 subnormal (2^-70 * 2^-70 = 2^-140): kept or flushed to zero.

Paths: ``xla`` (``jnp.dot`` with an f32 result on the backend's platform), ``pallas``
(``jnp.dot`` inside a one-block Pallas kernel: the generic interpreter, the TPU
interpreter or Triton's ``tl.dot``) and ``wgmma`` (the Mosaic GPU matmul kernel, one
32-wide K tile: one wgmma, on Hopper or in its interpreter).

``assumption_violations`` compares what was measured with the tolerance model of the
backend (oracles/tolerance.py); the command fails when the model does not hold.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.experimental import pallas as pl

from pallascheck.bench import probe_fp8
from pallascheck.kernels import mosaic_gpu_matmul
from pallascheck.kernels.backends import Backend
from pallascheck.oracles.tolerance import Arithmetic, arithmetic_for
from pallascheck.properties.device import identity

ROWS, K, COLS = 64, 32, 64
BF16 = ml_dtypes.bfloat16
ORDER_BIG = 2.0**26  # adding 1 to it rounds back to it (1/8 of its ulp)
DotFn = Callable[[jax.Array, jax.Array], np.ndarray]


def _xla_dot(backend: Backend) -> DotFn:
    device = jax.devices(backend.platform)[0]
    fn = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return lambda x, y: np.asarray(fn(jax.device_put(x, device), jax.device_put(y, device)))


def _pallas_dot(backend: Backend) -> DotFn:
    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0, 0))  # noqa: E731
    call = jax.jit(
        backend.pallas_call(
            kernel,
            grid=(1,),
            in_specs=[whole((ROWS, K)), whole((K, COLS))],
            out_specs=whole((ROWS, COLS)),
            out_shape=jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
            num_warps=4,
            num_stages=1,
            dimension_semantics=("arbitrary",),
            name="pallascheck_probe_dot",
        )
    )
    return lambda x, y: np.asarray(call(x, y))


def _wgmma_dot(backend: Backend) -> DotFn:
    config = mosaic_gpu_matmul.Config(tile_m=ROWS, tile_n=COLS, tile_k=K, max_concurrent_steps=2)
    call = jax.jit(
        functools.partial(
            mosaic_gpu_matmul.tiled_call,
            out_dtype=jnp.float32,
            activation="none",
            save_preactivation=False,
            config=config,
            backend=backend,
        )
    )
    return lambda x, y: np.asarray(call(x, y))


def paths(backend: Backend) -> dict[str, DotFn]:
    """The dot paths of ``backend``: XLA's, and the Pallas kernels' own."""
    kernel_path = ("wgmma", _wgmma_dot) if backend.is_mosaic_gpu else ("pallas", _pallas_dot)
    return {"xla": _xla_dot(backend), kernel_path[0]: kernel_path[1](backend)}


def _run(dot: DotFn, rows: np.ndarray, y_col: Sequence[float] | np.ndarray) -> np.ndarray:
    """rows [R <= 64, <= K] and y_col [<= K] (exact in bf16) -> the f32 dot of each row."""
    x = np.zeros((ROWS, K), BF16)
    x[: rows.shape[0], : rows.shape[1]] = rows.astype(BF16)
    y = np.zeros((K, COLS), BF16)
    y[: len(y_col), :] = np.asarray(y_col).astype(BF16)[:, None]
    assert np.array_equal(x[: rows.shape[0], : rows.shape[1]].astype(np.float64), rows), "probe input not exact in bf16"
    return dot(jnp.asarray(x), jnp.asarray(y))[: rows.shape[0], 0].astype(np.float64)


def products(dot: DotFn) -> dict[str, Any]:
    a = 1.0 + np.arange(1, 128) / 128.0
    b = 1.0 + 127 / 128.0
    got = _run(dot, a[:, None][:ROWS], [b])
    exact = a[:ROWS] * b
    return {
        "exact": bool(np.array_equal(got, exact)),
        "worst_relative_error": float(np.max(np.abs(got - exact) / exact)),
    }


def accumulator_bits(dot: DotFn) -> dict[str, Any]:
    """The largest k with 1 + 2^-k kept, plus one; and up to which k every one was."""
    ks = np.arange(1, 31)
    small = 2.0 ** -ks.astype(float)
    kept = _run(dot, np.stack([np.ones_like(small), small], axis=1), [1.0, 1.0]) == 1.0 + small
    return {
        "bits": int(ks[kept].max()) + 1 if kept.any() else 0,
        "kept_all_up_to": int(np.argmin(kept)) if not kept.all() else len(ks),
    }


def rounding(dot: DotFn) -> dict[str, Any]:
    ulp = 2.0**-23
    rows = np.array([[1.0, 3 * 2.0**-25], [-1.0, -3 * 2.0**-25], [1.0, 2.0**-24]])
    above, below, tie = _run(dot, rows, [1.0, 1.0])
    # (+0.75 ulp, -0.75 ulp, +0.5 ulp tie) under each mode, past 1 in units of ulp
    modes = {
        "nearest-even": (1, -1, 0),
        "nearest-away": (1, -1, 1),
        "toward-zero": (0, 0, 0),
        "down": (0, -1, 0),
        "up": (1, 0, 1),
    }
    seen = (round((above - 1.0) / ulp), round((below + 1.0) / ulp), round((tie - 1.0) / ulp))
    mode = next((name for name, pattern in modes.items() if pattern == seen), "other")
    return {"mode": mode, "ulps_past_1": list(seen)}


def round_f32(value: Any, mode: str) -> Any:
    """``value`` (exact in float64; a number or an array) rounded to f32 by ``mode`` (a
    directed mode, or nearest: ties to even)."""
    exact = np.asarray(value, np.float64)
    nearest = exact.astype(np.float32)
    if mode.startswith("nearest"):
        rounded = nearest
    else:
        near = nearest.astype(np.float64)
        overshot = {"toward-zero": np.abs(near) > np.abs(exact), "down": near > exact, "up": near < exact}[mode]
        target = {"toward-zero": 0.0, "down": -np.inf, "up": np.inf}[mode]
        rounded = np.where(overshot, np.nextafter(nearest, np.float32(target)), nearest)
    return float(rounded) if np.ndim(value) == 0 else rounded.astype(np.float64)


def _add(a: float, b: float, mode: str) -> float:
    return round_f32(a + b, mode)  # a + b of two f32 values is exact in float64


def _simulate(order: str, terms: np.ndarray, mode: str = "nearest-even") -> float:
    """f32 sum of ``terms`` in the named order, each addition rounded by ``mode``."""
    if order == "sequential":
        total = 0.0
        for t in terms:
            total = _add(total, float(t), mode)
        return total
    if order == "reverse":
        return _simulate("sequential", terms[::-1], mode)
    if order == "pairwise":
        level = [float(t) for t in terms]
        while len(level) > 1:
            level = [
                _add(level[i], level[i + 1], mode) if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)
            ]
        return level[0]
    kind, size = order.split("-")
    groups = [terms[i : i + int(size)] for i in range(0, len(terms), int(size))]
    if kind == "fused":  # each group summed at once, aligned to its largest term
        return _simulate("sequential", np.array([fused_group_sum(g) for g in groups]), mode)
    # "blocked-b": sequential within blocks of b, then across
    return _simulate("sequential", np.array([_simulate("sequential", g, mode) for g in groups]), mode)


def fused_group_sum(terms: Any, bits: int = 24, axis: int = -1) -> Any:
    """Groups of products added in one step each, as the tensor-core studies describe
    it: every term truncated to the ``bits``-bit grid of its group's largest exponent
    (the group runs along ``axis``), then summed exactly."""
    terms = np.asarray(terms, np.float64)
    largest = np.max(np.abs(terms), axis=axis, keepdims=True)
    with np.errstate(divide="ignore"):
        grid = np.where(largest > 0, 2.0 ** (np.floor(np.log2(np.where(largest > 0, largest, 1.0))) - (bits - 1)), 1.0)
    total = np.sum(np.trunc(terms / grid) * grid, axis=axis)
    return float(total) if total.ndim == 0 else total


ORDERS = (
    ("sequential", "reverse", "pairwise")
    + tuple(f"blocked-{b}" for b in (2, 4, 8, 16))
    + tuple(f"fused-{g}" for g in (4, 8, 16, 32))
)


def sequential_permutation(surviving: list[int]) -> list[int] | None:
    """The order in which a one-accumulator sum took the K terms, if some order
    explains ``surviving`` (the ones left when M sits at position 0 and -M at j): a one
    survives iff it is added after both M and -M, so with ranks r (0-based),
    surviving_j = K - 1 - max(r_0, r_j). None when no order does (a tree, or lanes)."""
    for rank0 in range(K):
        ranks = {0: rank0}
        for j, count in enumerate(surviving, start=1):
            r = K - 1 - count
            if r > rank0:
                ranks[j] = r
            elif count != K - 1 - rank0:
                break
        else:
            missing = sorted(set(range(K)) - set(ranks.values()))
            unplaced = [j for j in range(K) if j not in ranks]
            if (
                len(set(ranks.values())) == len(ranks)
                and len(missing) == len(unplaced)
                and all(r < rank0 for r in missing)
            ):
                # terms taken before position 0 are not resolved by this pattern: keep their index order
                ranks.update(zip(unplaced, missing))
                return [j for j, _ in sorted(ranks.items(), key=lambda item: item[1])]
    return None


def order(dot: DotFn, mode: str = "nearest-even") -> dict[str, Any]:
    """The K-sum order, simulated with the additions rounded by ``mode`` (measured
    by ``rounding``: under truncation -M + c does not round back to -M)."""
    rows = np.ones((K - 1, K))
    rows[:, 0] = ORDER_BIG
    rows[np.arange(K - 1), np.arange(1, K)] = -ORDER_BIG
    got = _run(dot, rows, np.ones(K)).astype(int).tolist()
    matches = [name for name in ORDERS if all(_simulate(name, r, mode) == g for r, g in zip(rows, got))]
    if not matches and all(g == K - 2 for g in got):
        matches = ["wider than f32"]  # every one survived: the sum holds more than f32
    elif not matches:
        permutation = sequential_permutation(got)
        matches = [f"sequential in the order {permutation[:8]}..." if permutation else "a tree (not one accumulator)"]
    return {"matches": matches, "surviving_ones": got}


def subnormals(dot: DotFn) -> dict[str, Any]:
    tiny_input, tiny_product = 2.0**-130, 2.0**-140
    got_input = _run(dot, np.array([[tiny_input]]), [1.0])[0]
    got_product = _run(dot, np.array([[2.0**-70]]), [2.0**-70])[0]
    return {
        "subnormal_input": "kept" if got_input == tiny_input else ("flushed" if got_input == 0 else "other"),
        "subnormal_product": "kept" if got_product == tiny_product else ("flushed" if got_product == 0 else "other"),
    }


def probe_path(dot: DotFn) -> dict[str, Any]:
    """Every property of one dot path."""
    measured = {"products": products(dot), "accumulator": accumulator_bits(dot), "rounding": rounding(dot)}
    measured["order"] = order(dot, measured["rounding"]["mode"])
    measured["subnormals"] = subnormals(dot)
    return measured


def assumption_violations(measured: dict[str, Any], arith: Arithmetic) -> list[str]:
    """What the tolerance model for this backend assumes and the measurement contradicts."""
    out = []
    if not measured["products"]["exact"]:
        out.append("bf16 products are not exact in the f32 result (the bounds assume they are)")
    if measured["accumulator"]["bits"] < 24:
        out.append(f"the accumulator keeps {measured['accumulator']['bits']} significand bits, fewer than f32's 24")
    mode = measured["rounding"]["mode"]
    if mode == "other" or (not mode.startswith("nearest") and arith.mma_unit_factor < 2.0):
        out.append(
            f"additions round {mode}; the model charges {arith.mma_unit_factor:g}u per addition, and a "
            f"directed rounding needs 2u"
        )
    flushes = "flushed" in measured["subnormals"].values()
    if flushes and not arith.flush_subnormals:
        out.append("subnormals are flushed but the model has no underflow floor")
    return out


@dataclasses.dataclass(frozen=True)
class Report:
    backend: str
    device: str
    jax_version: str
    paths: dict[str, dict[str, Any]]
    violations: dict[str, list[str]]

    def as_dict(self, fp8: dict[str, Any] | None = None) -> dict[str, Any]:
        """The report as JSON data (what ``pallascheck probe --json`` writes, and what a
        fuzz campaign keeps per device kind: ``oracles.device_arithmetic.from_probe``
        reads it), with the FP8 probe's (``probe_fp8.run``) under ``fp8``."""
        data = dataclasses.asdict(self)
        if fp8 is not None:
            data["fp8"] = fp8
        return data


def run(backend: Backend) -> Report:
    backend.require_available()
    arith = arithmetic_for(backend)
    measured = {name: probe_path(dot) for name, dot in paths(backend).items()}
    kind = identity.device_kind(backend)
    return Report(
        str(backend),
        kind,
        jax.__version__,
        measured,
        {name: assumption_violations(m, arith) for name, m in measured.items()},
    )


def device_report(backend: Backend) -> dict[str, Any]:
    """The probe of the device ``backend`` runs on here, as ``Report.as_dict``: the bf16
    dot paths, and the FP8 ones where the backend has an FP8 matrix path (Mosaic GPU's
    wgmma; elsewhere the FP8 dots are XLA's upcast ones, which no bound rests on)."""
    return run(backend).as_dict(probe_fp8.run(backend) if backend.is_mosaic_gpu else None)


def print_table(report: Report) -> None:
    print(f"dot arithmetic on {report.backend} ({report.device}, jax {report.jax_version}), bf16 inputs, f32 result")
    names = list(report.paths)
    lines = [
        (
            "products",
            lambda m: (
                "exact" if m["products"]["exact"] else f"rounded (rel. {m['products']['worst_relative_error']:.1e})"
            ),
        ),
        ("accumulator bits", lambda m: str(m["accumulator"]["bits"])),
        ("rounding", lambda m: m["rounding"]["mode"]),
        ("K-sum order (K=32)", lambda m: ", ".join(m["order"]["matches"])),
        ("subnormal input", lambda m: m["subnormals"]["subnormal_input"]),
        ("subnormal product", lambda m: m["subnormals"]["subnormal_product"]),
    ]
    rows = [[label] + [fmt(report.paths[n]) for n in names] for label, fmt in lines]
    rows.append(["tolerance model"] + ["VIOLATED" if report.violations[n] else "holds" for n in names])
    widths = [max(len(str(r[i])) for r in rows + [["property"] + names]) for i in range(len(names) + 1)]
    for row in [["property"] + names] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    for name, problems in report.violations.items():
        for problem in problems:
            print(f"  {name}: {problem}")
