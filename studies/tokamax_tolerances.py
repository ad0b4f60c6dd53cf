"""Tokamax's own test tolerances: the fifth rule of ``python -m studies.tolerance_rules`` (``tokamax``), read from the tests Tokamax 0.0.17 ships in its
wheel (``tokamax/_src/ops/<op>/test_base.py``, ``*_test.py``).

Semantics are numpy's allclose: |actual - expected| <= atol + rtol |reference|, where
``reference`` is the expected value for chex (``chex.assert_trees_all_close(actual,
expected)`` calls ``np.testing.assert_allclose(actual, desired)``; its defaults are
rtol 1e-6, atol 0: chex/_src/asserts.py ``_assert_trees_all_close_static``) and the
tested value where Tokamax writes ``jnp.allclose(ref, test)`` (``relative_to``).

Tokamax compares with an f32 reference; the rule applies the tolerance against our
float64 oracle instead. For bf16 and f16 inputs the f32 reference's own error is far
below these tolerances. Two qualifications:
- the normalization tests round their reference to the input dtype
  (``y.astype(x.dtype)``, normalization/test_base.py:160), so there the oracle is
  rounded to the compared array's dtype first (``rounded_reference``), else a
  correctly rounded bf16 output would fail by its own half-ulp where Tokamax's
  reference, rounded the same way, agrees with it;
- the f32 tolerances (attention atol 1e-6, ragged_dot chex's rtol 1e-6 and atol 0,
  norms 5e-7 sqrt(D)) are of the size of f32 rounding itself: Tokamax's tests meet
  them because the f32 reference rounds much as the kernel does. Against the exact
  result a correct f32 kernel can fail them: an f32 failure of this rule says the
  tolerance is below f32's arithmetic on that input, not that the kernel is wrong.

Tokamax runs each op's tests at fixed shapes and inputs; where its tests use several
tolerances for one op and dtype, the rule takes the op's main test (below, each value
with its file:line) and, for attention, the bias tests' values when the case has a
bias. Where Tokamax's tests have no tolerance for an (op, dtype, array),
``tolerance`` gives None: the rule does not apply there.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from pallascheck.properties.spec import Case

CHEX_RTOL = 1e-6  # chex.assert_trees_all_close's default rtol (atol 0): chex/_src/asserts.py:1663-1664


@dataclasses.dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float = CHEX_RTOL
    relative_to: str = "expected"  # "actual": jnp.allclose(ref, test) scales rtol by |test|
    rounded_reference: bool = False  # Tokamax's reference is rounded to the compared array's dtype

    def judged(self, actual: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the reference to compare ``actual`` with, the allowed |actual - reference|)."""
        expected = np.asarray(expected, np.float64)
        if self.rounded_reference:
            with np.errstate(over="ignore", invalid="ignore"):
                expected = expected.astype(actual.dtype).astype(np.float64)
        scale = np.asarray(actual, np.float64) if self.relative_to == "actual" else expected
        with np.errstate(invalid="ignore"):
            return expected, self.atol + self.rtol * np.abs(scale)


# ---------------------------------------------------------------- which op a spec is

