"""Tests of the rounding-error model (oracles/tolerance.py, oracles/algebra.py).

Every bound is checked against an *independent* computation of the error it
claims to bound: arithmetic simulated exactly with ``fractions.Fraction`` and a
reference rounding function written here from the definition of a binary format
(precision p, minimum exponent emin), never against the model itself. Where a
construction is known to reach a bound, the test also asserts that a slightly
smaller bound (one step of depth less, or u instead of 2u) would be exceeded, so
that a model that was too loose in the wrong place would be caught too.

Run as the package installs (see pyproject.toml), e.g. with a shim on PYTHONPATH
mapping ``pallascheck.<sub>`` to the top-level folders.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallascheck.kernels.backends import Backend
from pallascheck.oracles import algebra, tolerance
from pallascheck.oracles.algebra import Bounded
from pallascheck.oracles.tolerance import CPU, GPU, TF32, TPU, Accumulation

SETTINGS = settings(
    max_examples=50,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
GRADUAL = dataclasses.replace(CPU, flush_subnormals=False)

# ---------------------------------------------------------------------------
# Reference arithmetic: formats from their definition, exact rounding on Fractions
# ---------------------------------------------------------------------------

# name: (precision p including the hidden bit, emin = exponent of the smallest normal)
FORMATS = {
    "float64": (53, -1022),
    "float32": (24, -126),
    TF32: (11, -126),
    "float16": (11, -14),
    "bfloat16": (8, -126),
    "float8_e4m3fn": (4, -6),
    "float8_e5m2": (3, -14),
}
DTYPES = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}
TWO = Fraction(2)


def _floor_log2(a: Fraction) -> int:
    """floor(log2 a) for a > 0, exactly."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if a < TWO**e:
        e -= 1
    assert TWO**e <= a < TWO ** (e + 1)
    return e


def rnd(x: Fraction, fmt: str, *, mode: str = "nearest", flush: bool = False) -> Fraction:
    """x rounded to ``fmt`` (unbounded exponent above, gradual underflow below).

    mode "nearest": round to nearest, ties to even; "chop": toward zero.
    flush: a result whose exact value is below the smallest normal becomes 0
    (flush-to-zero of results, tininess detected before rounding).
    """
    if x == 0:
        return Fraction(0)
    p, emin = FORMATS[fmt]
    a = abs(x)
    if flush and a < TWO**emin:
        return Fraction(0)
    quantum = TWO ** (max(_floor_log2(a), emin) - p + 1)
    m = a / quantum
    if mode == "nearest":
        n = round(m)  # Fraction.__round__: half to even
    elif mode == "chop":
        n = m.numerator // m.denominator
    else:  # pragma: no cover
        raise ValueError(mode)
    return (n * quantum) if x > 0 else -(n * quantum)


def representable(x: Fraction, fmt: str) -> bool:
    return rnd(x, fmt) == x


# Summation orders as explicit trees over a `combine` function, so that the same
# code computes values (combine = rounded addition) and depths (combine = max + 1).
def sum_sequential(xs: Sequence, combine: Callable) -> object:
    acc = xs[0]
    for x in xs[1:]:
        acc = combine(acc, x)
    return acc


def sum_pairwise(xs: Sequence, combine: Callable) -> object:
    if len(xs) == 1:
        return xs[0]
    half = (len(xs) + 1) // 2
    return combine(sum_pairwise(xs[:half], combine), sum_pairwise(xs[half:], combine))


def sum_blocked(xs: Sequence, combine: Callable, block: int) -> object:
    partials = [sum_sequential(xs[i : i + block], combine) for i in range(0, len(xs), block)]
    return sum_sequential(partials, combine)


def summer(order: Accumulation) -> Callable[[Sequence, Callable], object]:
    if order.order == "sequential":
        return sum_sequential
    if order.order == "pairwise":
        return sum_pairwise
    return lambda xs, combine: sum_blocked(xs, combine, order.block)


def tree_depth(order: Accumulation, n: int) -> int:
    """Longest chain of dependent additions of the tree ``summer`` builds."""
    return summer(order)([0] * n, lambda a, b: max(a, b) + 1)


def simulate_sum(
    terms: Sequence[Fraction], order: Accumulation, fmt: str, *, mode: str = "nearest", flush: bool = False
) -> Fraction:
    return summer(order)(list(terms), lambda a, b: rnd(a + b, fmt, mode=mode, flush=flush))


def frac_abs_sum(xs: Sequence[Fraction]) -> Fraction:
    return sum((abs(x) for x in xs), Fraction(0))


def assert_within(error: Fraction, bound: float, what: str) -> float:
    """|error| <= bound, compared exactly; returns error / bound (0 where the model
    claims no bound: inf, e.g. where a result may overflow)."""
    assert bound >= 0 and not math.isnan(bound), f"{what}: bound {bound}"
    if math.isinf(bound):
        return 0.0
    assert abs(error) <= Fraction(bound), f"{what}: error {float(abs(error))!r} > bound {bound!r}"
    return float(abs(error)) / bound if bound else 0.0


F32_TINY = TWO**-126


def daz(x: Fraction, tiny: Fraction = F32_TINY) -> Fraction:
    """An operand as denormals-are-zero hardware reads it."""
    return Fraction(0) if abs(x) < tiny else x


def flushed_part(a: Sequence[Fraction], b: Sequence[Fraction]) -> float:
    """sum |a_i b_i| over products with an f32-subnormal factor (what DAZ may drop)."""
    sub = lambda v: v != 0 and abs(v) < F32_TINY  # noqa: E731
    return float(sum((abs(x * y) for x, y in zip(a, b) if sub(x) or sub(y)), Fraction(0)))


def value_in(fmt: str, exp_lo: int, exp_hi: int) -> st.SearchStrategy[Fraction]:
    """Values of ``fmt``: integer significand < 2^p times the quantum of exponent e.
    Every such value with emin <= e is representable (possibly with fewer bits)."""
    p, emin = FORMATS[fmt]
    assert exp_lo >= emin

    def make(sign: int, m: int, e: int) -> Fraction:
        v = sign * m * TWO ** (e - p + 1)
        assert representable(v, fmt)
        return v

    return st.builds(make, st.sampled_from([-1, 1]), st.integers(0, 2**p - 1), st.integers(exp_lo, exp_hi))


