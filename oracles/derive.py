"""Oracle and error bound derived from a jax.numpy reference, primitive by primitive.

The reference is traced to a jaxpr (``jax.make_jaxpr``) and evaluated once, in
float64 with float64 enabled in a scope only, carrying for every intermediate:

- ``value``: its exact value (float64; every cast and rounding of the reference is
  ignored, so the outputs are the float64 oracle);
- ``err``: a bound on |kernel's computed value - value|, elementwise, by Wilkinson's
  running error analysis on the actual inputs: each rule propagates its operands'
  errors through the primitive (rigorously where cheap: at the worst end of the
  interval [value - err, value + err]) and adds the primitive's own rounding in the
  dtype the facts say the kernel computes in (oracles/algebra.py's model: u|y| plus
  the underflow floor; reductions and dots gamma_k(u) times the sum of magnitudes,
  with k from oracles/tolerance.py's ``Accumulation``);
- ``bad``: unverifiable elements, as the label of the primitive that made them so
  (0: verifiable): a comparison whose operands are closer than their
  error bounds, a division, log, sqrt or rsqrt by a value within its own error, a
  float-to-int cast across an integer: the kernel may legitimately take the other
  branch there, so no bound exists. They propagate to every element that depends
  on them and are reported, never passed;
- ``dom``: which primitive contributes most to ``err`` (a label per element), so a
  failure can say what dominates the bound at the worst element;
- ``shifts``: the error of a computed max carried as a named unknown instead of in
  ``err`` (oracles/shifts.py), so that where the reference's exact arithmetic cancels
  it (a softmax's exp(s - m) / sum, its m + log(sum)) the bound cancels it too.

``Facts`` are what only the kernel's author knows: the dtype its intermediates are
computed in, the order of each reduction and dot, its transcendental accuracy.
Everything runs as whole-array jax.numpy float64 operations (no Python loop over
elements; ``scan``/``while`` loop over their static trip count), so it runs on the
device the arrays are on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from pallascheck.kernels.compat import float64_enabled
from pallascheck.oracles import algebra, numeric
from pallascheck.oracles.shifts import Shift, ShiftAlgebra
from pallascheck.oracles.tolerance import (
    SEQUENTIAL,
    Accumulation,
    Arithmetic,
    dtype_name,
    largest_finite,
    smallest_normal,
    unit_roundoff,
)

F64 = np.float64
INPUT = 0  # ``dom`` label of the inputs' own error (a subnormal flushed on read)


class UnsupportedPrimitive(NotImplementedError):
    """The reference uses a primitive the derivation has no error rule for."""


@dataclasses.dataclass(frozen=True)
class Facts:
    """How the kernel computes what the reference states.

    - ``compute_dtype``: the dtype every intermediate result is rounded to (what the
      kernel computes in, e.g. "float32" for a bf16 kernel that upcasts); None: each
      intermediate in the dtype the reference itself gives it (how ``jax.jit`` of the
      reference runs). An explicit cast in the reference to a narrower dtype (``p.astype(
      bf16)`` before a second matmul) is a rounding the kernel does too, either way.
    - ``order``: the order of every reduction, cumulative sum and dot's contraction
      (``SEQUENTIAL``: any order at all; ``blocked(b)``: sum blocks of b, then the
      block sums in a chain; ``PAIRWISE``); ``orders`` overrides it per primitive
      name ("dot_general", "reduce_sum", "cumsum", ...). A backend whose dot order is
      unknown (``Arithmetic.mma_order_known`` False: tensor cores) makes every dot
      sequential whatever is stated.
    - ``transcendental_ulps``: accuracy of exp, log, tanh, erf, logistic, sin, cos,
      rsqrt (approximate instructions: state their ulps); None: the backend's.
    - ``out_dtype``: the dtype the kernel stores its output in; None: the reference's
      output dtype.
    - ``dot_operands``: the dtype every dot's operands are cast to before the multiply
      ("inputs": the narrowest float input's, what a bf16 tensor-core kernel feeds its
      MMA, its backward's dz included); None: the operands as the reference has them.
    """

    compute_dtype: str | None = "float32"
    order: Accumulation = SEQUENTIAL
    orders: Mapping[str, Accumulation] | tuple = ()
    transcendental_ulps: float | None = None
    out_dtype: str | None = None
    dot_operands: str | None = None

    def __post_init__(self) -> None:
        # hashable and comparable; a saved config (JSON: dicts and lists) reads back
        object.__setattr__(self, "order", _accumulation(self.order))
        object.__setattr__(self, "orders", tuple(sorted((k, _accumulation(v)) for k, v in dict(self.orders).items())))
        for dtype in (self.compute_dtype, self.out_dtype, self.dot_operands):
            if dtype not in (None, "inputs"):
                unit_roundoff(dtype)  # an unknown dtype fails here, naming the choices
        for name, order in [("order", self.order), *self.orders]:
            if not isinstance(order, Accumulation):
                raise TypeError(
                    f"facts: {name} must be an Accumulation (SEQUENTIAL, PAIRWISE, blocked(b)), got {order!r}"
                )

    def order_of(self, primitive: str) -> Accumulation:
        return dict(self.orders).get(primitive, self.order)

    def __str__(self) -> str:
        return f"Facts({self.describe()})"

    def describe(self) -> str:
        pairs = cast(tuple[tuple[str, Accumulation], ...], self.orders)  # as __post_init__ left them
        orders = ", ".join(f"{k}={_order_name(v)}" for k, v in pairs)
        return (
            f"compute_dtype={self.compute_dtype or 'as in the reference'}, order={_order_name(self.order)}"
            + (f" ({orders})" if orders else "")
            + (f", transcendental_ulps={self.transcendental_ulps}" if self.transcendental_ulps is not None else "")
            + (f", out_dtype={self.out_dtype}" if self.out_dtype else "")
            + (f", dot_operands={self.dot_operands}" if self.dot_operands else "")
        )


def _accumulation(order: Any) -> Any:
    return Accumulation(**order) if isinstance(order, Mapping) else order


def _order_name(order: Accumulation) -> str:
    return f"blocked({order.block})" if order.order == "blocked" else order.order


@dataclasses.dataclass(frozen=True)
class Tracked:
    """One intermediate: exact value, error bound, unverifiable mask, dominant-rule label,
    and ``carried``: the narrowest dtype that holds the kernel's computed value."""

    value: jax.Array
    err: jax.Array
    bad: jax.Array  # int32: 0 where verifiable, else the label of the deciding primitive
    dom: jax.Array
    carried: str
    # named unknowns the computed value depends on (oracles/shifts.py): with them
    # computed = value + sum c delta + r ("additive") or (value + r) e^(sum c delta)
    # ("scaled"), |r| <= err; without them computed = value + r
    shifts: tuple[Shift, ...] = ()
    scaled: bool = False
    # a lower bound on the computed value where one is known besides value - err (a
    # sum of squares is never negative, whatever its error: var + eps >= eps); None: none
    low: jax.Array | None = None

    @property
    def is_float(self) -> bool:
        return jnp.issubdtype(self.value.dtype, jnp.floating)

    @property
    def magnitude(self) -> jax.Array:
        return jnp.abs(self.value) + self.err


@dataclasses.dataclass(frozen=True)
class Derived:
    """The derivation's outputs (numpy float64): per output the value (the oracle), the
    bound, the unverifiable mask and the label of the rule that dominates the bound."""

    values: tuple[np.ndarray, ...]
    bounds: tuple[np.ndarray, ...]
    unverifiable: tuple[np.ndarray, ...]
    dominant: tuple[np.ndarray, ...]
    before_store: tuple[np.ndarray, ...]  # the dominant label before the final store
    culprits: tuple[np.ndarray, ...]  # label of what made an element unverifiable (0: verifiable)
    sources: tuple[str, ...]  # label -> "primitive at file:line"

    def explain(self, output: int, index: tuple[int, ...]) -> str:
        """What makes the element at ``index`` unverifiable, else what dominates its
        bound, and before the store where that is it."""
        if self.unverifiable[output][index]:
            return self.sources[int(self.culprits[output][index])]
        final, inner = (self.sources[int(d[output][index])] for d in (self.dominant, self.before_store))
        return final if final == inner else f"{final}; before it, by {inner}"


def strategies_dtype(name: str) -> Any:
    """The jnp dtype of a dtype name ("bfloat16", "float32", ...)."""
    return jnp.dtype(name)


def _var_dtype(var: Any) -> np.dtype:
    return np.dtype(var.aval.dtype)


def _var_shape(var: Any) -> tuple[int, ...]:
    return tuple(var.aval.shape)


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _narrower(a: str, b: str) -> str:
    return a if unit_roundoff(a) >= unit_roundoff(b) else b


class _Evaluator(ShiftAlgebra):
    def __init__(self, facts: Facts, arith: Arithmetic):
        super().__init__()
        if facts.transcendental_ulps is not None:
            arith = dataclasses.replace(arith, transcendental_ulps=facts.transcendental_ulps)
        self.facts, self.arith = facts, arith
        self.narrowest_input = "float64"  # set by derive(): what Facts.dot_operands="inputs" means
        self.sources: list[str] = ["the inputs (a subnormal read as zero)"]
        self.labels: dict[int, int] = {}
        self.enclosing: list[Any] = []  # the call equations being evaluated, outermost first

    # ------------------------------------------------------------ helpers
    def label(self, eqn: Any) -> int:
        if id(eqn) not in self.labels:
            self.labels[id(eqn)] = len(self.sources)
            self.sources.append(f"{eqn.primitive.name} at {self.where(eqn)}")
        return self.labels[id(eqn)]

    def where(self, eqn: Any) -> str:
        """The source line of ``eqn``; a primitive inside a library function (jnp.cumsum's
        jit, erf's derivative) has none: the user's call that encloses it."""
        return next((w for w in (_where(e) for e in [eqn, *self.enclosing[::-1]]) if w), "the reference")

    def compute_dtype(self, var: Any) -> str:
        return self.facts.compute_dtype or dtype_name(_var_dtype(var))

    def floor(self, dtype: str) -> Any:
        """The underflow floor of one rounding, in the frame of the result being computed
        (``ShiftAlgebra.growing``)."""
        return algebra.underflow_floor(dtype, self.arith) * self.grow

    def rounding(self, magnitude: jax.Array, dtype: str) -> jax.Array:
        """One rounding, and never more than the result's own size: 0 is representable,
        so rounding to nearest, flushing to zero or truncating never moves a value
        further than 0 is (a p of 1e-38 rounded to f16 errs by 1e-38, not by f16's
        underflow floor 6e-5); a result bounded by 0 (0 * l of a fully masked row's empty
        sum) is exactly 0."""
        grown = algebra.underflow_floor(dtype, self.arith) * (self.grow - 1.0)
        charged = algebra.rounding(magnitude, dtype, self.arith) + grown
        return jnp.where(magnitude <= largest_finite(dtype), jnp.minimum(charged, magnitude), charged)

    def transcendental(self, dtype: str) -> float:
        return self.arith.transcendental_rel(_narrower(dtype, "float32"))

    def gamma(self, depth: Any, unit: float) -> jax.Array:
        return jnp.asarray(self.arith.gamma(depth, unit), dtype=F64)

    def finish(
        self,
        eqn: Any,
        var: Any,
        value: jax.Array,
        propagated: jax.Array,
        local: jax.Array,
        bad: jax.Array,
        inherited: jax.Array,
        carried: str | None = None,
        reach: Any = None,
    ) -> Tracked:
        """err = propagated + local; the label is this rule where its own rounding is the larger part.

        An infinite or NaN exact value (a -inf mask, exp of it) gets no error: the checks
        demand the kernel produce exactly it. Where the computed result, or a partial
        result on the way (``reach``: sum|terms| for a sum), may exceed the dtype's
        range, it may be infinite: no bound (err = inf), as where an operand had none."""
        shape = value.shape
        carried = carried or self.compute_dtype(var)
        finite = jnp.isfinite(value)
        propagated = jnp.where(finite, jnp.broadcast_to(jnp.asarray(propagated, F64), shape), 0.0)
        local = jnp.where(finite, jnp.broadcast_to(jnp.asarray(local, F64), shape), 0.0)
        err = propagated + local
        reach = jnp.abs(value) + err if reach is None else jnp.maximum(jnp.abs(value) + err, reach + err)
        # NaN: an operand's error was already unbounded (inf - inf at an overflowed operand)
        err = jnp.where(finite & ((reach > largest_finite(carried)) | jnp.isnan(err)), jnp.inf, err)
        dom = jnp.where(local >= propagated, self.label(eqn), jnp.broadcast_to(inherited, shape))
        return Tracked(value, err, jnp.broadcast_to(bad, shape).astype(jnp.int32), dom.astype(jnp.int32), carried)

    def as_dot_operand(self, eqn: Any, t: Tracked) -> Tracked:
        """``t`` cast to ``Facts.dot_operands`` where it is held in a wider dtype."""
        named: dict[str | None, str | None] = {"inputs": self.narrowest_input}
        dtype = named.get(self.facts.dot_operands, self.facts.dot_operands)
        if dtype is None or not t.is_float or unit_roundoff(dtype) <= unit_roundoff(t.carried):
            return t
        return dataclasses.replace(t, err=t.err + self.rounding_of(t, dtype), carried=dtype)

    def rounding_of(self, t: Tracked, dtype: str) -> jax.Array:
        """The rounding of ``t`` to ``dtype``: none where its value is exact (no error,
        no name) and representable there (a bf16 cotangent scattered into an f32 buffer)."""
        kept = (t.err == 0) & self.unnamed(t) & (t.value.astype(strategies_dtype(dtype)).astype(F64) == t.value)
        with self.growing(self.spread(t) if t.scaled else 0.0):
            return jnp.where(kept, 0.0, self.rounding(self.reach(t), dtype))

    def lower(self, t: Tracked) -> jax.Array:
        """The least value the kernel's computed ``t`` can take."""
        f = self.folded(t)
        base = f.value - f.err
        return base if t.low is None else jnp.maximum(base, t.low)

    def at_least(self, t: Tracked, low: jax.Array) -> Tracked:
        """``t`` known to be computed no lower than ``low`` (-inf: nothing known)."""
        low = jnp.broadcast_to(low, jnp.shape(t.value))
        return dataclasses.replace(t, low=low) if bool(jnp.any(jnp.isfinite(low))) else t

    def shifted(self, t: Tracked, shifts: Sequence[Shift], scaled: bool) -> Tracked:
        """``t`` (its error r in the frame of ``shifts``) with those names; unbounded where
        the computed value, with its factor or its named part, may overflow."""
        t = self.normalised(dataclasses.replace(t, shifts=tuple(shifts), scaled=scaled))
        if not t.shifts:
            return t
        d = self.spread(t)
        reach = t.magnitude * jnp.exp(d) if t.scaled else t.magnitude + d
        over = jnp.isfinite(t.value) & (reach > largest_finite(t.carried))
        return self.normalised(dataclasses.replace(t, err=jnp.where(over, jnp.inf, t.err)))

    def rounded_once(
        self, eqn: Any, value: jax.Array, propagated: jax.Array, bad: jax.Array, inherited: jax.Array
    ) -> Tracked:
        """The operands' propagated error plus one rounding of the result (add, mul, div)."""
        dtype = self.compute_dtype(eqn.outvars[0])
        local = self.rounding(jnp.abs(value) + propagated, dtype)
        return self.finish(eqn, eqn.outvars[0], value, propagated, local, bad, inherited)

    def flag(self, eqn: Any, bad: jax.Array, culprit: jax.Array) -> jax.Array:
        """``bad`` with this equation's label where it makes elements unverifiable."""
        return jnp.where(culprit & (bad == 0), self.label(eqn), bad).astype(jnp.int32)

    @staticmethod
    def inherit(ins: Sequence[Tracked], shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
        """(OR of the operands' unverifiable masks, label of the operand with the largest error)."""
        bad = jnp.zeros(shape, jnp.int32)
        best_err, best_dom = jnp.full(shape, -1.0, F64), jnp.zeros(shape, jnp.int32)
        for t in ins:
            bad = jnp.maximum(bad, jnp.broadcast_to(t.bad, shape))
            err = jnp.broadcast_to(t.err, shape)
            best_dom = jnp.where(err > best_err, jnp.broadcast_to(t.dom, shape), best_dom)
            best_err = jnp.maximum(err, best_err)
        return bad, best_dom

    # ------------------------------------------------------------ evaluation
    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Tracked]) -> list[Tracked]:
        if isinstance(jaxpr, jcore.ClosedJaxpr):
            jaxpr, consts = jaxpr.jaxpr, list(jaxpr.consts) + list(consts)
        env: dict[Any, Tracked] = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = self.exact(c, dtype_name(_var_dtype(var)) if _is_float(_var_dtype(var)) else "float64")
        for var, a in zip(jaxpr.invars, args):
            env[var] = a

        def read(v: Any) -> Tracked:
            return self.literal(v) if isinstance(v, jcore.Literal) else env[v]

        for eqn in _live(jaxpr):
            outs = self.eqn(eqn, [read(v) for v in eqn.invars])
            for var, out in zip(eqn.outvars, outs):
                if not isinstance(var, jcore.DropVar):
                    env[var] = out
        return [read(v) for v in jaxpr.outvars]

    def literal(self, v: Any) -> Tracked:
        """A constant of the reference. Traced on bf16/f16 inputs, a Python float such as
        0.01 arrives rounded to that dtype, while a kernel holds it in f32: a constant
        that is not an integer carries (u_dtype + u_f32)|c|, the gap between the two."""
        dt = np.dtype(v.aval.dtype)
        if not _is_float(dt):
            return self.exact(v.val, "float64")
        t = self.exact(v.val, dtype_name(dt))
        if unit_roundoff(dt) > unit_roundoff("float32"):
            gap = (unit_roundoff(dt) + unit_roundoff("float32")) * jnp.abs(t.value)
            t = dataclasses.replace(t, err=jnp.where(t.value == jnp.round(t.value), 0.0, gap))
        return t

    def exact(self, value: Any, carried: str) -> Tracked:
        value = jnp.asarray(value)
        if _is_float(value.dtype):
            value = value.astype(F64)
        zeros = jnp.zeros(value.shape, F64)
        return Tracked(value, zeros, jnp.zeros(value.shape, jnp.int32), jnp.zeros(value.shape, jnp.int32), carried)

    def eqn(self, eqn: Any, ins: list[Tracked]) -> list[Tracked]:
        name = eqn.primitive.name
        sub = _subjaxpr(eqn)
        if sub is None and name not in _KEEPS_NAMES and any(t.shifts for t in ins):
            ins = [self.folded(t) for t in ins]  # a rule with no identity for named errors
        if name in _RULES:
            out = _RULES[name](self, eqn, ins)
            return out if isinstance(out, list) else [out]
        if name in _STRUCTURAL:
            return self.structural(eqn, ins)
        if name == "scan":
            return self.scan(eqn, ins)
        if name == "while":
            return self.while_loop(eqn, ins)
        if name == "cond":
            return self.cond(eqn, ins)
        if sub is not None:  # jit/pjit, closed_call, remat, custom_jvp_call, custom_vjp_call
            self.enclosing.append(eqn)
            try:
                return self.run(sub, [], ins)
            finally:
                self.enclosing.pop()
        raise UnsupportedPrimitive(
            f"the reference uses primitive {name!r} ({self.where(eqn)}), "
            f"which has no error rule; supported: {sorted(supported_primitives())}"
        )

    def structural(self, eqn: Any, ins: list[Tracked]) -> list[Tracked]:
        """Shape ops move elements without arithmetic: apply the primitive itself to the
        value, the error, the mask and the labels (index operands keep their values)."""
        data = _STRUCTURAL[eqn.primitive.name]
        is_data = [data is None or i in data for i in range(len(ins))]
        params = dict(eqn.params)
        if "preferred_element_type" in params:
            params["preferred_element_type"] = None
        named = [t for t, d in zip(ins, is_data) if d and t.shifts]
        if named and (eqn.primitive.name not in _MOVES_NAMES or len({t.scaled for t in named}) > 1):
            ins = [self.folded(t) for t in ins]
            named = []

        def apply(field: Any) -> Any:
            get = field if callable(field) else (lambda t: getattr(t, field))
            args = [get(t) if d else t.value for t, d in zip(ins, is_data)]
            return eqn.primitive.bind(*args, **params)

        value, err, bad, dom = (apply(f) for f in ("value", "err", "bad", "dom"))
        multiple = eqn.primitive.multiple_results
        values, errs, bads, doms = (list(x) if multiple else [x] for x in (value, err, bad, dom))
        carried = [t.carried for t, d in zip(ins, is_data) if d and t.is_float]
        widest = min(carried, key=unit_roundoff) if carried else "float64"
        outs = [Tracked(v, e, b, d, widest) for v, e, b, d in zip(values, errs, bads, doms)]
        if any(t.low is not None for t, d in zip(ins, is_data) if d):  # known lower bounds move too
            lows = apply(self.lower)
            outs = [self.at_least(o, low) for o, low in zip(outs, lows if multiple else [lows])]
        if not named:
            return outs
        # the names move with the elements: the op applied to every coefficient and index
        shifts = tuple(
            Shift(k, apply(lambda t, k=k: self.terms([t], k)[0][0]), apply(lambda t, k=k: self.terms([t], k)[0][1]))
            for k in self.symbols(named)
        )
        return [self.normalised(dataclasses.replace(outs[0], shifts=shifts, scaled=named[0].scaled))]

    def scan(self, eqn: Any, ins: list[Tracked]) -> list[Tracked]:
        p = eqn.params
        n_consts, n_carry, length = *_scan_counts(p), p["length"]
        consts, carry, xs = ins[:n_consts], ins[n_consts : n_consts + n_carry], ins[n_consts + n_carry :]
        xs = [self.folded(x) for x in xs]  # sliced and stacked without their names
        ys: list[list[Tracked]] = []
        steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
        for i in steps:
            outs = self.run(p["jaxpr"], [], consts + carry + [_index(x, i) for x in xs])
            carry, y = outs[:n_carry], outs[n_carry:]
            ys.append([self.folded(t) for t in y])
        if p["reverse"]:
            ys.reverse()
        stacked = (
            [_stack([y[j] for y in ys]) for j in range(len(ys[0]))]
            if ys
            else [self.exact(jnp.zeros(v.aval.shape, v.aval.dtype), "float64") for v in eqn.outvars[n_carry:]]
        )
        return carry + stacked

    def while_loop(self, eqn: Any, ins: list[Tracked]) -> list[Tracked]:
        """A loop with a trip count the values decide (static in practice: a counter)."""
        p = eqn.params
        cond_consts, body_consts = (
            ins[: p["cond_nconsts"]],
            ins[p["cond_nconsts"] : p["cond_nconsts"] + p["body_nconsts"]],
        )
        carry = ins[p["cond_nconsts"] + p["body_nconsts"] :]
        for _ in range(1_000_000):
            (go,) = self.run(p["cond_jaxpr"], [], cond_consts + carry)
            if int(go.bad):
                raise UnsupportedPrimitive(
                    "while: the loop condition depends on a value within its error bound; "
                    "write the loop with a static trip count (lax.fori_loop with int bounds)"
                )
            if not bool(go.value):
                return carry
            carry = self.run(p["body_jaxpr"], [], body_consts + carry)
        raise UnsupportedPrimitive("while: more than 1e6 iterations; the derivation needs a static trip count")

    def cond(self, eqn: Any, ins: list[Tracked]) -> list[Tracked]:
        index, operands = ins[0], ins[1:]
        branch = eqn.params["branches"][int(jnp.clip(index.value, 0, len(eqn.params["branches"]) - 1))]
        outs = self.run(branch, [], operands)
        return [dataclasses.replace(o, bad=jnp.maximum(o.bad, index.bad)) for o in outs]