# A spec's name, before any "[variant]" (the broken variants name themselves
# "<spec>[<variant>]", tests/broken) -> the Tokamax op whose tests give the rule.
# None: Tokamax has no test tolerance for that op; the rule does not apply.
OPS: dict[str, str | None] = {
    "layer_norm": "normalization",
    "rms_norm": "normalization",
    "attention": "attention",
    "mosaic_gpu_attention": "attention",
    "gated_linear_unit": "gated_linear_unit",
    "glu": "gated_linear_unit",
    "ragged_dot": "ragged_dot",
    "mosaic_gpu_ragged_dot": "ragged_dot",
    "linear_softmax_cross_entropy": "linear_softmax_cross_entropy_loss",
    "matmul": None,
    "mosaic_gpu_matmul": None,
    "cross_entropy": None,
    "top_k": None,
}
# tests/broken/loss_variants.py names its specs "lce_<variant>" (linear cross-entropy)
# and "ce_<variant>" (cross-entropy); checked in this order
PREFIXES = (("lce_", "linear_softmax_cross_entropy"), ("ce_", "cross_entropy"))
# Tokamax's own specs, "tokamax:<op>:<implementation>" (properties/outside/tokamax.py), by <op>
TOKAMAX_OPS: dict[str, str] = {
    "layer_norm": "normalization",
    "rms_norm": "normalization",
    "dot_product_attention": "attention",
    "gated_linear_unit": "gated_linear_unit",
    "ragged_dot": "ragged_dot",
    "linear_softmax_cross_entropy_loss": "linear_softmax_cross_entropy_loss",
}
# the input array whose dtype picks the tolerance (Tokamax's tables are by input dtype)
INPUT = {
    "normalization": "x",
    "attention": "q",
    "gated_linear_unit": "x",
    "ragged_dot": "lhs",
    "linear_softmax_cross_entropy_loss": "x",
}


def op_of(spec_name: str) -> str | None:
    """The Tokamax op whose test tolerances judge ``spec_name``; None where Tokamax has
    none (or the name is in no table: a spec registered elsewhere)."""
    if spec_name.startswith("tokamax:"):
        return TOKAMAX_OPS.get(spec_name.split(":")[1])
    base = spec_name.split("[")[0]
    for prefix, family in PREFIXES:
        if base.startswith(prefix):
            base = family
            break
    return OPS.get(base)


# ---------------------------------------------------------------- the tolerances

# normalization/test_base.py:169 atols by x's dtype; no float16 entry (a KeyError there)
NORM_ATOL = {"float32": 5e-7, "bfloat16": 2e-3}
# normalization/test_base.py:170 y, dx: * sqrt(D); :186 dscale * 10 sqrt(rows); :188 doffset * 25 sqrt(rows)
NORM_FACTOR: dict[str, Callable[[int, int], float]] = {
    "out": lambda d, rows: math.sqrt(d),
    "dx": lambda d, rows: math.sqrt(d),
    "dscale": lambda d, rows: 10 * math.sqrt(rows),
    "doffset": lambda d, rows: 25 * math.sqrt(rows),
}
# attention/test_base.py:300 (test_self_attention, no bias) forward atol by dtype
ATTENTION_ATOL = {"float32": 1e-6, "bfloat16": 1e-2, "float16": 5e-4}
# with a bias (forward, every gradient): test_bench :903-904, passed at :917-918 (f32
# test_bias :395 has the same 5e-6 forward); f16 has no bias test: the :300 value
ATTENTION_BIAS = {"float32": (5e-6, 2e-5), "bfloat16": (2e-2, 8e-2)}
# gated_linear_unit/test_base.py:72-73 bf16 inputs only; :96 values; :105 gradients
GLU = {"out": Tolerance(0.1, 0.02), "grad": Tolerance(2.0, 0.2)}
# ragged_dot/test_base.py:256 bf16 output; :156 f32 (test_simple, chex defaults); :293 bf16 gradients (test_vjp)
RAGGED_DOT = {
    ("bfloat16", "out"): Tolerance(0.01, 0.005),
    ("float32", "out"): Tolerance(0.0),
    ("bfloat16", "grad"): Tolerance(0.02, 0.005),
}
# linear_softmax_cross_entropy_loss, atol = rtol:
# f32 sum/mean: api_test.py:81 loss 1e-4, :82-83 dx, dw 3e-2, as jnp.allclose(ref, test)
# f16 sum/mean: chunked_xla_test.py:99 loss 1e-3, :181 dx, dw 3e-3 (CPU; 0.3 for f16 "sum" on a GPU, :89-97)
# "none" (f32, f16): chunked_xla_test.py:97, :179 0.3 (api_test.py has no "none"); bf16: no test
LINEAR_CE = {
    ("float32", "out"): Tolerance(1e-4, 1e-4, "actual"),
    ("float32", "grad"): Tolerance(3e-2, 3e-2, "actual"),
    ("float16", "out"): Tolerance(1e-3, 1e-3),
    ("float16", "grad"): Tolerance(3e-3, 3e-3),
}
LINEAR_CE_NONE = Tolerance(0.3, 0.3)

