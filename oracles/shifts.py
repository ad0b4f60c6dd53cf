"""Named shifts: the error of a running max carried as an unknown, so that it cancels.

A softmax computes exp(s - m) / sum(exp(s - m)) and a log-sum-exp m + log(sum(exp(s - m))):
in exact arithmetic the value of m does not matter, so the error of the kernel's
computed m (the error of its computed logits' max) is no error of the result. An
elementwise error bound cannot see that: it charges m's error to every exp(s - m),
to their sum and again to the division, and an online softmax charges it once more at
every tile's rescale exp(m_old - m_new), until the sum's bound reaches the sum itself
(large logits in f16: log(l) undecidable). So the evaluation (oracles/derive.py) gives
the error of every computed max a name instead of adding it to ``err``:

- the max's computed value is m + delta, delta an unknown with |delta| <= Delta (the
  max's error bound), one unknown per element, the same wherever m is used;
- a value that depends on such unknowns linearly is carried "additive":
  computed = v + sum_k c_k delta_k + r, |r| <= err (x - m, m + log l, sums and constant
  multiples of such);
- exp turns an additive value into a factor: exp(v + c delta + r) = exp(v + r) e^(c delta),
  carried "scaled": computed = (v + r) e^(sum_k c_k delta_k) (p = exp(s - m), sums of
  terms with one factor, products and quotients of scaled values, a dot of a scaled
  operand whose factor is the same along the contraction with a plain one); log turns
  a scaled value back into an additive one.

So acc / l, both carrying e^(-delta), is (acc + r_a) / (l + r_l): delta is gone; the
rescale alpha = exp(m_old - m_new) carries e^(delta_old - delta_new) and alpha l_old,
l_old carrying e^(-delta_old), carries e^(-delta_new), as the new tile's terms do; and
m + log(l) = (m + delta) + (log(l + r) - delta). These are identities of real
arithmetic, so the cancellation is exact, not first order. Each rule charges its own
roundings in the frame where they happen: a rounding of a scaled value X = (v + r) F
errs by at most u|X| + floor = F (u |v + r| + floor / F), the same relative part and an
underflow floor at most e^D times larger (D = sum_k |c_k| Delta_k, |ln F| <= D), which
the evaluation charges (``growing``); a rounding of an additive value is charged on its
whole magnitude |v| + err + D. Where an identity does not hold (terms of one sum with
different factors, an operation with no rule for names), the names are folded back
into the error, which bounds |computed - v| exactly: additive r + D, scaled
|v| (e^D - 1) + r e^D.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.oracles import algebra

F64 = np.float64


@dataclasses.dataclass(frozen=True)
class Shift:
    """A value's dependence on the unknown ``symbol``: ``coef`` times its element
    ``index`` (both in the value's shape; coef 0: no dependence there)."""

    symbol: int
    coef: jax.Array
    index: jax.Array


class ShiftAlgebra:
    """The evaluator's bookkeeping of named unknowns (mixed into oracles/derive's evaluator).

    A tracked value has ``shifts`` (a tuple of ``Shift``) and ``scaled`` (the form:
    False additive, True scaled); ``deltas[k]`` holds Delta_k, flat."""

    def __init__(self) -> None:
        self.deltas: list[jax.Array] = []
        self.grow: Any = 1.0  # e^D of the result a rule is computing: its underflow floors grow by it

    @contextlib.contextmanager
    def growing(self, spread: Any) -> Iterator[None]:
        """Within the block the underflow floors are charged in a scaled result's frame."""
        previous, self.grow = self.grow, jnp.exp(spread)
        try:
            yield
        finally:
            self.grow = previous

    def spread_of(self, shifts: Sequence[Shift], shape: tuple[int, ...]) -> jax.Array:
        """D = sum_k |c_k| Delta_k[index_k], elementwise."""
        d = jnp.zeros(shape, F64)
        for s in shifts:
            d = d + algebra.times(jnp.abs(s.coef), self.deltas[s.symbol][s.index])
        return d

    def spread(self, t: Any) -> jax.Array:
        return self.spread_of(t.shifts, jnp.shape(t.value))

    def reach(self, t: Any) -> jax.Array:
        """The largest |computed value| in the frame its roundings are charged in: a scaled
        value's own ((v + r) without its factor), else |v| + r + D."""
        return t.magnitude if t.scaled else t.magnitude + self.spread(t)

    @staticmethod
    def unnamed(t: Any) -> jax.Array:
        """Where ``t`` depends on no unknown."""
        free = jnp.ones(jnp.shape(t.value), bool)
        for s in t.shifts:
            free = free & (s.coef == 0)
        return free

    def _folded_err(self, t: Any, d: jax.Array) -> jax.Array:
        if not t.scaled:
            return t.err + d
        # |(v + r) e^x - v| <= |v| (e^|x| - 1) + |r| e^|x|
        return algebra.times(jnp.abs(t.value), jnp.expm1(d)) + algebra.times(t.err, jnp.exp(d))

    def folded(self, t: Any) -> Any:
        """``t`` with its names folded into its error: a plain value."""
        if not t.shifts:
            return t
        return dataclasses.replace(t, err=self._folded_err(t, self.spread(t)), shifts=(), scaled=False)

    def fold_where(self, t: Any, mask: jax.Array) -> Any:
        """``t`` with its names folded into its error where ``mask`` holds."""
        mask = jnp.broadcast_to(mask, jnp.shape(t.value))
        if not t.shifts or not bool(jnp.any(mask)):
            return t
        err = jnp.where(mask, self._folded_err(t, self.spread(t)), t.err)
        shifts = tuple(dataclasses.replace(s, coef=jnp.where(mask, 0.0, s.coef)) for s in t.shifts)
        return self.normalised(dataclasses.replace(t, err=err, shifts=shifts))

    def normalised(self, t: Any) -> Any:
        """Names dropped where they change nothing: at an infinite value or an unbounded
        error, at an exact zero of a scaled value (0 times any factor is 0), where the
        unknown is exactly 0; a value left with none is plain."""
        if not t.shifts:
            return dataclasses.replace(t, scaled=False) if t.scaled else t
        dead = ~jnp.isfinite(t.value) | ~jnp.isfinite(t.err)
        if t.scaled:
            dead = dead | ((t.value == 0) & (t.err == 0))
        kept = []
        for s in t.shifts:
            coef = jnp.where(dead | (self.deltas[s.symbol][s.index] == 0), 0.0, s.coef)
            if bool(jnp.any(coef != 0)):
                kept.append(Shift(s.symbol, coef, s.index))
        return dataclasses.replace(t, shifts=tuple(kept), scaled=t.scaled and bool(kept))

    def named(self, t: Any) -> Any:
        """``t``'s error as a new unknown (computed = value + delta, |delta| <= err):
        what a max or min returns, so that the shifts it takes part in can cancel."""
        if not t.is_float:
            return t
        ok = jnp.isfinite(t.value) & jnp.isfinite(t.err) & (t.err > 0)
        if not bool(jnp.any(ok)):
            return t
        symbol = len(self.deltas)
        self.deltas.append(jnp.where(ok, t.err, 0.0).reshape(-1))
        index = jnp.arange(t.value.size, dtype=jnp.int32).reshape(t.value.shape)
        return dataclasses.replace(
            t, err=jnp.where(ok, 0.0, t.err), shifts=(Shift(symbol, ok.astype(F64), index),), scaled=False
        )

    @staticmethod
    def broadcast(t: Any, shape: tuple[int, ...]) -> Any:
        """``t`` broadcast to ``shape`` (a scalar literal operand of an elementwise op)."""
        if jnp.shape(t.value) == shape:
            return t
        return dataclasses.replace(
            t,
            value=jnp.broadcast_to(t.value, shape),
            err=jnp.broadcast_to(t.err, shape),
            bad=jnp.broadcast_to(t.bad, shape),
            dom=jnp.broadcast_to(t.dom, shape),
            shifts=tuple(
                Shift(s.symbol, jnp.broadcast_to(s.coef, shape), jnp.broadcast_to(s.index, shape)) for s in t.shifts
            ),
        )

    @staticmethod
    def terms(ts: Sequence[Any], symbol: int) -> list[tuple[jax.Array, jax.Array]]:
        """(coefficient, index) of ``symbol`` in each of ``ts``; zeros where one has none."""
        out = []
        for t in ts:
            s = next((s for s in t.shifts if s.symbol == symbol), None)
            shape = jnp.shape(t.value)
            out.append((jnp.zeros(shape, F64), jnp.zeros(shape, jnp.int32)) if s is None else (s.coef, s.index))
        return out

    @staticmethod
    def symbols(ts: Sequence[Any]) -> list[int]:
        """The unknowns any of ``ts`` depends on."""
        return sorted({s.symbol for t in ts for s in t.shifts})

    def added(self, a: Any, b: Any, sign: float) -> tuple[Any, Any, tuple[Shift, ...]]:
        """The names of a + sign b for additive a, b (or of a product's factors, scaled):
        coefficients add. Where both depend on one unknown at different elements (no
        common term), both are folded there first. Same shapes."""
        names = self.symbols([a, b])
        clash = jnp.zeros(jnp.shape(a.value), bool)
        for k in names:
            (ca, ia), (cb, ib) = self.terms([a, b], k)
            clash = clash | ((ca != 0) & (cb != 0) & (ia != ib))
        a, b = self.fold_where(a, clash), self.fold_where(b, clash)
        shifts = []
        for k in names:
            (ca, ia), (cb, ib) = self.terms([a, b], k)
            shifts.append(Shift(k, ca + sign * cb, jnp.where(ca != 0, ia, ib)))
        return a, b, tuple(shifts)

    def common_factor(self, a: Any, b: Any) -> tuple[Any, Any, tuple[Shift, ...]]:
        """The factor that scaled a and b share, for a + b = (v_a + v_b + r_a + r_b) F:
        elementwise where their names agree or one is an exact zero; elsewhere both are
        folded first. Same shapes."""
        zero_a, zero_b = ((t.value == 0) & (t.err == 0) for t in (a, b))
        differ = jnp.zeros(jnp.shape(a.value), bool)
        names = self.symbols([a, b])
        for k in names:
            (ca, ia), (cb, ib) = self.terms([a, b], k)
            differ = differ | (ca != cb) | ((ca != 0) & (ia != ib))
        differ = differ & ~zero_a & ~zero_b
        a, b = self.fold_where(a, differ), self.fold_where(b, differ)
        shifts = []
        for k in names:
            (ca, ia), (cb, ib) = self.terms([a, b], k)
            shifts.append(Shift(k, jnp.where(zero_a, cb, ca), jnp.where(zero_a, ib, ia)))
        return a, b, tuple(shifts)

    def uniform(self, t: Any, axes: tuple[int, ...], *, same_coef: bool) -> tuple[Any, tuple[Shift, ...]]:
        """Names of ``t`` reduced over ``axes`` (a sum, a dot's contraction): each unknown
        must be the same element along the axes (``same_coef``: with the same coefficient,
        a common factor of scaled terms; exact zeros of those do not count), and the
        coefficients of the reduced value are then the common one (scaled) or their sum
        (additive). Where that fails the terms of that output element are folded first.
        Returns (``t`` so folded, the reduced names in the reduced shape, axes dropped)."""
        ignored = ((t.value == 0) & (t.err == 0)) if t.scaled else jnp.zeros(jnp.shape(t.value), bool)

        def spans(x: jax.Array, active: jax.Array) -> tuple[jax.Array, jax.Array]:
            high = jnp.max(jnp.where(active, x, -jnp.inf), axis=axes, keepdims=True)
            low = jnp.min(jnp.where(active, x, jnp.inf), axis=axes, keepdims=True)
            return high, low

        split = jnp.zeros(jnp.shape(t.value), bool)
        for s in t.shifts:
            counted = ~ignored if same_coef else (s.coef != 0)
            high, low = spans(s.index.astype(F64), counted & (s.coef != 0))
            differ = high > low
            if same_coef:
                high_c, low_c = spans(s.coef, counted)
                differ = differ | (high_c > low_c)
            split = split | jnp.broadcast_to(differ, split.shape)
        t = self.fold_where(t, split)
        shifts = []
        for s in t.shifts:
            active = s.coef != 0
            if same_coef:
                coef = jnp.max(jnp.where(~ignored, s.coef, -jnp.inf), axis=axes)
                coef = jnp.where(jnp.isfinite(coef), coef, 0.0)
            else:
                coef = jnp.sum(s.coef, axis=axes)
            index = jnp.max(jnp.where(active, s.index, -1), axis=axes)
            shifts.append(Shift(s.symbol, coef, jnp.maximum(index, 0).astype(jnp.int32)))
        return t, tuple(shifts)