def _where(eqn: Any) -> str:
    """ "file:line (function)" of an equation's source, for messages."""
    if eqn.source_info is None:
        return "the end of the reference"
    from jax._src import (
        source_info_util,  # no public API names an equation's source line
    )

    return source_info_util.summarize(eqn.source_info)


def _scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
    """(constants, carries) of a scan: named counts up to jax 0.11, the groups of the
    flat tree ``ft_in`` (constants, carries, scanned) after."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))


def _subjaxpr(eqn: Any) -> Any:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params and isinstance(eqn.params[key], (jcore.Jaxpr, jcore.ClosedJaxpr)):
            return eqn.params[key]
    return None


def _live(jaxpr: Any) -> list[Any]:
    """The equations an output depends on (a VJP's jaxpr holds dead branches, e.g. the
    tie-count of a max's derivative; their comparisons must not flag anything)."""
    live = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in live for v in eqn.outvars if not isinstance(v, jcore.DropVar)):
            kept.append(eqn)
            live.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    return kept[::-1]


def _index(t: Tracked, i: int) -> Tracked:
    return Tracked(t.value[i], t.err[i], t.bad[i], t.dom[i], t.carried)


def _stack(ts: Sequence[Tracked]) -> Tracked:
    return Tracked(
        jnp.stack([t.value for t in ts]),
        jnp.stack([t.err for t in ts]),
        jnp.stack([t.bad for t in ts]),
        jnp.stack([t.dom for t in ts]),
        ts[0].carried,
    )


