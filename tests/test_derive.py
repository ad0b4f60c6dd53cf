"""oracles/derive.py: the bound derived from a reference's jaxpr is sound on the
primitives it covers, its value is the float64 oracle, unverifiable elements are
flagged, unsupported primitives are refused by name, and float64 stays scoped.

Soundness is checked against two real low-precision runs of each reference: as
written under ``jax.jit`` in bf16 (facts: the reference's own dtypes, any order), and
with every input upcast to f32 and the result stored in bf16 (facts: f32 compute),
which is how a kernel computes it. One seed of N(0, 1) inputs here; the same check
over every element kind of strategies.elements, 3 seeds each, in bf16, f16 and f32
(216 cases per model) stayed within the bound wherever one is finite (largest budget
used 0.95) when the rules were written; it found the missing overflow rule of sums and
products (an f16 cumprod past 65504). Rerun after the named max errors, exact grid sums
and lower bounds (2026-11-24), with five more models (the online log-sum-exp and the
softmax below, a tiled softmax times a second matrix and its log-sum-exp, a layer
norm with sqrt and log of its variance): within the bound everywhere; the largest
budget used, 0.99994, is an f16 product flushed to 0, whose error is its own size, which
is then the bound (a rounding never errs by more).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

from pallascheck.kernels.compat import float64_enabled
from pallascheck.oracles import derive
from pallascheck.oracles.derive import Facts
from pallascheck.oracles.tolerance import CPU, SEQUENTIAL, blocked

BF16 = ml_dtypes.bfloat16


def _elementwise(x, y):
    a = jnp.exp(x) + jnp.exp2(y) - jnp.expm1(x) + jnp.log1p(jnp.abs(y)) + jnp.log(1.0 + x * x)
    b = jnp.tanh(x) * jax.nn.sigmoid(y) + lax.erf(x) - jnp.sqrt(jnp.abs(y)) + lax.rsqrt(1.0 + y * y)
    c = jnp.power(jnp.abs(x) + 1.0, y) + x**3 + (1.0 + y * y) ** -2 + jnp.sin(x) * jnp.cos(y)
    return jnp.maximum(a, b) - jnp.minimum(b, c) + jnp.where(x > y + 0.5, a / (1.0 + y * y), c)


def _reductions(x, y):
    s = jnp.sum(x, axis=1, keepdims=True) + jnp.max(y, axis=1, keepdims=True) - jnp.min(x, axis=0)
    c = (
        jnp.cumsum(y, axis=1)
        + lax.cumlogsumexp(x, axis=1)
        + lax.cummax(y, axis=0)
        + jnp.cumprod(1.0 + x / 64.0, axis=1)
    )
    return s + c + jax.nn.logsumexp(x, axis=1, keepdims=True) + jax.nn.softmax(y, axis=0)


def _dots_and_shapes(x, y):
    z = jnp.einsum("ij,kj->ik", x, y)  # dot_general contracting the last axes
    z = jnp.concatenate([z, jnp.flip(z, axis=0)], axis=1)[:, ::2]
    z = jnp.pad(z, ((1, 0), (0, 0)))[1:] + lax.dynamic_slice(jnp.tile(z, (2, 1)), (3, 0), z.shape)
    rows = jnp.array([2, 0, 2, 1, 5, 3, 7, 4])
    gathered = z[rows]
    scattered = jnp.zeros_like(z).at[rows].add(z)
    return (gathered + scattered).T.reshape(z.shape)


def _loops(x, y):
    def step(carry, row):
        carry = carry * 0.5 + row
        return carry, jnp.tanh(carry)

    carry, ys = lax.scan(step, jnp.zeros(x.shape[1], x.dtype), x)
    twice = lax.fori_loop(0, 2, lambda i, c: c + y * c, y)
    _, looped = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.75 + x), (0, y))

    @jax.custom_vjp
    def scaled(a):
        return a * 3.0

    scaled.defvjp(lambda a: (scaled(a), None), lambda _, g: (g * 3.0,))
    return ys + carry + twice + looped + scaled(jax.nn.relu(x)) + jax.nn.softplus(y)


REFERENCES = {
    "elementwise": _elementwise,
    "reductions": _reductions,
    "dots_and_shapes": _dots_and_shapes,
    "loops": _loops,
}


def _inputs(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((8, 16)).astype(BF16) for _ in range(2)]


def _f64(fn, args):
    with float64_enabled():
        out = jax.jit(fn)(*[np.asarray(a, np.float64) for a in args])
        return tuple(np.asarray(o) for o in out) if isinstance(out, tuple) else np.asarray(out)


def _within(got, derived: derive.Derived) -> float:
    """Worst |got - oracle| / bound over the verifiable elements."""
    # an overflowing exact value, or a bound that is infinite because an intermediate may
    # overflow in the low precision, claims nothing: accuracy is checked where a bound is
    ok = ~derived.unverifiable[0] & np.isfinite(derived.values[0]) & np.isfinite(derived.bounds[0])
    error = np.abs(np.asarray(got, np.float64) - derived.values[0])
    with np.errstate(invalid="ignore", divide="ignore"):
        return float(np.max(np.where(ok, error / derived.bounds[0], 0.0)))


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_value_is_the_float64_oracle_and_the_bound_holds(name: str) -> None:
    fn = REFERENCES[name]
    for seed in range(1):  # more seeds and every element kind: measured offline, see the module docstring
        args = _inputs(seed)
        as_written = derive.derive(fn, args, facts=Facts(compute_dtype=None, order=SEQUENTIAL), arith=CPU)
        np.testing.assert_allclose(as_written.values[0], _f64(fn, args), rtol=1e-12, atol=1e-12)
        assert as_written.unverifiable[0].mean() < 0.1  # the checks see most elements
        assert _within(jax.jit(fn)(*args), as_written) <= 1.0
        upcast = lambda *a: fn(*[v.astype(jnp.float32) for v in a]).astype(jnp.bfloat16)  # noqa: E731
        in_f32 = derive.derive(fn, args, facts=Facts(compute_dtype="float32", out_dtype="bfloat16"), arith=CPU)
        assert _within(jax.jit(upcast)(*args), in_f32) <= 1.0
        assert np.all(in_f32.bounds[0] <= as_written.bounds[0] + 1e-300)  # f32 compute is the tighter model


def test_gradient_derivation_is_the_float64_vjp_and_bounds_the_bf16_one() -> None:
    def fn(x, w):
        return jnp.tanh(x @ w) * jax.nn.sigmoid(x @ w)

    rng = np.random.default_rng(0)
    x, w, ct = (rng.standard_normal(s).astype(BF16) for s in ((8, 16), (16, 4), (8, 4)))
    pulled = derive.vjp_function(fn, (0, 1))
    d = derive.derive(pulled, [x, w, ct], facts=Facts(compute_dtype=None), arith=CPU)
    exact = _f64(pulled, [x, w, ct])
    for i in range(2):
        np.testing.assert_allclose(d.values[i], exact[i], rtol=1e-12, atol=1e-12)
        got = np.asarray(jax.jit(pulled)(x, w, ct)[i], np.float64)
        assert np.all(np.abs(got - d.values[i]) <= np.where(d.unverifiable[i], np.inf, d.bounds[i]))


def test_a_comparison_within_its_error_is_unverifiable() -> None:
    def fn(x):
        return (x * 3.0 > 1.0).astype(jnp.float32) + x  # the decision itself is the output

    x = np.array([1 / 3, 0.9, -1.0], np.float32)
    d = derive.derive(fn, [x], facts=Facts(), arith=CPU)
    assert d.unverifiable[0].tolist() == [True, False, False]
    assert d.explain(0, (0,)).startswith("gt at ")  # the comparison is named as the culprit


def test_a_select_on_an_undecided_comparison_is_bounded_by_its_cases() -> None:
    """relu'(z) g at z within its error of 0: the kernel may give g or 0, so the bound
    there covers |g| (the hand-derived matmul gradient bound charges the same)."""

    def fn(z, g):
        return jnp.where(z * 3.0 > 1.0, g, 0.0)

    z, g = np.array([1 / 3, 0.9], np.float32), np.array([0.75, 0.75], np.float32)
    d = derive.derive(fn, [z, g], facts=Facts(), arith=CPU)
    assert not d.unverifiable[0].any()
    assert d.bounds[0][0] >= 0.75 and d.bounds[0][1] < 1e-6
    assert d.explain(0, (0,)).startswith("gt at ")


def test_a_division_by_a_value_within_its_error_is_unverifiable() -> None:
    def fn(x):
        return 1.0 / (x * 3.0 - 0.3)  # 3 x rounds: the divisor, about -7e-9, is within its error

    d = derive.derive(fn, [np.array([0.1, 2.0], np.float32)], facts=Facts(), arith=CPU)
    assert d.unverifiable[0].tolist() == [True, False]


def test_blocked_order_sets_the_depth_of_each_prefix() -> None:
    """A blocked cumsum's element i chains (b - 1) + (blocks before it) additions:
    with positive terms the bound grows in steps at each block edge."""
    x = np.ones((1, 12), np.float32)
    d = derive.derive(lambda v: jnp.cumsum(v, axis=1), [x], facts=Facts(order=blocked(4)), arith=CPU)
    seq = derive.derive(lambda v: jnp.cumsum(v, axis=1), [x], facts=Facts(), arith=CPU)
    # up to 5 terms both chain 4 additions at most; from the 6th the blocked chain is shorter
    assert np.all(d.bounds[0][0, :5] == seq.bounds[0][0, :5]) and np.all(d.bounds[0][0, 5:] < seq.bounds[0][0, 5:])


def test_an_unsupported_primitive_is_refused_by_name() -> None:
    with pytest.raises(derive.UnsupportedPrimitive, match="primitive 'sort'"):
        derive.derive(lambda v: jnp.sort(v), [np.ones(4, np.float32)], facts=Facts(), arith=CPU)


def test_float64_is_enabled_only_inside_the_derivation() -> None:
    derive.derive(jnp.exp, [np.ones(3, np.float32)], facts=Facts(), arith=CPU)
    assert jnp.asarray(1.0).dtype == jnp.float32


def test_facts_refuse_what_they_cannot_model() -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        Facts(compute_dtype="float128")
    with pytest.raises(TypeError, match="order must be an Accumulation"):
        Facts(order="blocked")


def test_an_integer_reduction_reduces_its_operands_masks_with_it() -> None:
    """A row's group index as a count of group ends at or below it (the ragged-dot
    reference's form): an integer reduce_sum over a [rows, groups] comparison."""

    def scaled_by_group(x, ends):
        group = jnp.sum(jnp.arange(x.shape[0])[:, None] >= ends[None, :], axis=1)
        return x * group.astype(x.dtype)

    x, ends = np.ones(6, np.float32), np.array([2, 4], np.int32)
    d = derive.derive(scaled_by_group, [x, ends], facts=Facts(), arith=CPU)
    np.testing.assert_array_equal(np.asarray(d.values[0]), [0, 0, 1, 1, 2, 2])
    assert not np.asarray(d.unverifiable[0]).any()