def terms_of(fmt: str, max_len: int = 40) -> st.SearchStrategy[list[Fraction]]:
    """Lists of fmt values, either around 1 (no underflow) or near the bottom of
    the exponent range (partial sums and products underflow)."""
    _, emin = FORMATS[fmt]
    scales = st.sampled_from([(-6, 6), (emin, emin + 3)])
    return scales.flatmap(lambda r: st.lists(value_in(fmt, *r), min_size=1, max_size=max_len))


orders = st.one_of(
    st.just(tolerance.SEQUENTIAL),
    st.just(tolerance.PAIRWISE),
    st.integers(1, 12).map(tolerance.blocked),
)


def test_reference_rounding_agrees_with_ieee_casts():
    """The reference ``rnd`` agrees with numpy's IEEE float64 -> float32 and
    float64 -> float16 conversions (both correctly rounded), including ties,
    subnormals and values that round up into the next binade."""
    rng = np.random.default_rng(0)
    for fmt, dtype, lo, hi in (("float32", np.float32, -152, 127), ("float16", np.float16, -26, 15)):
        p, _ = FORMATS[fmt]
        x = np.ldexp(rng.uniform(1, 2, 4000), rng.integers(lo, hi, 4000)) * rng.choice([-1, 1], 4000)
        # exact ties: p+1 significant bits with the last one set
        ties = np.ldexp(rng.integers(2 ** (p - 1), 2**p, 500) * 2 + 1, rng.integers(lo - p, hi - p - 1, 500))
        for v in np.concatenate([x, ties, [2.0**lo, 1 - 2.0**-60, 1 + 2.0**-p]]):
            ref = rnd(Fraction(float(v)), fmt)
            got = Fraction(float(np.asarray(v).astype(dtype)))
            assert ref == got, (fmt, float(v), float(ref), float(got))
    # the chopping mode truncates
    assert rnd(Fraction(1) + TWO**-23 - TWO**-40, "float32", mode="chop") == 1
    assert rnd(-(Fraction(1) + TWO**-23 - TWO**-40), "float32", mode="chop") == -1


# ---------------------------------------------------------------------------
# 1. unit roundoff and smallest normal per format
# ---------------------------------------------------------------------------

NUMPY_FORMATS = ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("name", NUMPY_FORMATS)
def test_unit_roundoff_is_half_of_machine_epsilon(name):
    dtype = DTYPES[name]
    info = ml_dtypes.finfo(dtype)
    p, _ = FORMATS[name]
    assert tolerance.unit_roundoff(dtype) == float(info.eps) / 2 == 2.0**-p
    assert tolerance.unit_roundoff(name) == 2.0**-p  # names are accepted too
    assert -info.nmant - 1 == -p


@pytest.mark.parametrize("name", [n for n in NUMPY_FORMATS if n != "float64"])
def test_unit_roundoff_is_the_rounding_threshold_of_casts(name):
    """Semantically: 1 + u is a tie (rounds to 1, the even neighbour), anything
    above it rounds up to 1 + 2u. (Offsets chosen exact in float32, since
    ml_dtypes casts float64 to bf16/fp8 through float32.)"""
    dtype, u = DTYPES[name], tolerance.unit_roundoff(DTYPES[name])
    p, _ = FORMATS[name]
    cast = lambda v: float(np.asarray([v], np.float64).astype(dtype)[0])  # noqa: E731
    assert cast(1 + u) == 1.0
    assert cast(1 + u + u * 2.0**-p) == 1 + 2 * u
    assert cast(1 + u - u * 2.0**-p) == 1.0


def test_unit_roundoff_tf32():
    assert tolerance.unit_roundoff(TF32) == 2.0**-11 == tolerance.unit_roundoff("tf32")
    assert tolerance.dtype_name(TF32) == "tf32"


@pytest.mark.parametrize("name", NUMPY_FORMATS + [TF32])
def test_smallest_normal(name):
    _, emin = FORMATS[name]
    assert tolerance.smallest_normal(name) == 2.0**emin
    if name != TF32:
        assert tolerance.smallest_normal(DTYPES[name]) == float(ml_dtypes.finfo(DTYPES[name]).smallest_normal)


@pytest.mark.parametrize("bad", [np.int32, np.int8, np.complex64, np.bool_, "int64", "uint8"])
def test_unsupported_dtype_raises(bad):
    with pytest.raises(ValueError, match="dtype must be one of"):
        tolerance.unit_roundoff(bad)


# ---------------------------------------------------------------------------
# 2. Accumulation.depth
# ---------------------------------------------------------------------------