# Shape ops that move elements one to one (or pad with a constant): a value's names move with it.
_MOVES_NAMES = {
    "broadcast_in_dim",
    "reshape",
    "transpose",
    "squeeze",
    "expand_dims",
    "slice",
    "rev",
    "concatenate",
    "pad",
    "copy",
    "copy_p",
    "dynamic_slice",
}
# Rules that carry named errors (oracles/shifts.py) through; every other rule sees them folded.
_KEEPS_NAMES = {
    "add",
    "sub",
    "add_any",
    "mul",
    "div",
    "neg",
    "stop_gradient",
    "exp",
    "exp2",
    "log",
    "reduce_sum",
    "dot_general",
    "convert_element_type",
    "select_n",
    "max",
    "min",
    "reduce_max",
    "reduce_min",
    "scan",
    "while",
    "cond",
    *_MOVES_NAMES,
}

# Shape ops: the operand positions that are data (None: all); the rest are indices.
_STRUCTURAL: dict[str, tuple[int, ...] | None] = {
    "broadcast_in_dim": (0,),
    "reshape": (0,),
    "transpose": None,
    "squeeze": None,
    "expand_dims": None,
    "slice": None,
    "rev": None,
    "concatenate": None,
    "pad": None,
    "copy": None,
    "copy_p": None,
    "dynamic_slice": (0,),
    "dynamic_update_slice": (0, 1),
    "gather": (0,),
    "split": None,
    "tile": None,
    "stack": None,
}


# ------------------------------------------------------------------------ rules
Rule = Callable[[_Evaluator, Any, list[Tracked]], "Tracked | list[Tracked]"]
OneRule = Callable[[_Evaluator, Any, list[Tracked]], Tracked]  # a rule of one output
_RULES: dict[str, Rule] = {}
_R = TypeVar("_R", bound=Rule)


def rule(*names: str) -> Callable[[_R], _R]:
    def register(fn: _R) -> _R:
        for n in names:
            _RULES[n] = fn
        return fn

    return register


def supported_primitives() -> set[str]:
    return (
        set(_RULES)
        | set(_STRUCTURAL)
        | {
            "scan",
            "while",
            "cond",
            "jit",
            "pjit",
            "closed_call",
            "core_call",
            "remat",
            "checkpoint",
            "custom_jvp_call",
            "custom_vjp_call",
            "custom_vjp_call_jaxpr",
        }
    )


def _value(eqn: Any, *values: Any) -> jax.Array:
    """The primitive on float64 values: dtype parameters that would round are dropped."""
    params = dict(eqn.params)
    for key in ("preferred_element_type",):
        if key in params and params[key] is not None and _is_float(params[key]):
            params[key] = F64
    if "precision" in params:
        params["precision"] = None
    return eqn.primitive.bind(*values, **params)