# (op -> dtypes with a tolerance for some compared array), read off the tables above
DTYPES = {
    "normalization": tuple(NORM_ATOL),
    "attention": tuple(ATTENTION_ATOL),
    "gated_linear_unit": ("bfloat16",),
    "ragged_dot": tuple(dict.fromkeys(dtype for dtype, _ in RAGGED_DOT)),
    "linear_softmax_cross_entropy_loss": tuple(dict.fromkeys(dtype for dtype, _ in LINEAR_CE)),
}


def applies(op: str | None, dtype: str) -> bool:
    """Whether Tokamax's tests hold a tolerance for ``op`` at input ``dtype``."""
    return op is not None and dtype in DTYPES[op]


def tolerance(op: str | None, array: str, case: Case) -> Tolerance | None:
    """Tokamax's tolerance for ``array`` ("out" or a gradient's name) of ``op`` on
    ``case``; None where its tests have none."""
    if op is None:
        return None
    dtype = np.dtype(case.arrays[INPUT[op]].dtype).name
    if not applies(op, dtype):
        return None
    kind = "out" if array == "out" else "grad"
    if op == "normalization":
        x = case.arrays["x"]
        d = x.shape[-1]
        return Tolerance(NORM_ATOL[dtype] * NORM_FACTOR[array](d, x.size // max(d, 1)), rounded_reference=True)
    if op == "attention":
        atol, atol_grads = ATTENTION_BIAS.get(dtype, (None, None)) if "bias" in case.arrays else (None, None)
        atol = atol or ATTENTION_ATOL[dtype]
        if kind == "grad":
            atol = atol_grads or max(2 * atol, 5e-6)  # attention/test_base.py:173
        return Tolerance(atol, max(atol / 10, 1e-6))  # :146 (forward), :181 (gradients)
    if op == "gated_linear_unit":
        return GLU[kind]
    if op == "ragged_dot":
        return RAGGED_DOT.get((dtype, kind))  # f32 gradients: Tokamax's test_vjp is bf16 only
    if case.params.get("reduction") == "none":
        return LINEAR_CE_NONE
    return LINEAR_CE.get((dtype, kind))


# ---------------------------------------------------------------- Tokamax's inputs


def tokamax_inputs(op: str | None, case: Case) -> Case:
    """``case`` with its floating inputs redrawn as Tokamax's tests draw them, shapes,
    parameters, masks, labels, group sizes and the cotangent kept: N(0, 1) (attention
    q, k, v and bias: ``numerics.random_initialize``, tokamax/_src/numerics.py:198; GLU
    x, w: gated_linear_unit/test_base.py:72-73; linear CE x, w: its test_utils.py:47-49), normalization x ~ N(0, 1) with scale and
    offset ~ U(0, 1) (normalization/test_base.py:133-137), ragged_dot lhs, rhs ~
    N(0, 0.1^2) (ragged_dot/test_base.py:116-131). Seeded from the case's bytes."""
    names = {
        "normalization": ("x", "scale", "offset"),
        "attention": ("q", "k", "v", "bias"),
        "gated_linear_unit": ("x", "weights"),
        "ragged_dot": ("lhs", "rhs"),
        "linear_softmax_cross_entropy_loss": ("x", "w"),
    }.get(op or "", ())
    arrays: dict[str, Any] = dict(case.arrays)
    rng = np.random.default_rng(zlib.crc32(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values())))
    for name in names:
        if name not in arrays:
            continue
        shape, dtype = arrays[name].shape, arrays[name].dtype
        if op == "normalization" and name != "x":
            values = rng.uniform(0.0, 1.0, shape)
        else:
            values = rng.standard_normal(shape) * (0.1 if op == "ragged_dot" else 1.0)
        arrays[name] = values.astype(dtype)
    return Case(arrays, case.params)