DEPTH_TABLE = [  # (order, n, expected longest chain)
    *[(tolerance.SEQUENTIAL, n, n - 1) for n in (1, 2, 3, 8, 1000)],
    *[
        (tolerance.PAIRWISE, n, d)
        for n, d in ((1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (1024, 10), (1025, 11))
    ],
    # blocked (n, b): n = 1, n < b, n = b, n = b + 1, several blocks, ragged last block, b = 1
    *[
        (tolerance.blocked(b), n, d)
        for n, b, d in (
            (1, 4, 0),
            (3, 4, 2),
            (4, 4, 3),
            (5, 4, 4),
            (8, 4, 4),
            (9, 4, 5),
            (16, 4, 6),
            (1, 1, 0),
            (5, 1, 4),
            (128, 32, 34),
            (129, 32, 35),
            (100, 32, 34),
        )
    ],
]


@pytest.mark.parametrize("order,n,expected", DEPTH_TABLE, ids=lambda v: str(v))
def test_depth_table(order, n, expected):
    assert int(order.depth(n)) == expected
    assert tree_depth(order, n) == expected  # the tree the simulations below build


@SETTINGS
@given(order=orders, n=st.integers(1, 300))
def test_depth_is_longest_chain_of_the_summation_tree(order, n):
    assert int(order.depth(n)) == tree_depth(order, n)
    assert int(order.depth(n)) <= n - 1  # sequential bounds every order


def test_depth_vectorised():
    ns = np.array([1, 2, 7, 33, 64])
    np.testing.assert_array_equal(tolerance.SEQUENTIAL.depth(ns), ns - 1)
    np.testing.assert_array_equal(tolerance.PAIRWISE.depth(ns), [0, 1, 3, 6, 6])
    np.testing.assert_array_equal(tolerance.blocked(8).depth(ns), [0, 1, 6, 7 + 4, 7 + 7])


@pytest.mark.parametrize("args", [("random",), ("tree",), ("blocked", 0), ("blocked", -3)])
def test_invalid_accumulation_raises(args):
    with pytest.raises(ValueError):
        Accumulation(*args)
    if args[0] == "blocked":
        with pytest.raises(ValueError):
            tolerance.blocked(args[1])


# ---------------------------------------------------------------------------
# 3. gamma
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("u", [2.0**-53, 2.0**-24, 2.0**-11, 2.0**-8])
def test_gamma_formula(u):
    for k in (0, 1, 2, 10, 100, int(0.5 / u)):
        exact = Fraction(k) * Fraction(u) / (1 - Fraction(k) * Fraction(u))
        g = float(tolerance.gamma(k, u))
        assert abs(Fraction(g) - exact) <= exact * Fraction(2.0**-51), (k, u)
    k_max = int(1 / u)  # k u = 1: no bound
    assert np.isinf(tolerance.gamma(k_max, u)) and np.isinf(tolerance.gamma(k_max + 5, u))
    assert np.isfinite(tolerance.gamma(k_max - 1, u))
    np.testing.assert_array_equal(np.isinf(tolerance.gamma(np.array([0, k_max - 1, k_max]), u)), [0, 0, 1])


def test_probabilistic_gamma_formula():
    for k in (1, 16, 4095):
        assert tolerance.probabilistic_gamma(k, 2.0**-24) == pytest.approx(5.0 * math.sqrt(k) * 2.0**-24, rel=1e-15)
        assert tolerance.probabilistic_gamma(k, 2.0**-24, lam=2.0) == pytest.approx(2 * math.sqrt(k) * 2.0**-24)


def test_arithmetic_profiles_match_their_hardware_descriptions():
    u32 = 2.0**-24
    assert CPU.mma_unit() == u32 and GPU.mma_unit() == 2 * u32 and TPU.mma_unit() == u32
    assert CPU.operand_unit(np.float32) == u32
    assert GPU.operand_unit(np.float32) == 2.0**-11
    assert TPU.operand_unit(np.float32) == 2.0**-8
    for arith in (CPU, GPU, TPU):
        assert arith.operand_unit(ml_dtypes.bfloat16) == 0.0 == arith.operand_unit(np.float16)
        assert arith.transcendental_rel(np.float32) == 6 * u32  # 3 ulp
    assert CPU.dot_order(32) == tolerance.blocked(32)
    assert GPU.dot_order(32) == tolerance.SEQUENTIAL == TPU.dot_order(32)
    assert (
        tolerance.arithmetic_for(Backend("interpret")) is CPU
        and tolerance.arithmetic_for(Backend("triton")) is GPU
        and tolerance.arithmetic_for(Backend("mosaic_gpu")) is GPU
    )


# ---------------------------------------------------------------------------
# 4. reduce_sum and dot against exact simulation of rounded arithmetic
# ---------------------------------------------------------------------------

SUM_FORMATS = ["bfloat16", "float16", "float32"]


@pytest.mark.parametrize("flush", [True, False], ids=["ftz", "gradual"])
@pytest.mark.parametrize("fmt", SUM_FORMATS)
@SETTINGS
@given(data=st.data())
def test_reduce_sum_bounds_exact_simulation(fmt, flush, data):
    """With flushing, the hardware also reads subnormal inputs as 0 (DAZ): the
    terms enter as algebra.operand (err |x| where subnormal); inputs exactly
    representable, read as they are, enter as Bounded.exact."""
    terms = data.draw(terms_of(fmt))
    order = data.draw(orders)
    arith = CPU if flush else GRADUAL
    tiny = TWO ** FORMATS[fmt][1]
    exact = sum(terms, Fraction(0))
    values = np.array([float(t) for t in terms])
    kw = dict(arith=arith, order=order, dtype=DTYPES[fmt])
    computed = simulate_sum(terms, order, fmt, flush=flush)
    bound = algebra.reduce_sum(Bounded.exact(values), 0, **kw)
    assert_within(computed - exact, float(bound.err), f"{fmt} {order} n={len(terms)}")
    if flush:
        read = [daz(t, tiny) for t in terms]
        computed = simulate_sum(read, order, fmt, flush=True)
        bound = algebra.reduce_sum(algebra.operand(values, arith=arith, dtype=DTYPES[fmt]), 0, **kw)
        assert_within(computed - exact, float(bound.err), f"DAZ {fmt} {order} n={len(terms)}")


@pytest.mark.parametrize("fmt", SUM_FORMATS)
@SETTINGS
@given(data=st.data())
def test_sum_any_tree_bounded_by_its_depth(fmt, data):
    """Any binary tree (random merges of neighbours): the error is within
    gamma(longest chain) * sum|x|, the claim the three orders are instances of."""
    terms = data.draw(terms_of(fmt))
    items = [(t, 0) for t in terms]  # (computed value, depth)
    while len(items) > 1:
        i = data.draw(st.integers(0, len(items) - 2))
        (a, da), (b, db) = items[i], items[i + 1]
        items[i : i + 2] = [(rnd(a + b, fmt, flush=True), max(da, db) + 1)]
    computed, depth = items[0]
    assert depth <= len(terms) - 1
    err = computed - sum(terms, Fraction(0))
    u = tolerance.unit_roundoff(DTYPES[fmt])
    # every one of the n - 1 additions may flush a result below the smallest normal
    bound = float(tolerance.gamma(depth, u)) * float(frac_abs_sum(terms)) + (len(terms) - 1) * (
        tolerance.smallest_normal(DTYPES[fmt])
    )
    assert_within(err, bound, f"tree of depth {depth}")


def _products_and_bound_inputs(a: Sequence[Fraction], b: Sequence[Fraction]):
    prods = [x * y for x, y in zip(a, b)]
    return prods, float(sum(prods, Fraction(0))), float(frac_abs_sum(prods))


@pytest.mark.parametrize("flush", [True, False], ids=["ftz", "gradual"])
@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
@SETTINGS
@given(data=st.data())
def test_dot_low_precision_operands_f32_accumulation(fmt, flush, data):
    """bf16/f16 operands: products exact in f32 (unless they underflow), sums
    rounded to f32 in the given order."""
    a = data.draw(terms_of(fmt, 32))
    b = data.draw(st.lists(value_in(fmt, FORMATS[fmt][1], 4), min_size=len(a), max_size=len(a)))
    order = data.draw(orders)
    arith = CPU if flush else GRADUAL
    prods, value, magnitude = _products_and_bound_inputs(a, b)
    for x, y in zip(a, b):  # 2p <= 24 bits: exact in f32 unless below its normal range
        assert representable(x * y, "float32") or abs(x * y) < TWO**-126
    if flush:  # DAZ: operands below the f32 normal range (bf16 subnormals) read as 0
        rounded = [rnd(daz(x) * daz(y), "float32", flush=True) for x, y in zip(a, b)]
    else:
        rounded = [rnd(p, "float32") for p in prods]
    computed = simulate_sum(rounded, order, "float32", flush=flush)
    bound = algebra.dot(
        value,
        magnitude,
        len(a),
        arith=arith,
        operand_dtype=DTYPES[fmt],
        order=order,
        flushed_magnitude=flushed_part(a, b),
    )
    assert_within(computed - sum(prods, Fraction(0)), float(bound.err), f"{fmt} dot {order}")


f32_subnormal = st.builds(lambda s, m: s * m * TWO**-149, st.sampled_from([-1, 1]), st.integers(1, 2**23 - 1))


@SETTINGS
@given(
    a=st.lists(value_in("float32", -126, 8) | f32_subnormal, min_size=1, max_size=24),
    data=st.data(),
    fma=st.booleans(),
)
def test_dot_f32_operands_cpu(a, data, fma):
    """f32 operands on the CPU: each product rounds to f32 (or is fused into the
    addition, FMA); the model's 2u operand term must absorb that rounding."""
    # b up to 2^60: a product of a subnormal a_i, lost to DAZ, can be far above the
    # per-operation underflow floor
    b = data.draw(st.lists(value_in("float32", -126, 60), min_size=len(a), max_size=len(a)))
    order = data.draw(orders)
    prods, value, magnitude = _products_and_bound_inputs(a, b)
    read = [daz(x) * daz(y) for x, y in zip(a, b)]  # DAZ on the operands
    r = lambda v: rnd(v, "float32", flush=True)  # noqa: E731
    if fma and order.order == "sequential":
        acc = r(read[0])
        for p in read[1:]:
            acc = r(acc + p)  # one rounding of acc + a*b
        computed = acc
    else:
        computed = simulate_sum([r(p) for p in read], order, "float32", flush=True)
    bound = algebra.dot(
        value, magnitude, len(a), arith=CPU, operand_dtype=np.float32, order=order, flushed_magnitude=flushed_part(a, b)
    )
    assert_within(computed - sum(prods, Fraction(0)), float(bound.err), f"f32 dot {order} fma={fma}")


# ---------------------------------------------------------------------------
# 5. constructed worst cases: the bound is reached, and one step less is not enough
# ---------------------------------------------------------------------------


def _round_up_step(fmt: str) -> Fraction:
    """x = u (1 + 2^(1-p)): representable, and s + x rounds up to s + 2u for every
    s in [1, 2) on the grid of spacing 2u, with an error of u (1 - 2^(1-p))."""
    p, _ = FORMATS[fmt]
    x = TWO**-p * (1 + TWO ** (1 - p))
    assert representable(x, fmt)
    return x


def _worst_case_terms(order: Accumulation, n: int, fmt: str, scale: Fraction) -> list[Fraction]:
    """One term 1 and, placed so that every addition on the path of the 1 adds one
    x to it (siblings summed exactly: x and zeros), the rest zeros."""
    return [t * scale for t in _worst_case_unscaled(order, n, fmt)]


def _worst_case_unscaled(order: Accumulation, n: int, fmt: str) -> list[Fraction]:
    x = _round_up_step(fmt)
    if order.order == "sequential":
        return [Fraction(1)] + [x] * (n - 1)
    if order.order == "pairwise":  # n = 2^L; the sibling at level l starts at 2^l
        terms = [Fraction(0)] * n
        terms[0] = Fraction(1)
        level = 1
        while level < n:
            terms[level] = x
            level *= 2
        return terms
    b = order.block  # first block: 1, x, ..., x; every other block: x then zeros
    terms = [Fraction(1)] + [x] * (b - 1)
    for start in range(b, n, b):
        terms += [x] + [Fraction(0)] * (min(b, n - start) - 1)
    return terms


WORST_CASES = [
    # (fmt, order, n, one-less-fails): depth-1 must fail only where the second-order
    # terms of gamma do not hide the linear gap: small k u. f16 terms are scaled by 2^14
    # (exact) so that the flush floor, (n - 1) * 2^-14, stays small next to the sum.
    ("bfloat16", tolerance.SEQUENTIAL, 9, True),
    ("bfloat16", tolerance.SEQUENTIAL, 128, False),
    ("bfloat16", tolerance.PAIRWISE, 1024, True),
    ("bfloat16", tolerance.blocked(8), 64, False),
    ("float16", tolerance.SEQUENTIAL, 16, True),
    ("float16", tolerance.SEQUENTIAL, 64, False),
    ("float16", tolerance.PAIRWISE, 2**12, True),
    ("float16", tolerance.blocked(16), 256, True),
    ("float32", tolerance.SEQUENTIAL, 1000, True),
    ("float32", tolerance.PAIRWISE, 2**14, True),
    ("float32", tolerance.blocked(32), 32 * 40, True),
]


@pytest.mark.parametrize("fmt,order,n,one_less_fails", WORST_CASES, ids=lambda v: str(v))
def test_worst_case_summation(fmt, order, n, one_less_fails):
    scale = TWO**14 if fmt == "float16" else Fraction(1)
    terms = _worst_case_terms(order, n, fmt, scale)
    assert len(terms) == n
    exact = sum(terms, Fraction(0))
    computed = simulate_sum(terms, order, fmt)
    depth = int(order.depth(n))
    p, _ = FORMATS[fmt]
    u = tolerance.unit_roundoff(DTYPES[fmt])
    # the construction: every one of the `depth` additions on the path errs by u(1 - 2^(1-p))
    assert computed - exact == depth * (2 * TWO**-p - _round_up_step(fmt)) * scale
    bound = float(
        algebra.reduce_sum(
            Bounded.exact(np.array([float(t) for t in terms])), 0, arith=CPU, order=order, dtype=DTYPES[fmt]
        ).err
    )
    ratio = assert_within(computed - exact, bound, f"{fmt} {order} n={n}")
    # the bound is not loose: against its gamma part alone, error / (gamma_k sum|x|) =
    # (1 - 2^(1-p)) (1 - k u) / (1 + k u (1 + 2^(1-p))) (gamma_k = k u / (1 - k u),
    # sum|x| = 1 + k x); the rest of the bound is the flush floor (n - 1) * tiny
    floor = (n - 1) * tolerance.smallest_normal(DTYPES[fmt])
    expected = (1 - 2.0 ** (1 - p)) * (1 - depth * u) / (1 + depth * u * (1 + 2.0 ** (1 - p)))
    assert ratio >= expected * (1 - floor / bound) * (1 - 2.0**-40), (ratio, expected, floor / bound)
    one_less = float(tolerance.gamma(depth - 1, u)) * float(frac_abs_sum(terms)) + (n - 1) * tolerance.smallest_normal(
        DTYPES[fmt]
    )
    assert (abs(computed - exact) > Fraction(one_less)) == one_less_fails, (ratio, one_less)


def test_worst_case_sequential_f32_on_real_hardware():
    """The same construction through numpy's float32 additions (IEEE, sequential
    in np.add.accumulate) gives exactly the simulated result."""
    n = 1000
    x = _round_up_step("float32")
    terms = np.array([1.0] + [float(x)] * (n - 1), np.float32)
    hw = Fraction(float(np.add.accumulate(terms, dtype=np.float32)[-1]))
    sim = simulate_sum([Fraction(1)] + [x] * (n - 1), tolerance.SEQUENTIAL, "float32")
    assert hw == sim


def test_worst_case_dot_cpu():
    """bf16 operands [1, x, ..., x] . [1, ..., 1] accumulated in f32 on the CPU: each
    addition rounds up by ~u32, the dot bound is nearly reached."""
    n = 200
    x = TWO**-24 * (1 + TWO**-7)  # bf16 (8 bits); 1 + x rounds to 1 + 2^-23 in f32
    assert representable(x, "bfloat16")
    prods = [Fraction(1)] + [x] * (n - 1)
    computed = simulate_sum(prods, tolerance.SEQUENTIAL, "float32", flush=True)
    bound = algebra.dot(
        float(sum(prods)), float(sum(prods)), n, arith=CPU, operand_dtype=ml_dtypes.bfloat16, order=tolerance.SEQUENTIAL
    )
    ratio = assert_within(computed - sum(prods), float(bound.err), "dot worst case")
    assert ratio > 0.98, ratio


# ---------------------------------------------------------------------------
# 6. round_to
# ---------------------------------------------------------------------------

ROUND_FORMATS = ["bfloat16", "float16", "float32"]


def _values_across_range(fmt: str, count: int, seed: int) -> np.ndarray:
    """float64 values from far below the smallest subnormal of fmt up to its max,
    log-uniform, plus the edges: subnormal ties, just above/below half the smallest
    subnormal, values in (max, max + half ulp) which still round to max."""
    p, emin = FORMATS[fmt]
    big = tolerance.largest_finite(DTYPES[fmt])
    sub = 2.0 ** (emin - p + 1)  # smallest subnormal
    rng = np.random.default_rng(seed)
    mags = np.exp2(rng.uniform(math.log2(sub) - 3, math.log2(big), count))
    edges = [
        sub / 2,
        sub / 2 * (1 + 2.0**-20),
        sub / 2 * (1 - 2.0**-20),
        sub * 1.5,
        sub * 2.5,
        2.0**emin,
        2.0**emin * (1 - 2.0**-30),
        2.0**emin - sub / 2,
        big,
        big * (1 + 2.0 ** (-p - 1) * 0.99),
        1 + 2.0**-p,
        1 + 2.0**-p * (1 + 2.0**-20),
        3 * 2.0**-p,
    ]
    vals = np.concatenate([mags, edges, (np.arange(1, 64) + 0.5) * sub])
    vals = vals[vals <= big * (1 + 2.0 ** (-p - 1) * 0.99)]
    return np.concatenate([vals, -vals])


@pytest.mark.parametrize("fmt", ROUND_FORMATS)
def test_round_to_bounds_casts(fmt):
    """|cast(x) - x| <= round_to(exact(x)).err, for the ml_dtypes/numpy cast and for
    the exactly rounded value, with flush-to-zero (CPU) and gradual underflow."""
    x = _values_across_range(fmt, 3000, seed=1)
    dtype = DTYPES[fmt]
    cast = x.astype(dtype).astype(np.float64)
    assert np.all(np.isfinite(cast))
    ftz = algebra.round_to(Bounded.exact(x), dtype, CPU).err
    gradual = algebra.round_to(Bounded.exact(x), dtype, GRADUAL).err
    # above the largest finite value the rounding may overflow: the model claims no
    # bound there (inf), and everywhere else a finite one
    big = tolerance.largest_finite(dtype)
    np.testing.assert_array_equal(np.isinf(gradual), np.abs(x) > big)
    np.testing.assert_array_equal(np.isinf(ftz), np.abs(x) > big)
    x, cast, ftz, gradual = (v[np.abs(x) <= big] for v in (x, cast, ftz, gradual))
    err = np.abs(cast - x)  # exact: both are float64 with nearby exponents, or tiny
    for i in range(len(x)):  # exact comparison in rationals
        e = abs(Fraction(float(cast[i])) - Fraction(float(x[i])))
        assert e <= Fraction(float(gradual[i])), (fmt, x[i], cast[i], float(e), gradual[i])
        ref = rnd(Fraction(float(x[i])), fmt)
        assert abs(ref - Fraction(float(x[i]))) <= Fraction(float(gradual[i]))
        flushed = rnd(Fraction(float(x[i])), fmt, flush=True)
        assert abs(flushed - Fraction(float(x[i]))) <= Fraction(float(ftz[i]))
    assert np.all(err <= gradual)
    # the floor is needed: just above half the smallest subnormal rounds up to it,
    # an error far above u|x|, and exactly at the floor for a tie broken to even
    p, emin = FORMATS[fmt]
    sub, u, tiny = 2.0 ** (emin - p + 1), tolerance.unit_roundoff(dtype), 2.0**emin
    v = sub / 2 * (1 + 2.0**-8)  # exact in f32: ml_dtypes casts f64 -> bf16 through f32
    assert float(np.asarray([v]).astype(dtype)[0]) == sub == rnd(Fraction(v), fmt)
    assert sub - v > u * v and sub - v <= algebra.round_to(Bounded.exact(v), dtype, GRADUAL).err
    assert u * tiny == sub / 2  # the gradual floor is half the subnormal spacing
    # and the flush floor: a correct flush of a value just below the smallest normal
    w = tiny * (1 - 2.0**-30)
    assert abs(float(rnd(Fraction(w), fmt, flush=True)) - w) <= algebra.round_to(Bounded.exact(w), dtype, CPU).err
    assert w > algebra.round_to(Bounded.exact(w), dtype, GRADUAL).err  # the gradual floor would not cover it


@pytest.mark.parametrize("fmt", ROUND_FORMATS)
@SETTINGS
@given(data=st.data())
def test_round_to_of_a_computed_value(fmt, data):
    """A computed value already off by err: any v in [x - err, x + err], rounded,
    stays within round_to's err (the magnitude used is |x| + err)."""
    x = data.draw(st.floats(-1e4, 1e4, allow_nan=False, width=64))
    err = abs(x) * data.draw(st.floats(0, 0.1)) + data.draw(st.sampled_from([0.0, 1e-30, 1e-3]))
    frac = data.draw(st.sampled_from([-1.0, 1.0]) | st.floats(-1, 1))
    v = Fraction(x) + Fraction(err) * Fraction(frac)
    for arith, flush in ((CPU, True), (GRADUAL, False)):
        bound = algebra.round_to(Bounded(np.float64(x), np.float64(err)), DTYPES[fmt], arith).err
        assert_within(rnd(v, fmt, flush=flush) - Fraction(x), float(bound), f"{fmt} round_to")


# ---------------------------------------------------------------------------
# 7. dot with operand rounding (GPU tf32, TPU bf16) and chopped accumulation
# ---------------------------------------------------------------------------


def round_tf32(x: np.ndarray) -> np.ndarray:
    """float32 -> tf32 (10 fraction bits), round to nearest even, on the bits."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    lsb = (bits >> 13) & 1
    bits = (bits + 0xFFF + lsb) & ~np.uint64(0x1FFF)
    return bits.astype(np.uint32).view(np.float32)


def test_round_tf32_emulation_is_correct_rounding():
    rng = np.random.default_rng(2)
    x = np.ldexp(rng.uniform(1, 2, 20000), rng.integers(-126, 120, 20000)).astype(np.float32)
    ties = (np.ldexp(rng.integers(2**10, 2**11, 2000) * 2 + 1, rng.integers(-100, 100, 2000) - 12)).astype(np.float32)
    x = np.concatenate([x, -x, ties, [1 + 2.0**-11, 1 + 3 * 2.0**-11, 2 - 2.0**-23]]).astype(np.float32)
    got = round_tf32(x)
    for xi, gi in zip(x, got):
        assert Fraction(float(gi)) == rnd(Fraction(float(xi)), TF32), (xi, gi)


@SETTINGS
@given(
    a=st.lists(value_in("float32", -40, 8), min_size=1, max_size=48),
    data=st.data(),
)
def test_dot_gpu_tf32_operands_chopped_accumulation(a, data):
    """GPU: f32 operands rounded to tf32, products exact in f32 (11 + 11 bits),
    accumulated in one chain (order unknown -> sequential) with truncation."""
    b = data.draw(st.lists(value_in("float32", -40, 8), min_size=len(a), max_size=len(a)))
    block_k = data.draw(st.sampled_from([16, 32, 64]))
    af = round_tf32(np.array([float(v) for v in a], np.float32))
    bf = round_tf32(np.array([float(v) for v in b], np.float32))
    prods = [Fraction(float(x)) * Fraction(float(y)) for x, y in zip(af, bf)]
    assert all(representable(p, "float32") or p == 0 or abs(p) < TWO**-126 for p in prods)
    exact = [x * y for x, y in zip(a, b)]
    value, magnitude = float(sum(exact, Fraction(0))), float(frac_abs_sum(exact))
    bound = algebra.dot(value, magnitude, len(a), arith=GPU, operand_dtype=np.float32, order=GPU.dot_order(block_k))
    for mode in ("chop", "nearest"):
        computed = simulate_sum(
            [rnd(p, "float32", flush=True) for p in prods], GPU.dot_order(block_k), "float32", mode=mode, flush=True
        )
        assert_within(computed - sum(exact, Fraction(0)), float(bound.err), f"gpu dot {mode}")


@SETTINGS
@given(a=st.lists(value_in("float32", -40, 8), min_size=1, max_size=48), data=st.data())
def test_dot_tpu_bf16_passes(a, data):
    """TPU default precision: f32 operands rounded to bf16, products exact, f32 sums."""
    b = data.draw(st.lists(value_in("float32", -40, 8), min_size=len(a), max_size=len(a)))
    ab = [rnd(x, "bfloat16") for x in a]
    bb = [rnd(y, "bfloat16") for y in b]
    exact = [x * y for x, y in zip(a, b)]
    computed = simulate_sum(
        [rnd(x * y, "float32", flush=True) for x, y in zip(ab, bb)], tolerance.SEQUENTIAL, "float32", flush=True
    )
    bound = algebra.dot(
        float(sum(exact, Fraction(0))),
        float(frac_abs_sum(exact)),
        len(a),
        arith=TPU,
        operand_dtype=np.float32,
        order=TPU.dot_order(32),
    )
    assert_within(computed - sum(exact, Fraction(0)), float(bound.err), "tpu dot")


def test_dot_gpu_operand_rounding_worst_case():
    """x_i = y_i = 1 + 2^-11 - 2^-23 round down to 1 in tf32: each product loses
    ~2 u_tf32; the operand term of the bound is nearly used up."""
    n = 16
    v = np.float32(1 + 2.0**-11 - 2.0**-23)
    assert round_tf32(np.array([v]))[0] == 1.0
    exact = Fraction(float(v)) ** 2 * n
    computed = simulate_sum([Fraction(1)] * n, tolerance.SEQUENTIAL, "float32", mode="chop")
    assert computed == n
    bound = algebra.dot(float(exact), float(exact), n, arith=GPU, operand_dtype=np.float32, order=tolerance.SEQUENTIAL)
    ratio = assert_within(computed - exact, float(bound.err), "tf32 worst case")
    assert ratio > 0.99, ratio


def test_chopped_accumulation_needs_the_factor_two():
    """Truncating additions: 1 + x with x just below one ulp of 1 stays 1, losing
    ~2u per step. Within the GPU bound (mma unit 2u); beyond the same bound with u."""
    n = 64
    x = TWO**-23 - TWO**-31  # 8 significant bits: a bf16 value, products with 1 exact
    assert representable(x, "bfloat16")
    prods = [Fraction(1)] + [x] * (n - 1)
    computed = simulate_sum(prods, tolerance.SEQUENTIAL, "float32", mode="chop", flush=True)
    assert computed == 1
    err = computed - sum(prods)
    args = dict(operand_dtype=ml_dtypes.bfloat16, order=GPU.dot_order(32))
    total = float(sum(prods))
    gpu = float(algebra.dot(total, total, n, arith=GPU, **args).err)
    ratio = assert_within(err, gpu, "chopped sum, GPU bound")
    with_u = float(algebra.dot(total, total, n, arith=dataclasses.replace(GPU, mma_unit_factor=1.0), **args).err)
    assert abs(err) > Fraction(with_u), f"error {float(abs(err))} within the u-bound {with_u}"
    assert ratio > 0.99 and abs(float(err)) / with_u > 1.9, (ratio, abs(float(err)) / with_u)


# ---------------------------------------------------------------------------
# 8. elementwise operations: every point of the input intervals, then one rounding
# ---------------------------------------------------------------------------

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)  # f32 values
rel_err = st.sampled_from([0.0, 2.0**-24, 2.0**-11, 1e-3, 0.3]) | st.floats(0, 0.5)
position = st.sampled_from([-1.0, 1.0, 0.0]) | st.floats(-1, 1)


def _perturbed(x: float, e: float, t: float) -> Fraction:
    return Fraction(x) + Fraction(e) * Fraction(t)


def _bounded(x: float, rel: float, floor: float = 0.0) -> Bounded:
    return Bounded(np.float64(x), np.float64(abs(x) * rel + floor))


@pytest.mark.parametrize("op", ["add", "multiply", "divide"])
@pytest.mark.parametrize("flush", [True, False], ids=["ftz", "gradual"])
@SETTINGS
@given(a=finite, b=finite, ra=rel_err, rb=rel_err, ta=position, tb=position, scale=st.sampled_from([1.0, 2.0**-130]))
def test_rational_ops(op, flush, a, b, ra, rb, ta, tb, scale):
    """add/multiply/divide: for a^ in [a - ea, a + ea], b^ likewise, fl(a^ op b^)
    (exact, then correctly rounded to f32) is within the returned err of a op b."""
    a *= scale  # scale 2^-130: results in the f32 subnormal range
    arith = CPU if flush else GRADUAL
    A, B = _bounded(a, ra), _bounded(b, rb)
    ah, bh = _perturbed(a, float(A.err), ta), _perturbed(b, float(B.err), tb)
    exact_fn = {"add": lambda x, y: x + y, "multiply": lambda x, y: x * y, "divide": lambda x, y: x / y}[op]
    out = getattr(algebra, op)(A, B, arith=arith, dtype=np.float32)
    if op == "divide":
        if b == 0:  # |b| - eb = 0: no bound (nan for 0/0, whose value is nan too)
            assert not np.isfinite(out.err)
            return
        assert bh != 0
    computed = rnd(exact_fn(ah, bh), "float32", flush=flush)
    assert_within(computed - exact_fn(Fraction(a), Fraction(b)), float(out.err), f"{op}({a}, {b})")


def test_divide_and_rsqrt_unbounded_when_interval_reaches_zero():
    one = Bounded.exact(1.0)
    assert np.isinf(algebra.divide(one, Bounded(np.float64(1.0), np.float64(1.0)), arith=CPU).err)
    assert np.isinf(algebra.divide(one, Bounded(np.float64(-2.0), np.float64(3.0)), arith=CPU).err)
    assert np.isinf(algebra.rsqrt(Bounded(np.float64(1.0), np.float64(1.0)), arith=CPU).err)
    assert np.isinf(algebra.rsqrt(Bounded(np.float64(1.0), np.float64(2.0)), arith=CPU).err)
    # just inside: finite, and the extreme point of the interval is covered
    e = 1 - 2.0**-20
    d = algebra.divide(one, Bounded(np.float64(1.0), np.float64(e)), arith=CPU)
    assert np.isfinite(d.err) and abs(2.0**20 - 1.0) <= d.err
    r = algebra.rsqrt(Bounded(np.float64(1.0), np.float64(e)), arith=CPU)
    assert np.isfinite(r.err) and abs(2.0**10 - 1.0) <= r.err


@pytest.mark.parametrize("flush", [True, False], ids=["ftz", "gradual"])
@SETTINGS
@given(x=st.floats(-100, 88, allow_nan=False), rel=rel_err, abs_err=st.sampled_from([0.0, 1e-6, 0.01, 1.0]), t=position)
def test_exp(flush, x, rel, abs_err, t):
    """exp of any point of [x - e, x + e], computed to float64 and rounded to f32
    (relative error <= u + 2^-52 < the model's t), is within err of exp(x)."""
    X = Bounded(np.float64(x), np.float64(abs(x) * rel * 0.01 + abs_err))
    out = algebra.exp(X, arith=CPU if flush else GRADUAL)
    xh = float(_perturbed(x, float(X.err), t))
    computed = rnd(Fraction(float(np.exp(xh))), "float32", flush=flush)
    # reference exp(x) in float64: relative error 2^-52, far below every term of err
    err = abs(float(computed) - float(np.exp(x)))
    assert err <= out.err, (x, float(X.err), t, err, float(out.err))


def test_exp_bound_is_reached_at_the_interval_end():
    X = Bounded(np.float64(0.5), np.float64(0.01))
    out = algebra.exp(X, arith=CPU)
    worst = abs(float(rnd(Fraction(float(np.exp(0.51))), "float32")) - np.exp(0.5))
    assert worst <= out.err and worst / out.err > 0.99, worst / out.err


@SETTINGS
@given(x=st.floats(1e-30, 1e30), rel=st.floats(0, 0.999), t=position)
def test_rsqrt(x, rel, t):
    X = Bounded(np.float64(x), np.float64(x * rel))
    out = algebra.rsqrt(X, arith=CPU)
    xh = float(_perturbed(x, float(X.err), t))
    assert xh > 0
    computed = float(rnd(Fraction(float(1 / np.sqrt(xh))), "float32"))
    err = abs(computed - 1 / np.sqrt(x))
    assert err <= out.err, (x, rel, t, err, float(out.err))
    if t == -1.0 and rel > 1e-3:  # the worst end of the interval uses most of the bound
        assert err / out.err > 0.99


# ---------------------------------------------------------------------------
# 9. the probabilistic bound on random sums
# ---------------------------------------------------------------------------


def test_probabilistic_bound_on_random_sequential_f32_sums():
    """4096 uniform [0, 1) f32 terms (multiples of 2^-24: every prefix sum is exact
    in float64), summed sequentially in f32 (np.add.accumulate); every prefix of
    every trial is within lambda sqrt(k) u sum|x|, far inside gamma_k sum|x|."""
    trials, n = 64, 4096
    rng = np.random.default_rng(3)
    terms = (rng.integers(0, 2**24, (trials, n)) * 2.0**-24).astype(np.float32)
    computed = np.add.accumulate(terms, axis=1, dtype=np.float32).astype(np.float64)
    exact = np.cumsum(terms.astype(np.float64), axis=1)
    err = np.abs(computed - exact)
    k = np.arange(n)  # depth of the prefix of k + 1 terms
    u = tolerance.unit_roundoff(np.float32)
    prob = tolerance.probabilistic_gamma(k, u) * exact  # sum|x| = sum x
    det = tolerance.gamma(k, u) * exact
    ratio_prob = np.max(err / np.where(prob > 0, prob, 1))
    ratio_det = np.max((err / np.where(det > 0, det, 1))[:, 100:])
    assert ratio_prob <= 1.0, ratio_prob
    assert ratio_det < float(tolerance.probabilistic_gamma(100, u) / tolerance.gamma(100, u)), ratio_det
    # the whole-sum version through the algebra
    whole = algebra.reduce_sum(
        Bounded.exact(terms[0].astype(np.float64)), 0, arith=CPU.with_probabilistic(), order=tolerance.SEQUENTIAL
    )
    assert err[0, -1] <= whole.err
    assert (
        whole.err
        < algebra.reduce_sum(Bounded.exact(terms[0].astype(np.float64)), 0, arith=CPU, order=tolerance.SEQUENTIAL).err
    )


# ---------------------------------------------------------------------------
# XLA:CPU reads subnormal inputs as zero (DAZ) as well as flushing results (FTZ):
# the real backend, against algebra.operand / dot(flushed_magnitude=...)
# ---------------------------------------------------------------------------


def _xla_cpu(fn, *args):
    import jax
    import jax.numpy as jnp

    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(jax.jit(fn)(*(jnp.asarray(a) for a in args)), np.float64)


def test_xla_cpu_is_denormals_are_zero():
    """The premise: a subnormal f32 input is read as 0 (x * 2 of 0.75 * 2^-126 would
    be a normal number), so an input, not only a result, can be lost."""
    x = np.array([0.75 * 2.0**-126], np.float32)
    assert _xla_cpu(lambda v: v * 2.0, x)[0] == 0.0


def test_xla_cpu_dot_with_subnormal_operands_within_bound():
    """a = 0.75 * 2^-126 (subnormal), b = 2^20: a b = 9.2e-33 is normal, XLA:CPU's
    dot gives 0. Without the flushed magnitude the bound (2.5e-38) would not cover
    it; with it, it does. Then random vectors with sprinkled subnormals."""
    import jax.numpy as jnp

    a = np.array([[0.75 * 2.0**-126]], np.float32)
    b = np.array([[2.0**20]], np.float32)
    got = _xla_cpu(jnp.dot, a, b)[0, 0]
    exact = Fraction(float(a[0, 0])) * Fraction(float(b[0, 0]))
    assert got == 0.0
    kw = dict(arith=CPU, operand_dtype=np.float32, order=tolerance.SEQUENTIAL)
    without = float(algebra.dot(float(exact), float(exact), 1, **kw).err)
    assert exact > Fraction(without)  # the flush of inputs is a real term of the bound
    with_flush = float(algebra.dot(float(exact), float(exact), 1, flushed_magnitude=float(exact), **kw).err)
    assert_within(Fraction(got) - exact, with_flush, "DAZ dot")

    rng = np.random.default_rng(4)
    n, rows = 64, 32
    x = rng.standard_normal((rows, n)).astype(np.float32)
    y = (rng.standard_normal((n, 1)) * 2.0**20).astype(np.float32)
    mask = rng.random((rows, n)) < 0.2
    x[mask] = (rng.uniform(0.01, 1, mask.sum()) * 2.0**-126).astype(np.float32)  # subnormal
    got = _xla_cpu(jnp.dot, x, y)[:, 0]
    sub = np.where(np.abs(x.astype(np.float64)) < 2.0**-126, np.abs(x.astype(np.float64)), 0.0)
    for i in range(rows):
        xs = [Fraction(float(v)) for v in x[i]]
        ys = [Fraction(float(v)) for v in y[:, 0]]
        prods = [p * q for p, q in zip(xs, ys)]
        bound = algebra.dot(
            float(sum(prods)),
            float(frac_abs_sum(prods)),
            n,
            flushed_magnitude=float(sub[i] @ np.abs(y[:, 0].astype(np.float64))),
            **kw,
        )
        assert_within(Fraction(float(got[i])) - sum(prods, Fraction(0)), float(bound.err), f"row {i}")


def test_xla_cpu_elementwise_with_subnormal_operands_within_bound():
    """add / multiply of subnormal f32 inputs on XLA:CPU against the algebra with
    the inputs entered through algebra.operand."""
    tiny = 2.0**-126
    a = np.array([0.75, 0.875, -0.625, 0.5, 1.5], np.float64) * tiny  # exact in f32 (subnormals: 2^-149 grid)
    b = np.array([0.75, 0.125, -0.875, 2.0**30, -0.25], np.float64) * np.array([tiny, tiny, tiny, 1.0, tiny])
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    assert np.array_equal(a32.astype(np.float64), a) and np.array_equal(b32.astype(np.float64), b)
    A, B = algebra.operand(a, arith=CPU), algebra.operand(b, arith=CPU)
    for name, fn in (("add", lambda p, q: p + q), ("multiply", lambda p, q: p * q)):
        got = _xla_cpu(fn, a32, b32)
        bound = getattr(algebra, name)(A, B, arith=CPU).err
        exact_only = getattr(algebra, name)(Bounded.exact(a), Bounded.exact(b), arith=CPU).err
        for i in range(len(a)):
            e = Fraction(float(got[i])) - fn(Fraction(a[i]), Fraction(b[i]))
            assert_within(e, float(bound[i]), f"{name}({a[i]}, {b[i]})")
        if name == "add":  # 0.75 tiny + 0.75 tiny: computed 0, beyond the FTZ-only bound
            assert got[0] == 0.0 and Fraction(a[0] + b[0]) > Fraction(float(exact_only[0]))