def _exact_op(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """Integer/boolean arithmetic and float ops without rounding (neg, abs): the error
    passes unchanged (|-(x+d) - (-x)| = |d|, ||x+d| - |x|| <= |d|)."""
    value = _value(eqn, *[t.value for t in ins])
    if "axes" in eqn.params:  # an integer reduce_sum: an output inherits the masks of the elements it sums
        (x,) = ins
        bad = jnp.max(jnp.broadcast_to(x.bad, x.value.shape), axis=tuple(eqn.params["axes"]))
        return Tracked(value, jnp.zeros(value.shape, F64), bad, jnp.zeros(value.shape, jnp.int32), "float64")
    bad, dom = ev.inherit(ins, value.shape)
    if not _is_float(value.dtype):
        return Tracked(value, jnp.zeros(value.shape, F64), bad, dom, "float64")
    if not ins:  # iota: exact integers in a float dtype
        return ev.exact(value, dtype_name(_var_dtype(eqn.outvars[0])))
    err = cast(jax.Array, sum(jnp.broadcast_to(t.err, value.shape) for t in ins))  # ins is not empty
    return Tracked(value.astype(F64), err, bad, dom, ins[0].carried)


rule(
    "abs",
    "not",
    "and",
    "or",
    "xor",
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "iota",
    "population_count",
    "clz",
    "is_finite",
    "imag",
    "real",
)(_exact_op)


@rule("stop_gradient")
def _stop_gradient(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """The identity (jax.nn.softmax's max goes through it, names and all)."""
    return ins[0]


@rule("neg")
def _neg(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """Exact: -(v + c d + r) negates an additive value's coefficients, -(v + r) F keeps
    a scaled value's factor."""
    (x,) = ins
    out = _exact_op(ev, eqn, ins)
    if not x.shifts:
        return out
    sign = 1.0 if x.scaled else -1.0
    return ev.shifted(out, tuple(Shift(s.symbol, sign * s.coef, s.index) for s in x.shifts), x.scaled)


def _int_or_exact(fn: OneRule) -> OneRule:
    """Integer arithmetic (index computations) is exact; floats go to ``fn``."""

    def wrapped(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
        if not _is_float(_var_dtype(eqn.outvars[0])):
            return _exact_op(ev, eqn, ins)
        return fn(ev, eqn, ins)

    return wrapped


@rule("add", "sub", "add_any")
@_int_or_exact
def _add(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """Errors add, plus one rounding, except where the result is exact: an operand
    that is exactly 0 (a running sum's first term), or two exact operands of the same
    sign (for a sub; opposite for an add) within a factor 2 of each other (Sterbenz's
    lemma: z - max(z) of input logits). Named errors: additive operands' coefficients
    add (m + log l: the max's unknown cancels); scaled operands with one factor share it,
    (v_a + r_a) F + (v_b + r_b) F = (v_a + v_b + r_a + r_b) F."""
    a, b = ins
    value = _value(eqn, a.value, b.value)
    shifts: tuple[Shift, ...] = ()
    scaled = False
    if a.shifts or b.shifts:
        a, b = (ev.broadcast(t, value.shape) for t in (a, b))
        if a.shifts and b.shifts and a.scaled != b.scaled:  # a factor and a named sum: no common form
            a, b = (ev.folded(t) if t.scaled else t for t in (a, b))
        scaled = a.scaled or b.scaled
        sign = -1.0 if eqn.primitive.name == "sub" else 1.0
        a, b, shifts = ev.common_factor(a, b) if scaled else ev.added(a, b, sign)
    spread = ev.spread_of(shifts, value.shape)
    dtype = ev.compute_dtype(eqn.outvars[0])

    def exact(t: Tracked) -> jax.Array:  # folded: a name makes an operand inexact
        held = t.value.astype(strategies_dtype(dtype)).astype(F64) == t.value
        return (t.err == 0) & held & jnp.isfinite(t.value)

    fa, fb = ev.folded(a), ev.folded(b)
    zero = ((fa.value == 0) & (fa.err == 0)) | ((fb.value == 0) & (fb.err == 0))
    x, y = jnp.abs(a.value), jnp.abs(b.value)
    same_sign = jnp.sign(a.value) == (jnp.sign(b.value) if eqn.primitive.name == "sub" else -jnp.sign(b.value))
    sterbenz = exact(fa) & exact(fb) & same_sign & (x <= 2.0 * y) & (y <= 2.0 * x)
    propagated = a.err + b.err
    with ev.growing(spread if scaled else 0.0):
        local = ev.rounding(jnp.abs(value) + propagated + (0.0 if scaled else spread), dtype)
    out = ev.finish(
        eqn, eqn.outvars[0], value, propagated, jnp.where(zero | sterbenz, 0.0, local), *ev.inherit(ins, value.shape)
    )
    if eqn.primitive.name != "sub" and any(t.low is not None for t in ins):
        # rounding is monotone: fl(a^ + b^) >= fl(low_a + low_b) >= s - (u|s| + floor)
        s = ev.lower(ins[0]) + ev.lower(ins[1])
        out = ev.at_least(out, jnp.where(jnp.isfinite(s), s - ev.rounding(jnp.abs(s), dtype), -jnp.inf))
    return ev.shifted(out, shifts, scaled)


@rule("mul")
@_int_or_exact
def _mul(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """|a^ b^ - ab| <= |a| eb + |b| ea + ea eb, then one rounding. Named errors: an
    additive operand times an exact one scales its coefficients (c1 (m - t)); scaled
    operands multiply their factors (alpha l: e^(d_old - d_new) e^(-d_old))."""
    a, b = ins
    value = a.value * b.value
    shifts: tuple[Shift, ...] = ()
    scaled = False
    if a.shifts or b.shifts:
        a, b = (ev.broadcast(t, value.shape) for t in (a, b))
        if (a.shifts and not a.scaled) or (b.shifts and not b.scaled):
            first = bool(a.shifts) and not a.scaled
            x, k = (a, b) if first else (b, a)
            k = ev.folded(k)
            x = ev.fold_where(x, k.err > 0)  # (v + c d + r)(k + e): no name survives an inexact factor
            shifts = tuple(Shift(s.symbol, s.coef * k.value, s.index) for s in x.shifts)
            a, b = (x, k) if first else (k, x)
        else:
            a, b, shifts = ev.added(a, b, 1.0)
            scaled = True
    spread = ev.spread_of(shifts, value.shape)
    propagated = (
        algebra.times(jnp.abs(a.value), b.err) + algebra.times(jnp.abs(b.value), a.err) + algebra.times(a.err, b.err)
    )
    dtype = ev.compute_dtype(eqn.outvars[0])
    with ev.growing(spread if scaled else 0.0):
        local = ev.rounding(jnp.abs(value) + propagated + (0.0 if scaled else spread), dtype)
    out = ev.finish(eqn, eqn.outvars[0], value, propagated, local, *ev.inherit(ins, value.shape))
    # a computed square, or a product of factors computed nonnegative, is never negative
    square = eqn.invars[0] is eqn.invars[1] and not isinstance(eqn.invars[0], jcore.Literal)
    if square or any(t.low is not None for t in ins):
        nonnegative = square | ((ev.lower(ins[0]) >= 0) & (ev.lower(ins[1]) >= 0))
        out = ev.at_least(out, jnp.where(nonnegative, 0.0, -jnp.inf))
    return ev.shifted(out, shifts, scaled)


@rule("div")
@_int_or_exact
def _div(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """|a^/b^ - a/b| <= (ea + |a/b| eb) / (|b| - eb); unverifiable where b^ may be 0.
    XLA divides by a constant as a product with its rounded reciprocal (x / 3 is
    x * fl(1/3), measured on XLA:CPU): where the divisor is exact and its reciprocal
    not representable, the reciprocal's rounding adds |a^| (u |1/b| + floor) before the
    product's rounding. Named errors: an additive numerator over an exact divisor
    divides its coefficients (sd / V); scaled operands divide their factors (acc / l:
    both e^(-d), the quotient has none)."""
    a, b = ins
    value = a.value / b.value  # a zero divisor: the infinity or NaN the kernel must reproduce
    shifts: tuple[Shift, ...] = ()
    scaled = False
    if a.shifts or b.shifts:
        a, b = (ev.broadcast(t, value.shape) for t in (a, b))
        if b.shifts and not b.scaled:
            b = ev.folded(b)
        if a.shifts and not a.scaled:
            b = ev.folded(b)
            a = ev.fold_where(a, b.err > 0)
            shifts = tuple(Shift(s.symbol, s.coef / b.value, s.index) for s in a.shifts)
        else:
            a, b, shifts = ev.added(a, b, -1.0)
            scaled = True
    spread = ev.spread_of(shifts, value.shape)
    dtype = ev.compute_dtype(eqn.outvars[0])
    room = jnp.abs(b.value) - b.err
    if ins[1].low is not None:  # a divisor computed at least low > 0 is at least that far from 0
        least = jnp.where(ev.unnamed(b), jnp.broadcast_to(ev.lower(ins[1]), room.shape), -jnp.inf)
        room = jnp.where(least > 0, jnp.maximum(room, least), room)
    ok = room > 0
    quotient = jnp.abs(a.value / jnp.where(ok, b.value, 1.0))
    propagated = jnp.where(ok, (a.err + algebra.times(quotient, b.err)) / jnp.where(ok, room, 1.0), jnp.inf)
    propagated = jnp.where((b.err == 0) & (a.err == 0), 0.0, propagated)
    nonzero = (b.value != 0) & jnp.isfinite(b.value)
    recip = 1.0 / jnp.where(nonzero, b.value, 1.0)
    rounded = (b.err == 0) & nonzero & (recip.astype(strategies_dtype(dtype)).astype(F64) != recip)
    recip_err = jnp.where(rounded, ev.rounding(jnp.abs(recip), dtype), 0.0)
    propagated = propagated + algebra.times(a.magnitude if scaled else ev.reach(a), recip_err)
    bad, dom = ev.inherit(ins, value.shape)
    bad = ev.flag(eqn, bad, ~ok & (b.err > 0))
    propagated = jnp.where(bad > 0, 0.0, propagated)
    with ev.growing(spread if scaled else 0.0):
        local = ev.rounding(jnp.abs(value) + propagated + (0.0 if scaled else spread), dtype)
    out = ev.finish(eqn, eqn.outvars[0], value, propagated, local, bad, dom)
    if any(t.low is not None for t in ins):
        out = ev.at_least(out, jnp.where((ev.lower(ins[0]) >= 0) & (ev.lower(ins[1]) > 0), 0.0, -jnp.inf))
    return ev.shifted(out, shifts, scaled)


@rule("max", "min")
@_int_or_exact
def _max(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """max and min are 1-Lipschitz in each operand jointly: the larger error; no rounding.
    Of a named operand (a running max, max(m_old, max(tile))) the result's error is
    named anew (oracles/shifts.py)."""
    named = any(t.shifts for t in ins)
    ins = [ev.folded(t) for t in ins]
    value = _value(eqn, *[t.value for t in ins])
    bad, dom = ev.inherit(ins, value.shape)
    err = jnp.maximum(*[jnp.broadcast_to(t.err, value.shape) for t in ins])
    out = Tracked(value, err, bad, dom, min((t.carried for t in ins), key=unit_roundoff))
    return ev.named(out) if named else out


@rule("clamp")
def _clamp(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    value = _value(eqn, *[t.value for t in ins])
    bad, dom = ev.inherit(ins, value.shape)
    err = _elementwise_max([jnp.broadcast_to(t.err, value.shape) for t in ins])
    return Tracked(value, err, bad, dom, ins[1].carried)


def _elementwise_max(arrays: Sequence[jax.Array]) -> jax.Array:
    out = arrays[0]
    for a in arrays[1:]:
        out = jnp.maximum(out, a)
    return out


def _elementwise_min(arrays: Sequence[jax.Array]) -> jax.Array:
    out = arrays[0]
    for a in arrays[1:]:
        out = jnp.minimum(out, a)
    return out


def _unary(
    fn: Callable[..., tuple[jax.Array, jax.Array, jax.Array]], transcendental: bool = True, bounded_below: bool = False
) -> OneRule:
    """A unary float function. ``fn(x, err, value)`` (``bounded_below``: ``fn(x, err,
    value, low)``, low the least computed operand, ``_Evaluator.lower``) returns
    (propagated error, relative size the evaluation error scales with, unverifiable mask)."""

    def apply(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
        (x,) = ins
        value = _value(eqn, x.value)
        extra = (ev.lower(x),) if bounded_below else ()
        with np.errstate(all="ignore"):
            propagated, scale, bad_here = fn(x.value, x.err, value, *extra)
        dtype = ev.compute_dtype(eqn.outvars[0])
        bad, dom = ev.flag(eqn, x.bad, bad_here), x.dom
        propagated = jnp.where(bad_here, 0.0, propagated)
        if transcendental:
            local = ev.transcendental(dtype) * (scale + propagated) + ev.floor(dtype)
            local = jnp.where((jnp.abs(value) + propagated) * ev.grow <= largest_finite(dtype), local, jnp.inf)
            # at an exact infinity every implementation returns the function's limit
            # (exp(-inf) = 0 of a masked logit): no rounding, no underflow floor
            local = jnp.where(jnp.isinf(x.value) & (x.err == 0), 0.0, local)
        else:
            local = ev.rounding(scale + propagated, dtype)
        return ev.finish(eqn, eqn.outvars[0], value, propagated, local, bad, dom)

    return apply


def _no(x: jax.Array) -> jax.Array:
    return jnp.zeros(x.shape, bool)


def _exp_rule(scale: float) -> Callable[..., tuple]:
    """e^(s(x+d)) - e^(sx) = e^(sx) expm1(s d): relative expm1(s|d|); where e^(sx)
    underflowed and expm1 overflowed, the gap itself."""

    def fn(x, e, v):
        grow = jnp.abs(v) * jnp.expm1(scale * e)
        grow = jnp.where(jnp.isnan(grow), jnp.exp(scale * (x + e)) - jnp.abs(v), grow)
        return grow, jnp.abs(v), _no(x)

    return fn


def _log_rule(shift: float) -> Callable[..., tuple]:
    """log is increasing and concave: over [x - e, x + e] it errs most at the low end,
    -log1p(-e / (shift + x)); unverifiable where the low end reaches 0. A known lower
    bound of the operand raises the low end (then the high end may be the worse one)."""

    def fn(x, e, v, low):
        base = shift + x
        gap = jnp.minimum(e, x - low)  # how far below x the computed operand can be
        ok = base - gap > 0
        safe = jnp.where(ok & (base > 0), base, 1.0)
        grow = jnp.maximum(-jnp.log1p(-gap / safe), jnp.log1p(e / safe))
        return jnp.where(e == 0, 0.0, grow), jnp.abs(v), ~ok & (e > 0)

    return fn


def _slope_at_nearest(deriv: Callable[[jax.Array], jax.Array]) -> Callable[..., tuple]:
    """For f whose |f'| decreases in |x| (tanh, logistic, erf): |f(x+d) - f(x)| <=
    |d| max|f'| over the interval = |d| |f'(max(|x| - e, 0))|."""

    def fn(x, e, v):
        return e * jnp.abs(deriv(jnp.maximum(jnp.abs(x) - e, 0.0))), jnp.abs(v), _no(x)

    return fn


def _sqrt(x, e, v, low):
    """sqrt increases and is concave: the worse end is the low one, max(x - e, a known
    lower bound); unverifiable where that is negative."""
    low = jnp.maximum(x - e, low)
    ok = (low >= 0) | (e == 0)
    return jnp.maximum(v - jnp.sqrt(jnp.maximum(low, 0.0)), jnp.sqrt(x + e) - v), jnp.abs(v), ~ok


def _rsqrt(x, e, v, low):
    """rsqrt decreases and is convex: the worse end is the low one, max(x - e, a known
    lower bound: rsqrt(var + eps) with var a sum of squares); unverifiable where it
    reaches 0."""
    low = jnp.maximum(x - e, low)
    ok = (low > 0) | ((e == 0) & (x > 0))
    worst = lax.rsqrt(jnp.where(low > 0, low, 1.0))
    best = lax.rsqrt(jnp.where(ok, x + e, 1.0))
    propagated = jnp.where(e == 0, 0.0, jnp.maximum(worst - v, v - best))
    return propagated, jnp.where(ok, jnp.maximum(worst, jnp.abs(v)), jnp.abs(v)), ~ok & (e > 0)


def _sin_cos(x, e, v):
    """1-Lipschitz and bounded by 1: min(e, 2)."""
    return jnp.minimum(e, 2.0), jnp.abs(v), _no(x)


def _exp_of_named(scale: float, plain: OneRule) -> OneRule:
    """exp(s (v + c d + r)) = exp(s (v + r)) e^(s c d): an additive operand's names become
    the result's factor, and the rule's own error (on v, r) is charged in its frame."""

    def apply(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
        (x,) = ins
        if not x.shifts or x.scaled:
            return plain(ev, eqn, [ev.folded(x)])
        shifts = tuple(Shift(s.symbol, scale * s.coef, s.index) for s in x.shifts)
        with ev.growing(ev.spread_of(shifts, x.value.shape)):
            out = plain(ev, eqn, [x])
        return ev.shifted(out, shifts, True)

    return apply


def _log_of_named(plain: OneRule) -> OneRule:
    """log((v + r) F) = log(v + r) + log F: a scaled operand's factor becomes the result's
    additive names (log l, l carrying e^(-d), carries -d); the evaluation's relative error
    applies to the whole computed log, at most |log(v + r)| + D."""

    def apply(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
        (x,) = ins
        if not x.shifts or not x.scaled:
            return plain(ev, eqn, [ev.folded(x)])
        out = plain(ev, eqn, [x])
        extra = ev.transcendental(ev.compute_dtype(eqn.outvars[0])) * ev.spread(x)
        out = dataclasses.replace(out, err=out.err + jnp.where(jnp.isfinite(out.value), extra, 0.0))
        return ev.shifted(out, x.shifts, False)

    return apply


rule("exp")(_exp_of_named(1.0, _unary(_exp_rule(1.0))))
rule("exp2")(_exp_of_named(math.log(2.0), _unary(_exp_rule(math.log(2.0)))))
rule("expm1")(_unary(lambda x, e, v: (jnp.exp(x) * jnp.expm1(e), jnp.abs(v), _no(x))))
rule("log")(_log_of_named(_unary(_log_rule(0.0), bounded_below=True)))
rule("log1p")(_unary(_log_rule(1.0), bounded_below=True))
rule("tanh")(_unary(_slope_at_nearest(lambda t: 1.0 - jnp.tanh(t) ** 2)))
rule("logistic")(_unary(_slope_at_nearest(lambda t: jax.nn.sigmoid(t) * jax.nn.sigmoid(-t))))
rule("erf")(_unary(_slope_at_nearest(lambda t: 2.0 / math.sqrt(math.pi) * jnp.exp(-t * t))))
rule("sqrt")(_unary(_sqrt, bounded_below=True))
rule("rsqrt")(_unary(_rsqrt, bounded_below=True))
rule("sin", "cos")(_unary(_sin_cos))


@rule("sign", "floor", "ceil", "round")
def _step(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """Exact, except where a jump lies within the operand's error: there the kernel may
    land on either side (a rounding near-tie), and each of the four is nondecreasing, so
    its value lies between f(x - e) and f(x + e): the error is the larger step to either
    side, charged to this equation. Unverifiable only where the error is unbounded."""
    (x,) = ins
    value = _value(eqn, x.value)
    below, above = _value(eqn, x.value - x.err), _value(eqn, x.value + x.err)
    jumps = below != above
    err = jnp.where(jumps, jnp.maximum(above - value, value - below), 0.0)
    unbounded = jumps & ~jnp.isfinite(err)
    err = jnp.where(unbounded, 0.0, err)
    dom = jnp.where(jumps, ev.label(eqn), x.dom).astype(x.dom.dtype)
    return Tracked(value, err, ev.flag(eqn, x.bad, unbounded), dom, x.carried)


@rule("integer_pow", "square")
def _integer_pow(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """x^n by repeated multiplication: ||x^|+e|^n - |x|^n| <= (|x|+e)^n - |x|^n, plus
    gamma_k(u) (|x|+e)^n for its k = bit_length(n) - 1 + popcount(n) - 1 products;
    a negative power is then a reciprocal (the ``div`` rule)."""
    (x,) = ins
    n = eqn.params.get("y", 2)
    m = abs(n)
    dtype = ev.compute_dtype(eqn.outvars[0])
    power = jnp.abs(x.value) ** m
    propagated = x.magnitude**m - power
    k = max(m.bit_length() - 1 + bin(m).count("1") - 1, 1)
    local = ev.gamma(k, unit_roundoff(dtype)) * x.magnitude**m + k * ev.floor(dtype)
    positive = ev.finish(eqn, eqn.outvars[0], x.value**m, propagated, local, x.bad, x.dom)
    if m % 2 == 0:  # an even power, computed as products of equal factors, is never negative
        positive = ev.at_least(positive, jnp.zeros(positive.value.shape, F64))
    if n >= 0:
        return positive
    one = ev.exact(jnp.ones_like(x.value), dtype)
    return _div(ev, eqn, [one, positive])


@rule("one_minus_square")
def _one_minus_square(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """1 - x^2 (tanh's derivative): |(x+d)^2 - x^2| <= 2|x|e + e^2. XLA computes it as
    (1 + x)(1 - x): three roundings, each of at most u (1 + |x|)^2 (the largest any of
    the three intermediates can be), which also covers 1 - x*x."""
    (x,) = ins
    value = 1.0 - x.value * x.value
    propagated = 2.0 * jnp.abs(x.value) * x.err + x.err * x.err
    dtype = ev.compute_dtype(eqn.outvars[0])
    local = 3.0 * ev.rounding((1.0 + x.magnitude) ** 2, dtype)
    return ev.finish(eqn, eqn.outvars[0], value, propagated, local, x.bad, x.dom)


@rule("polynomial")
def _polynomial(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """p(x) = sum c_i x^i by Horner's rule: gamma_2n(u) sum |c_i| |x|^i (Higham, eq.
    5.3), with |x| + e for |x|; x's error moves it by at most sum i |c_i| (|x| + e)^(i-1) e,
    a coefficient's by e_i (|x| + e)^i."""
    x, coeffs = ins[0], ins[1:]
    value = _value(eqn, x.value, *[c.value for c in coeffs])
    reach = x.magnitude
    terms = sum(jnp.abs(c.value) * reach**i for i, c in enumerate(coeffs))
    propagated = sum(i * jnp.abs(c.value) * reach ** (i - 1) for i, c in enumerate(coeffs) if i) * x.err + sum(
        c.err * reach**i for i, c in enumerate(coeffs)
    )
    dtype = ev.compute_dtype(eqn.outvars[0])
    n = len(coeffs) - 1
    local = ev.gamma(2 * n, unit_roundoff(dtype)) * terms + 2 * n * ev.floor(dtype)
    bad, dom = ev.inherit(ins, value.shape)
    return ev.finish(eqn, eqn.outvars[0], value, propagated, local, bad, dom)


@rule("pow")
def _pow(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """x^y = exp(y log x) for x > 0: the error of t = y log x is |log x| ey + |y|
    err(log x), then the exp rule; unverifiable where x's interval reaches 0."""
    x, y = ins
    value = _value(eqn, x.value, y.value)
    ok = (x.value - x.err > 0) | ((x.err == 0) & (y.err == 0))
    log_err = jnp.where(x.err == 0, 0.0, -jnp.log1p(-x.err / jnp.where(x.value - x.err > 0, x.value, 1.0)))
    t_err = jnp.abs(jnp.log(jnp.where(x.value > 0, x.value, 1.0))) * y.err + jnp.abs(y.value) * log_err
    propagated = jnp.abs(value) * jnp.expm1(t_err)
    dtype = ev.compute_dtype(eqn.outvars[0])
    bad, dom = ev.inherit(ins, value.shape)
    bad = ev.flag(eqn, bad, ~ok)
    propagated = jnp.where(bad > 0, 0.0, propagated)
    # exp(log) composition: both evaluations' errors, relative to the result
    local = 2.0 * ev.transcendental(dtype) * (jnp.abs(value) + propagated) + ev.floor(dtype)
    return ev.finish(eqn, eqn.outvars[0], value, propagated, local, bad, dom)


_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


@rule(*_COMPARISONS)
def _compare(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """Exact where the operands' intervals are apart; unverifiable where they overlap
    (|a - b| <= ea + eb, some error): the kernel may decide either way."""
    a, b = ins
    value = _value(eqn, a.value, b.value)
    bad, dom = ev.inherit(ins, value.shape)
    slack = a.err + b.err
    if a.is_float and eqn.invars[0] is not eqn.invars[1]:  # x != x is a NaN test, exact whatever x's error
        close = (jnp.abs(a.value - b.value) <= slack) & (slack > 0)
        bad = ev.flag(eqn, bad, close)
    return Tracked(value, jnp.zeros(value.shape, F64), bad, dom, "float64")


@rule("select_n")
def _select(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """The chosen case's value and error. Where the predicate is unverifiable (a
    comparison within its operands' errors: relu's derivative at a computed 0, a
    where near its threshold) the kernel may pick any case: the error is then the
    largest distance of a case's interval from the chosen value, max_i(|v_i - v| + e_i),
    the cost the hand-derived bounds charge too. Only where that spread is not finite
    (a -inf mask on one side) does the element stay unverifiable."""
    pred, cases = ins[0], ins[1:]
    value = _value(eqn, pred.value, *[c.value for c in cases])
    shape = value.shape
    cases = [ev.broadcast(c, shape) for c in cases]
    named = [c for c in cases if c.shifts]
    if len({c.scaled for c in named}) > 1:  # a factor and a named sum: no common form
        cases = [ev.folded(c) if c.scaled else c for c in cases]
        named = [c for c in cases if c.shifts]
    values = [c.value for c in cases]
    errs = [c.err for c in cases]
    err = lax.select_n(pred.value, *errs)
    dom = lax.select_n(pred.value, *[jnp.broadcast_to(c.dom, shape) for c in cases])
    bad = lax.select_n(pred.value, *[jnp.broadcast_to(c.bad, shape) for c in cases])
    undecided = jnp.broadcast_to(pred.bad, shape)
    bounded = jnp.zeros(shape, bool)
    if jnp.issubdtype(value.dtype, jnp.floating):
        with np.errstate(invalid="ignore"):
            spread = _elementwise_max([jnp.abs(v - value) + ev.folded(c).err for v, c in zip(values, cases)])
        bounded = (undecided > 0) & jnp.isfinite(spread)
        err = jnp.where(bounded, spread, err)
        dom = jnp.where(bounded, undecided, dom)  # the decision's label: its comparison dominates here
        undecided = jnp.where(bounded, 0, undecided)
    bad = jnp.maximum(bad, undecided)
    carried = [c.carried for c in cases if c.is_float]
    out = Tracked(value, err, bad, dom, min(carried, key=unit_roundoff) if carried else "float64")
    if any(c.low is not None for c in cases):  # the chosen case's lower bound; any case's where undecided
        lows = [ev.lower(c) for c in cases]
        out = ev.at_least(out, jnp.where(bounded, _elementwise_min(lows), lax.select_n(pred.value, *lows)))
    if not named:
        return out
    # the chosen case's names; where the decision is open the bound above is plain
    shifts = []
    for k in ev.symbols(named):
        terms = ev.terms(cases, k)
        coef = jnp.where(bounded, 0.0, lax.select_n(pred.value, *[c for c, _ in terms]))
        shifts.append(Shift(k, coef, lax.select_n(pred.value, *[i for _, i in terms])))
    return ev.shifted(out, shifts, named[0].scaled)


@rule("convert_element_type")
def _convert(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """To a float dtype narrower than what the value is held in: one rounding (an
    explicit cast the kernel does too); wider: exact. To an integer: truncation,
    unverifiable where the interval crosses an integer."""
    (x,) = ins
    new = np.dtype(eqn.params["new_dtype"])
    if _is_float(new):
        if not x.is_float:  # an int or bool is exact in a float, and as verifiable as it was
            return dataclasses.replace(ev.exact(x.value.astype(F64), dtype_name(new)), bad=x.bad, dom=x.dom)
        target = dtype_name(new)
        if unit_roundoff(target) > unit_roundoff(x.carried):
            out = ev.finish(
                eqn, eqn.outvars[0], x.value, x.err, ev.rounding_of(x, target), x.bad, x.dom, carried=target
            )
            if x.low is not None:  # rounding is monotone
                least = ev.lower(x)
                out = ev.at_least(
                    out, jnp.where(jnp.isfinite(least), least - ev.rounding(jnp.abs(least), target), -jnp.inf)
                )
            return ev.shifted(out, x.shifts, x.scaled)
        return x
    x = ev.folded(x)
    value = x.value.astype(new)
    bad, dom = x.bad, x.dom
    if x.is_float:
        crossing = jnp.trunc(x.value - x.err) != jnp.trunc(x.value + x.err)
        bad = ev.flag(eqn, bad, crossing)
    return Tracked(value, jnp.zeros(value.shape, F64), bad, dom, "float64")


@rule("bitcast_convert_type")
def _bitcast(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """Bits of a float, or a float from bits: evaluated on the value in the traced dtype.
    The float read back is taken as exact. This serves exact-splitting tricks, whose
    result does not depend on the split point (erf's derivative computes exp(-x^2) as
    exp(-h^2) exp(-(x - h)(x + h)) with h = x with its low mantissa bits cleared), so the
    kernel's own split, wherever it falls, gives the same mathematics; a kernel that
    computes *with* the bits (a fast inverse square root) is not modelled by this."""
    (x,) = ins
    new = np.dtype(eqn.params["new_dtype"])
    source = x.value.astype(_var_dtype(eqn.invars[0])) if x.is_float else x.value
    value = lax.bitcast_convert_type(source, new)
    if _is_float(new):
        return dataclasses.replace(ev.exact(value.astype(F64), dtype_name(new)), bad=x.bad, dom=x.dom)
    return Tracked(value, jnp.zeros(value.shape, F64), x.bad, x.dom, "float64")


@rule("reduce_precision")
def _reduce_precision(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    (x,) = ins
    unit = 2.0 ** -(eqn.params["mantissa_bits"] + 1)
    return ev.finish(eqn, eqn.outvars[0], x.value, x.err, unit * x.magnitude, x.bad, x.dom)


def _argmax_along(err: jax.Array, dom: jax.Array, axes: Sequence[int]) -> jax.Array:
    """The label of the largest-error element along ``axes`` (moved last, flattened)."""
    keep = [i for i in range(err.ndim) if i not in axes]
    order = keep + list(axes)
    e = jnp.transpose(err, order).reshape([err.shape[i] for i in keep] + [-1])
    d = jnp.transpose(dom, order).reshape(e.shape)
    return jnp.take_along_axis(d, jnp.argmax(e, axis=-1)[..., None], axis=-1)[..., 0]


@rule("reduce_sum")
@_int_or_exact
def _reduce_sum(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """n terms summed in ``order``: sum of the terms' errors + gamma_k(u) sum|terms| +
    an underflow floor per inexact addition (algebra.reduce_sum), k the order's depth
    or, where fewer terms are nonzero, their count - 1; no rounding at all where the
    exact terms lie on a common grid (``_on_grid``). Named errors: additive terms'
    coefficients add, scaled terms with one factor keep it (sum p_j, p_j = exp(s_j - m))."""
    (x,) = ins
    axes = tuple(eqn.params["axes"])
    n = int(np.prod([x.value.shape[a] for a in axes])) if axes else 1
    dtype = ev.compute_dtype(eqn.outvars[0])
    shifts: tuple[Shift, ...] = ()
    if x.shifts:
        x, shifts = ev.uniform(x, axes, same_coef=x.scaled)
    scaled = x.scaled
    value = jnp.sum(x.value, axis=axes)
    spread = ev.spread_of(shifts, value.shape)
    propagated = jnp.sum(x.err, axis=axes)
    # An addition with an exactly-zero operand is exact, so a path from a term to the
    # result passes at most (nonzero terms - 1) inexact additions, in any order: a
    # one-hot pick (the target logit) is exact, an all-zero sum is exactly 0.
    terms = ev.reach(x)
    nonzero = jnp.sum(terms > 0, axis=axes)
    depth = jnp.minimum(ev.facts.order_of("reduce_sum").depth(n), jnp.maximum(nonzero - 1, 0))
    reach = jnp.sum(terms, axis=axes)
    with ev.growing(spread if scaled else 0.0):
        local = algebra.times(ev.gamma(depth, unit_roundoff(dtype)), reach) + jnp.maximum(nonzero - 1, 0) * ev.floor(
            dtype
        )
    if not x.shifts:
        local = jnp.where(_on_grid(ev, x, axes, dtype), 0.0, local)
    out = ev.finish(
        eqn,
        eqn.outvars[0],
        value,
        propagated,
        local,
        jnp.max(x.bad, axis=axes, initial=0),
        _argmax_along(x.err, x.dom, axes),
        reach=reach * jnp.exp(spread) if scaled else reach,
    )
    if ins[0].low is not None:  # every partial sum of terms computed nonnegative is nonnegative
        out = ev.at_least(out, jnp.where(jnp.all(ev.lower(ins[0]) >= 0, axis=axes), 0.0, -jnp.inf))
    return ev.shifted(out, shifts, scaled)


def _on_grid(ev: _Evaluator, x: Tracked, axes: tuple[int, ...], dtype: str) -> jax.Array:
    """Where a sum of exact terms is exact in any order. Every term is a multiple of
    2^g, g the lowest set bit over the terms; if sum |terms| <= 2^p 2^g (p the dtype's
    significand bits), every partial sum, in any order, is a multiple of 2^g of at most
    p significant bits: representable, so no addition rounds (the mean of a row of
    equal bf16 values: 100 copies of -7712 sum to -771200 exactly in f32). With
    flush-to-zero 2^g must be normal (a nonzero partial sum is then no subnormal)."""
    v = x.value
    exact = jnp.all((x.err == 0) & jnp.isfinite(v), axis=axes)
    mantissa, exponent = jnp.frexp(jnp.abs(v))
    digits = (mantissa * 2.0**53).astype(jnp.int64)  # |v| = digits 2^(exponent - 53), exactly
    lowest = jnp.frexp((digits & -digits).astype(F64))[1] - 1
    g = jnp.where(v == 0, 10_000, exponent - 53 + lowest)
    grid = jnp.min(g, axis=axes)
    p = -int(round(math.log2(unit_roundoff(dtype))))
    tiny = math.log2(smallest_normal(dtype))
    coarsest = tiny if ev.arith.flush_subnormals else tiny - (p - 1)
    total = jnp.sum(jnp.abs(v), axis=axes)
    fits = total <= jnp.ldexp(1.0, jnp.clip(grid, -2000, 2000) + p)
    return exact & fits & (grid >= coarsest) & (total <= largest_finite(dtype))


@rule("reduce_max", "reduce_min")
def _reduce_max(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """The largest error along the axes (1-Lipschitz in the sup norm); the result's
    error is named (oracles/shifts.py): the max a softmax subtracts cancels."""
    x = ev.folded(ins[0])
    axes = tuple(eqn.params["axes"])
    value = _value(eqn, x.value)
    out = Tracked(
        value,
        jnp.max(x.err, axis=axes),
        jnp.max(x.bad, axis=axes, initial=0),
        _argmax_along(x.err, x.dom, axes),
        x.carried,
    )
    return ev.named(out)


@rule("reduce_and", "reduce_or", "reduce_xor")
def _reduce_bool(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    (x,) = ins
    axes = tuple(eqn.params["axes"])
    value = _value(eqn, x.value)
    return Tracked(
        value,
        jnp.zeros(value.shape, F64),
        jnp.max(x.bad, axis=axes, initial=0),
        _argmax_along(x.err, x.dom, axes),
        "float64",
    )


@rule("top_k")
def _top_k(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> list[Tracked]:
    """The k largest along the last axis, sorted: copies, no arithmetic. The sorted
    values are 1-Lipschitz in the sup norm of the row (each order statistic moves by
    at most the row's largest error), so a value errs by at most that. The indices are
    unverifiable where, with some error in the row, two of the k + 1 largest values are
    within twice that error of each other: the kernel may order or pick them either way."""
    (x,) = ins
    k = eqn.params["k"]
    values, indices = _value(eqn, x.value)
    row_err = jnp.max(x.err, axis=-1, keepdims=True)
    row_bad = jnp.max(x.bad, axis=-1, keepdims=True)
    shape = values.shape
    err = jnp.broadcast_to(row_err, shape)
    dom = jnp.broadcast_to(_argmax_along(x.err, x.dom, (x.err.ndim - 1,))[..., None], shape)
    bad = jnp.broadcast_to(row_bad, shape)
    reach = min(k + 1, x.value.shape[-1])
    leading = lax.top_k(x.value, reach)[0]
    gaps = jnp.diff(leading, axis=-1) if reach > 1 else jnp.zeros(shape[:-1] + (0,), F64)
    close = jnp.any((-gaps <= 2.0 * row_err) & (row_err > 0), axis=-1, keepdims=True)
    index_bad = ev.flag(eqn, bad, jnp.broadcast_to(close, shape))
    return [
        Tracked(values, err, bad.astype(jnp.int32), dom, x.carried),
        Tracked(indices, jnp.zeros(shape, F64), index_bad, dom, "float64"),
    ]


@rule("argmax", "argmin")
def _argmax(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """Unverifiable where another element's interval reaches the winner's: the kernel
    may pick it. Exact ties of exact values follow the reference's rule (first index)."""
    (x,) = ins
    (axis,) = eqn.params["axes"]
    value = _value(eqn, x.value)
    sign = 1.0 if eqn.primitive.name == "argmax" else -1.0
    v = sign * x.value
    winner = jnp.expand_dims(value, axis)
    w_val = jnp.take_along_axis(v, winner, axis=axis)
    w_err = jnp.take_along_axis(x.err, winner, axis=axis)
    others = jnp.arange(v.shape[axis]).reshape([-1 if i == axis else 1 for i in range(v.ndim)]) != winner
    close = others & (v + x.err >= w_val - w_err) & ((x.err + w_err) > 0)
    culprit = jnp.any(close, axis=axis)
    bad = ev.flag(eqn, jnp.max(x.bad, axis=axis, initial=0), culprit)
    return Tracked(value, jnp.zeros(value.shape, F64), bad, _argmax_along(x.err, x.dom, (axis,)), "float64")


def _cumulative(ev: _Evaluator, eqn: Any, x: Tracked) -> tuple[int, bool, jax.Array]:
    axis, reverse = eqn.params["axis"], eqn.params["reverse"]
    n = x.value.shape[axis]
    count = np.arange(1, n + 1)
    count = count[::-1] if reverse else count
    return axis, reverse, jnp.asarray(count).reshape([-1 if i == axis else 1 for i in range(x.value.ndim)])


@rule("cumsum")
@_int_or_exact
def _cumsum(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """Element i is a sum of its i + 1 prefix terms in ``order``: depth(i + 1)."""
    (x,) = ins
    axis, reverse, count = _cumulative(ev, eqn, x)
    dtype = ev.compute_dtype(eqn.outvars[0])
    value = _value(eqn, x.value)
    propagated = lax.cumsum(x.err, axis=axis, reverse=reverse)
    depth = ev.facts.order_of("cumsum").depth(np.asarray(count))
    reach = lax.cumsum(x.magnitude, axis=axis, reverse=reverse)
    local = ev.gamma(depth, unit_roundoff(dtype)) * reach + (count - 1) * ev.floor(dtype)
    inherited = lax.cummax(x.dom, axis=axis, reverse=reverse)  # a label from the prefix
    return ev.finish(
        eqn,
        eqn.outvars[0],
        value,
        propagated,
        local,
        lax.cummax(x.bad, axis=axis, reverse=reverse),
        inherited,
        reach=reach,
    )


@rule("cummax", "cummin")
def _cummax(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    (x,) = ins
    axis, reverse = eqn.params["axis"], eqn.params["reverse"]
    value = _value(eqn, x.value)
    return Tracked(
        value,
        lax.cummax(x.err, axis=axis, reverse=reverse),
        lax.cummax(x.bad, axis=axis, reverse=reverse),
        lax.cummax(x.dom, axis=axis, reverse=reverse),
        x.carried,
    )


@rule("cumprod")
def _cumprod(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """|prod(x + d) - prod x| <= prod(|x| + e) - prod|x|; i products: gamma_i(u) prod(|x| + e)."""
    (x,) = ins
    axis, reverse, count = _cumulative(ev, eqn, x)
    dtype = ev.compute_dtype(eqn.outvars[0])
    value = _value(eqn, x.value)
    mag = lax.cumprod(x.magnitude, axis=axis, reverse=reverse)
    propagated = mag - jnp.abs(value)
    local = ev.gamma(np.asarray(count) - 1, unit_roundoff(dtype)) * mag + (count - 1) * ev.floor(dtype)
    return ev.finish(
        eqn,
        eqn.outvars[0],
        value,
        propagated,
        local,
        lax.cummax(x.bad, axis=axis, reverse=reverse),
        lax.cummax(x.dom, axis=axis, reverse=reverse),
    )


@rule("cumlogsumexp")
def _cumlogsumexp(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """logsumexp is 1-Lipschitz in the sup norm: the prefix's largest input error. Each
    of its depth(i + 1) combining steps max + log1p(exp(-|a - b|)) errs by at most
    (u + t)|partial| + 2t ln 2 (t: the transcendental error; the log1p term is below
    ln 2), every partial result lying between the prefix's max and its logsumexp."""
    (x,) = ins
    axis, reverse, count = _cumulative(ev, eqn, x)
    dtype = ev.compute_dtype(eqn.outvars[0])
    value = _value(eqn, x.value)
    partial = jnp.maximum(jnp.abs(value), lax.cummax(jnp.abs(x.value), axis=axis, reverse=reverse))
    u, t = unit_roundoff(dtype), ev.transcendental(dtype)
    depth = jnp.asarray(ev.facts.order_of("cumlogsumexp").depth(np.asarray(count)), F64)
    local = depth * ((u + t) * partial + 2.0 * t * math.log(2.0) + ev.floor(dtype))
    return ev.finish(
        eqn,
        eqn.outvars[0],
        value,
        lax.cummax(x.err, axis=axis, reverse=reverse),
        local,
        lax.cummax(x.bad, axis=axis, reverse=reverse),
        lax.cummax(x.dom, axis=axis, reverse=reverse),
    )


@rule("dot_general")
@_int_or_exact
def _dot_general(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """A dot of K terms (algebra.dot on computed operands): the operands' errors
    propagate as |a| @ eb + ea @ |b| + ea @ eb; operands the hardware rounds first
    (f32 -> tf32 on GPU at default precision) add 2u_op |a|@|b|; the accumulation in
    ``order`` adds gamma_k(u_acc) (|a|+ea)@(|b|+eb) (k no more than the nonzero
    products less one), plus two underflow floors per nonzero product and, with
    denormals-are-zero, the products of subnormal operands; a result narrower than the
    accumulator rounds once more. Named errors: a scaled operand whose factor is the
    same along the contraction (p of one query row: e^(-d) of its max) passes it to the
    result, the products and sums charged in its frame (the other operand plain)."""
    a, b = ins
    if not (a.shifts or b.shifts):
        return _dot(ev, eqn, ev.as_dot_operand(eqn, a), ev.as_dot_operand(eqn, b))
    a, b = (ev.folded(t) if t.shifts and not t.scaled else t for t in (a, b))
    if a.shifts and b.shifts:
        b = ev.folded(b)
    a, b = ev.as_dot_operand(eqn, a), ev.as_dot_operand(eqn, b)
    if not (a.shifts or b.shifts):
        return _dot(ev, eqn, a, b)
    (contract_a, contract_b), (batch_a, batch_b) = eqn.params["dimension_numbers"]
    first = bool(a.shifts)
    carrier, contract, batch = (a, contract_a, batch_a) if first else (b, contract_b, batch_b)
    carrier, reduced = ev.uniform(carrier, tuple(contract), same_coef=True)
    a, b = (carrier, b) if first else (a, carrier)
    # the reduced names hold the carrier's batch and free axes in its own order; the
    # result is (batch, free of a, free of b)
    kept = [d for d in range(carrier.value.ndim) if d not in contract]
    order = [kept.index(d) for d in batch] + [kept.index(d) for d in kept if d not in batch]
    other = b if first else a
    other_free = other.value.ndim - len(contract_a) - len(batch_a)
    out_shape = tuple(_var_shape(eqn.outvars[0]))

    def placed(x: jax.Array) -> jax.Array:
        x = jnp.transpose(x, order)
        at = x.ndim if first else len(batch)
        x = jnp.expand_dims(x, tuple(range(at, at + other_free)))
        return jnp.broadcast_to(x, out_shape)

    shifts = tuple(Shift(s.symbol, placed(s.coef), placed(s.index)) for s in reduced)
    with ev.growing(ev.spread_of(shifts, out_shape)):
        out = _dot(ev, eqn, a, b)
    return ev.shifted(out, shifts, True)


def _dot(ev: _Evaluator, eqn: Any, a: Tracked, b: Tracked) -> Tracked:
    """The dot of operands as the kernel feeds them (``_dot_general``)."""
    (contract_a, contract_b), _ = eqn.params["dimension_numbers"]
    k = int(np.prod([a.value.shape[i] for i in contract_a]))

    def dot(x: jax.Array, y: jax.Array) -> jax.Array:
        return _value(eqn, x, y)

    value = dot(a.value, b.value)
    abs_a, abs_b = jnp.abs(a.value), jnp.abs(b.value)
    propagated = dot(abs_a, b.err) + dot(a.err, abs_b) + dot(a.err, b.err)
    magnitude = dot(a.magnitude, b.magnitude)
    arith = ev.arith
    precision = eqn.params.get("precision")
    highest = precision is not None and any(
        str(p).endswith("HIGHEST") for p in (precision if isinstance(precision, tuple) else (precision,))
    )
    out_dtype = ev.compute_dtype(eqn.outvars[0])
    acc_dtype = "float64" if unit_roundoff(out_dtype) < unit_roundoff("float32") else "float32"
    op_dtype = _narrower(a.carried, b.carried)
    u_op = unit_roundoff("float32") if highest and op_dtype == "float32" else arith.operand_unit(op_dtype)
    operand_rel = 2.0 * u_op + u_op * u_op
    order = ev.facts.order_of("dot_general") if arith.mma_order_known else SEQUENTIAL
    # products of an exact zero are exact zeros, and adding them is exact: an output
    # element with c nonzero products passes at most c - 1 inexact additions
    nonzero = dot((a.magnitude > 0).astype(F64), (b.magnitude > 0).astype(F64))
    depth = jnp.minimum(order.depth(k), jnp.maximum(nonzero - 1, 0))
    acc = ev.gamma(depth, arith.mma_unit(acc_dtype))
    local = operand_rel * magnitude + acc * (1.0 + operand_rel) * magnitude + 2 * nonzero * ev.floor(acc_dtype)
    if arith.flush_subnormals:
        local = (
            local
            + dot(algebra.subnormal_part(a.magnitude), b.magnitude)
            + dot(a.magnitude, algebra.subnormal_part(b.magnitude))
        )
    if unit_roundoff(out_dtype) > unit_roundoff(acc_dtype):
        local = local + ev.rounding(jnp.abs(value) + propagated + local, out_dtype)
    # an unverifiable operand element spoils its whole row (column) of the result
    bad_a = jnp.where(dot((a.bad > 0).astype(F64), jnp.ones_like(b.value)) > 0, jnp.max(a.bad, initial=0), 0)
    bad_b = jnp.where(dot(jnp.ones_like(a.value), (b.bad > 0).astype(F64)) > 0, jnp.max(b.bad, initial=0), 0)
    inherited = jnp.where(dot(a.err, abs_b) >= dot(abs_a, b.err), _worst_label(a), _worst_label(b))
    local = jnp.where(magnitude * ev.grow <= largest_finite(acc_dtype), local, jnp.inf)  # a partial sum may overflow
    local = jnp.where(magnitude == 0, 0.0, local)  # every product exactly 0: so is the sum
    return ev.finish(eqn, eqn.outvars[0], value, propagated, local, jnp.maximum(bad_a, bad_b), inherited)


def _worst_label(t: Tracked) -> jax.Array:
    """The label of ``t``'s largest-error element (a dot mixes whole rows and columns)."""
    return t.dom.reshape(-1)[jnp.argmax(t.err.reshape(-1))] if t.err.size else jnp.int32(INPUT)


@rule("scatter-add", "scatter_add")
def _scatter_add(ev: _Evaluator, eqn: Any, ins: list[Tracked]) -> Tracked:
    """Each destination adds its updates in sequence: errors add, plus gamma_c(u)
    times the sum of magnitudes, c the nonzero terms (operand and updates) less one."""
    operand, indices, updates = ins
    dtype = ev.compute_dtype(eqn.outvars[0])
    p = eqn.params

    def bind(o: jax.Array, u: jax.Array) -> jax.Array:  # the public op rebuilds the adder for f64
        return lax.scatter_add(
            o,
            indices.value,
            u,
            p["dimension_numbers"],
            indices_are_sorted=p["indices_are_sorted"],
            unique_indices=p["unique_indices"],
            mode=p["mode"],
        )

    value = bind(operand.value, updates.value)
    propagated = bind(operand.err, updates.err)
    # additions of an exact zero are exact: a destination with c nonzero terms (its
    # operand and its updates) passes c - 1 inexact additions
    nonzero = bind((operand.magnitude > 0).astype(F64), (updates.magnitude > 0).astype(F64))
    count = jnp.maximum(nonzero - 1, 0)
    local = algebra.times(
        ev.gamma(np.asarray(count), unit_roundoff(dtype)), bind(operand.magnitude, updates.magnitude)
    ) + count * ev.floor(dtype)
    spoiled = bind((operand.bad > 0).astype(F64), (updates.bad > 0).astype(F64)) > 0
    bad = jnp.where(spoiled, jnp.maximum(jnp.max(operand.bad, initial=0), jnp.max(updates.bad, initial=0)), 0)
    return ev.finish(eqn, eqn.outvars[0], value, propagated, local, bad, operand.dom)


# ------------------------------------------------------------------------ entry points


def trace(fn: Callable[..., Any], *args: Any) -> jcore.ClosedJaxpr:
    """The jaxpr of ``fn`` on arrays shaped and typed like ``args``, traced as its user
    runs it: in 32-bit JAX even inside the device oracles' float64 scope (where
    ``jnp.arange`` would be int64 and ``jnp.ones(n)`` float64)."""
    with numeric.kernel_side():
        return jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args])


def vjp_function(fn: Callable[..., Any], wrt: Sequence[int]) -> Callable[..., Any]:
    """(*args, cotangent) -> the gradients of sum(fn(*args) * cotangent) w.r.t. args[wrt]."""

    def pulled(*args_and_ct: Any) -> tuple[Any, ...]:
        *args, ct = args_and_ct

        def partial(*diff: Any) -> Any:
            full = list(args)
            for i, d in zip(wrt, diff):
                full[i] = d
            return fn(*full)

        _, pullback = jax.vjp(partial, *[args[i] for i in wrt])
        return pullback(ct)

    return pulled


def derive(
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    facts: Facts,
    arith: Arithmetic,
    jaxpr: jcore.ClosedJaxpr | None = None,
) -> Derived:
    """Evaluate ``fn`` on ``args`` (numpy arrays of the kernel's input dtypes) in
    float64 and in the error algebra. Returns every output's value and bound, the
    final rounding to its dtype (``facts.out_dtype`` or the reference's) included."""
    jaxpr = jaxpr if jaxpr is not None else trace(fn, *args)
    ev = _Evaluator(facts, arith)
    with float64_enabled():
        inputs = []
        for var, a in zip(jaxpr.jaxpr.invars, args):
            dt = np.asarray(a).dtype
            if _is_float(dt):
                t = ev.exact(np.asarray(a, dtype=F64), dtype_name(dt))
                if arith.flush_subnormals:  # denormals-are-zero may read a subnormal input as 0
                    t = dataclasses.replace(t, err=algebra.subnormal_part(t.value))
            else:
                t = ev.exact(np.asarray(a), "float64")
            inputs.append(t)
        floats = [t.carried for t in inputs if t.is_float]
        ev.narrowest_input = max(floats, key=unit_roundoff) if floats else "float64"
        outs = [ev.folded(o) for o in ev.run(jaxpr, [], inputs)]
        result: tuple[list[np.ndarray], ...] = [], [], [], [], []
        culprits = []
        for outvar, out in zip(jaxpr.jaxpr.outvars, outs):
            inner = out.dom
            culprits.append(np.asarray(out.bad))
            dt = _var_dtype(outvar)
            if _is_float(dt):
                target = facts.out_dtype or dtype_name(dt)
                if unit_roundoff(target) > unit_roundoff(out.carried):
                    out = ev.finish(
                        _OUTPUT,
                        outvar,
                        out.value,
                        out.err,
                        ev.rounding(out.magnitude, target),
                        out.bad,
                        out.dom,
                        carried=target,
                    )
            for store, field in zip(result, (out.value, out.err, out.bad > 0, out.dom, inner)):
                store.append(np.asarray(field))
    values, bounds, bad, dom, inner = result
    return Derived(
        tuple(v.astype(F64) if _is_float(v.dtype) else v for v in values),
        tuple(bounds),
        tuple(bad),
        tuple(dom),
        tuple(inner),
        tuple(culprits),
        tuple(ev.sources),
    )


class _OutputStore:
    """Stand-in equation for the final store to the output dtype (for labels)."""

    class primitive:  # noqa: N801 - mimics JaxprEqn.primitive
        name = "store to the output dtype"

    source_info = None


_OUTPUT = _OutputStore()