def test_a_fully_masked_row_is_exactly_zero_and_verifiable() -> None:
    """exp(-inf) is exactly 0 and sums and products of exact zeros are exactly 0: an
    online softmax's empty row (l == 0 decides it) must not be made unverifiable by
    underflow floors charged to values that are exactly 0."""

    def fn(s):
        p = jnp.exp(
            s - jnp.where(jnp.isneginf(jnp.max(s, axis=1, keepdims=True)), 0.0, jnp.max(s, axis=1, keepdims=True))
        )
        l = 0.5 * jnp.sum(p, axis=1)
        return jnp.where(l == 0.0, 1.0, l)

    s = np.array([[-np.inf, -np.inf], [0.0, -1.0]], np.float32)
    d = derive.derive(fn, [s], facts=Facts(), arith=CPU)
    assert not d.unverifiable[0].any()
    assert d.bounds[0][0] == 0.0 and d.bounds[0][1] > 0.0


def test_a_one_hot_sum_is_exact_and_a_dense_one_is_not() -> None:
    """Additions of exact zeros are exact: picking one term by a mask and summing is
    exact (the target logit of a cross-entropy), whatever the length of the row."""

    def fn(z, labels):
        picked = jnp.sum(jnp.where(jnp.arange(z.shape[1])[None, :] == labels[:, None], z, 0.0), axis=1)
        return picked, jnp.sum(z, axis=1)

    z = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    d = derive.derive(fn, [z, np.array([0, 5, 63], np.int32)], facts=Facts(), arith=CPU)
    np.testing.assert_array_equal(d.bounds[0], 0.0)
    assert np.all(d.bounds[1] > 0.0)


def test_top_k_copies_values_and_flags_indices_of_near_ties() -> None:
    def fn(x):
        values, indices = lax.top_k(x * 3.0, 2)  # x * 3 rounds: every value carries an error
        return values, indices

    x = np.array([[1.0, 1.0 + 2.0**-23, 0.0], [4.0, 2.0, 0.0]], np.float32)  # row 0: within 2 errors
    d = derive.derive(fn, [x], facts=Facts(), arith=CPU)
    np.testing.assert_array_equal(d.values[0], [[3.0 * (1.0 + 2.0**-23), 3.0], [12.0, 6.0]])
    assert np.all(d.bounds[0] >= 12.0 * 2.0**-24 * np.array([[0.25], [1.0]]))
    assert d.unverifiable[1].tolist() == [[True, True], [False, False]]
    assert not d.unverifiable[0].any()


def test_exact_additions_do_not_round() -> None:
    """0 + x is x, and z - m of two exact floats within a factor 2 is exact (Sterbenz):
    the cross-entropy's m - t at logits near 1e4 is exact, not u |m|."""

    def fn(z):
        t = 0.0 + z[:, 1]
        return jnp.max(z, axis=1) - t, z[:, 0] - z[:, 1]

    z = np.array([[12708.3, 12700.1], [3.0, -1.0]], np.float32)
    d = derive.derive(fn, [z], facts=Facts(), arith=CPU)
    for out in d.bounds:  # row 0 exact; row 1 is 3 - (-1): the signs differ, it is charged a rounding
        assert out[0] == 0.0 and out[1] > 0.0


def _online_log_sum_exp(x):
    """m + log(l) of logits s = 3 x, as a flash kernel computes it: over tiles of 4
    columns, a running max m and sum l rescaled by exp(m_old - m_new) at each tile."""
    s = x * 3.0
    m = jnp.full((x.shape[0], 1), -jnp.inf, jnp.float32)
    l = jnp.zeros((x.shape[0], 1), jnp.float32)
    for start in range(0, x.shape[1], 4):
        tile = s[:, start : start + 4]
        m_new = jnp.maximum(m, jnp.max(tile, axis=1, keepdims=True))
        l = jnp.exp(m - m_new) * l + jnp.sum(jnp.exp(tile - m_new), axis=1, keepdims=True)
        m = m_new
    return (m + jnp.log(l))[:, 0]


def _softmax(x):
    s = x * 3.0
    e = jnp.exp(s - jnp.max(s, axis=1, keepdims=True))
    return e / jnp.sum(e, axis=1, keepdims=True)


def test_the_error_of_a_softmax_max_cancels() -> None:
    """The value of the max a softmax subtracts does not matter: its error is named
    (oracles/shifts.py) and cancels exactly in exp(s - m) / sum and in m + log(sum).
    Logits near 3e6 in f32 each err by up to u 3e6 = 0.18 (e). Charged independently,
    m's error came into every exp(s - m), the sum and the division (p's bound 1.5 p),
    and an online softmax's rescale exp(m_old - m_new) cost 2e per tile: over 8 tiles
    the sum's bound reached the sum, log(l) undecidable on every row. Named: the log-sum-
    exp is within e and its final rounding, p within its own logit's error and the
    sum's (about expm1(2e) p)."""
    x = (1e6 + np.random.default_rng(0).uniform(0.0, 3.0, (4, 32))).astype(np.float32)
    e = 2.0**-24 * 3e6
    lse = derive.derive(_online_log_sum_exp, [x], facts=Facts(), arith=CPU)
    assert not lse.unverifiable[0].any()
    assert np.all(lse.bounds[0] <= 2.5 * e)  # e (the logits) + e (m + log l rounds at 3e6) + the rest
    assert _within(jax.jit(_online_log_sum_exp)(x), lse) <= 1.0
    p = derive.derive(_softmax, [x], facts=Facts(), arith=CPU)
    assert np.all(p.bounds[0] <= 0.6 * p.values[0])
    assert _within(jax.jit(_softmax)(x), p) <= 1.0


def test_a_sum_of_exact_terms_on_one_grid_is_exact() -> None:
    """100 copies of -7712 (a bf16, 241 * 2^5) sum to -771200 = 24100 * 2^5 in f32 in any
    order: every partial sum is a multiple of 2^5 below 2^24 * 2^5. So a constant row's
    variance is exactly 0 up to the mean's rounding, and rsqrt(var + eps) is decided
    (it was unverifiable: the sum's gamma bound, 4.6, made the variance's 2e-3 > eps).
    A row whose terms need more than 24 bits together still pays its rounding."""

    def statistics(x):
        x = x.astype(jnp.float32)
        mean = jnp.sum(x, axis=1, keepdims=True) / x.shape[1]
        c = x - mean
        return jnp.sum(x, axis=1), lax.rsqrt(jnp.sum(c * c, axis=1) / x.shape[1] + 1e-5)

    x = np.stack([np.full(100, -7712.0), np.linspace(1.0, 2.0**20, 100)]).astype(BF16)
    x[1, 0] = 2.0**-10  # a term 2^30 times finer than the largest: not on a 24-bit grid
    d = derive.derive(statistics, [x], facts=Facts(), arith=CPU)
    assert d.bounds[0][0] == 0.0 and d.bounds[0][1] > 0.0
    assert not d.unverifiable[1].any()
    assert (
        _within(
            jax.jit(statistics)(x)[1],
            dataclasses.replace(d, values=d.values[1:], bounds=d.bounds[1:], unverifiable=d.unverifiable[1:]),
        )
        <= 1.0
    )


def test_division_by_a_constant_is_a_rounded_reciprocal() -> None:
    """XLA:CPU computes x / 3 as x * fl(1/3): up to (2u + u^2)|x/3|, not one rounding
    (one rounding was exceeded 1.33x here); a power of two divides exactly."""
    x = np.random.default_rng(0).uniform(1.0, 2.0, 4096).astype(np.float32)
    by_three = derive.derive(lambda v: v / 3.0, [x], facts=Facts(), arith=CPU)
    assert _within(jax.jit(lambda v: v / 3.0)(x), by_three) <= 1.0
    assert np.all(by_three.bounds[0] >= 2.0 * 2.0**-24 * by_three.values[0])
    by_four = derive.derive(lambda v: v / 4.0, [x], facts=Facts(), arith=CPU)
    assert np.all(by_four.bounds[0] <= 2.0**-24 * by_four.values[0] * 1.0000001)


def test_a_sum_of_squares_is_never_negative() -> None:
    """rsqrt(var + eps) of a constant row of -8896 (bf16, 100 features): the mean,
    computed as sum * fl(1/100), errs by up to 2u 8896 = 1.1e-3, so the variance's
    bound (1.2e-6) exceeds eps = 1e-6, and as an interval var + eps reaches below 0.
    But a computed square is never negative, nor a sum or quotient of such, so the
    kernel's var + eps is at least eps: rsqrt is decided. The same shift without the
    square (c + eps) may be negative and stays undecided."""

    def rstd(x):
        x = x.astype(jnp.float32)
        c = x - jnp.sum(x, axis=1, keepdims=True) / x.shape[1]
        return lax.rsqrt(jnp.sum(c * c, axis=1) / x.shape[1] + 1e-6), lax.rsqrt(c[:, 0] + 1e-6)

    x = np.full((1, 100), -8896.0).astype(BF16)
    d = derive.derive(rstd, [x], facts=Facts(), arith=CPU)
    assert not d.unverifiable[0].any() and d.unverifiable[1].all()
    assert _within(jax.jit(rstd)(x)[0], d) <= 1.0


def test_a_rounding_moves_a_value_no_further_than_zero() -> None:
    """0 is representable, so rounding to nearest (or flushing to zero) errs by at most
    the value's own size: an f32 probability of about 1e-38 stored in f16 errs by about
    1e-38, not by f16's underflow floor (6.1e-5, with flush-to-zero), which the bound
    of a flash kernel's p.astype(f16) charged to every underflowed p of a row (15x the
    hand-derived bound at such outputs)."""
    x = np.array([3e-19, 1.0], np.float32)
    fn = lambda v: (v * v).astype(jnp.float16)  # noqa: E731
    d = derive.derive(fn, [x], facts=Facts(), arith=CPU)
    assert d.bounds[0][0] <= 2.0e-37 and d.bounds[0][1] >= 2.0**-11  # 9e-38 and its f32 product's floor
    assert _within(jax.jit(fn)(x), d) <= 1.0
