"""Reusable checks: plain functions, usable inside or outside pytest.

Each check compares a kernel's result with what it promised and returns an
:class:`Outcome`; on a broken promise it raises :class:`CheckFailure` whose message
names the kernel, config, backend, dtype, worst element, error, bound and how to
replay it. Bring your own kernel, oracle and bound:

    from pallascheck.properties import checks
    ctx = checks.Context(kernel="my_softmax", dtype="bfloat16", backend="triton")
    checks.check_values(my_kernel(x), oracle64(x), my_bound(x), context=ctx)
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.oracles.numeric import active_device, namespace


@dataclasses.dataclass(frozen=True)
class Context:
    """Who is being checked, for failure messages."""

    kernel: str
    dtype: str = ""
    backend: str = ""
    config: Any = None
    replay: str = ""  # a command or file that reproduces the failure

    def describe(self) -> str:
        parts = [f"kernel={self.kernel}"]
        for key in ("dtype", "backend", "config"):
            value = getattr(self, key)
            if value not in ("", None):
                parts.append(f"{key}={value}")
        return " ".join(parts)

    def with_config(self, config: Any) -> Context:
        return dataclasses.replace(self, config=config)


@dataclasses.dataclass(frozen=True)
class Worst:
    """Where an outcome's budget was used most: the compared output's name and shape,
    the element's index, and (for value comparisons) its error and bound. Fuzz
    campaigns plot error against bound and group failures by where they occur."""

    name: str
    index: tuple[int, ...]
    shape: tuple[int, ...]
    error: float | None = None
    bound: float | None = None
    kernel: float | None = None  # the kernel's value there: an infinite one is an overflow
    oracle: float | None = None


@dataclasses.dataclass
class Outcome:
    check: str
    passed: bool
    budget_used: float  # worst observed error / bound (0 when nothing to compare)
    detail: str = ""
    examples: int = 1
    worst: Worst | None = None

    def merge(self, other: Outcome) -> Outcome:
        """Combine outcomes of the same check over more examples."""
        worse = self if self.budget_used >= other.budget_used else other
        failed = next((o for o in (self, other) if not o.passed), None)
        return Outcome(
            self.check,
            self.passed and other.passed,
            max(self.budget_used, other.budget_used),
            (failed or worse).detail,
            self.examples + other.examples,
            (failed or worse).worst,
        )


class CheckFailure(AssertionError):
    def __init__(self, outcome: Outcome, context: Context):
        self.outcome = outcome
        self.context = context
        replay = f"\n  replay: {context.replay}" if context.replay else ""
        super().__init__(f"[{outcome.check}] {context.describe()}\n  {outcome.detail}{replay}")


def _raise_unless(outcome: Outcome, context: Context, raise_on_failure: bool) -> Outcome:
    if raise_on_failure and not outcome.passed:
        raise CheckFailure(outcome, context)
    return outcome


def _as_f64(a: Any) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def compare(actual: Any, expected: Any, bound: Any, *, name: str = "out", check: str = "values") -> Outcome:
    """|actual - expected| <= bound elementwise, for float64 ``expected``.

    Where ``expected`` is NaN or infinite the kernel must produce exactly that
    (NaN for NaN, the same infinity); a non-finite result where the oracle is
    finite is an error of infinite size, which fails unless the bound there is
    infinite too: a bound model is infinite only where a rounding may overflow,
    and an overflowed intermediate makes any value, inf or NaN (inf - inf in a
    later sum), the kernel's correct result. An oracle computed on a device
    (oracles/numeric.py) is compared there: only the worst element comes back; one
    whose results the device oracles hold on the host (a chunked attention case) is
    compared there too, a block at a time (``_held_worst``).
    """
    xp = namespace(expected, bound)
    held = xp is np and active_device() is not None
    if held:
        actual, expected = np.asarray(actual), np.asarray(expected, dtype=np.float64)
    elif xp is np:
        actual, expected = _as_f64(actual), _as_f64(expected)
        bound = np.broadcast_to(_as_f64(bound), expected.shape)
    else:  # inside the device oracles' float64 scope
        actual = xp.asarray(actual)
        expected = xp.asarray(expected, dtype=np.float64)
        bound = xp.asarray(bound, dtype=np.float64)
    if actual.shape != expected.shape:
        return Outcome(check, False, np.inf, f"{name}: shape {actual.shape} != expected {expected.shape}")
    if expected.size == 0:
        return Outcome(check, True, 0.0, f"{name}: empty")
    if held:
        flat, used, kernel, oracle, error, bound_there, special = _held_worst(actual, expected, bound)
    elif xp is np:
        with np.errstate(divide="ignore", invalid="ignore"):
            flat, used, kernel, oracle, error, bound_there, special = _worst(np, actual, expected, bound)
    else:
        flat, used, kernel, oracle, error, bound_there, special = _device_worst(actual, expected, bound)
    worst = tuple(int(i) for i in np.unravel_index(int(flat), expected.shape))
    used = float(used)
    # plain floats: numpy 2's repr of a scalar is np.float64(...)
    kernel, oracle = float(kernel), float(oracle)
    detail = (
        f"{name}: worst element {worst}: kernel={kernel!r} oracle={oracle!r} error={float(error):.3e} "
        f"bound={float(bound_there):.3e} (budget used {used:.3g})"
    )
    if not bool(special):
        detail = f"{name}: element {worst} is {kernel!r}, oracle promises {oracle!r}"
    story = infinity_story(kernel, oracle) if used > 1.0 else ""
    if story:
        detail = f"{detail}\n  {story}"
    where = Worst(name, worst, tuple(expected.shape), float(error), float(bound_there), kernel, oracle)
    return Outcome(check, bool(used <= 1.0), used, detail, worst=where)


def infinity_story(kernel: float, oracle: float) -> str:
    """What one side infinite and the other finite most likely means, or "" otherwise."""
    if np.isinf(kernel) and np.isfinite(oracle):
        return (
            f"overflow: the kernel's {kernel} where the exact result {oracle:.6g} is finite; an intermediate "
            "likely left the compute dtype's range (an exp without its max subtracted, a sum of squares, a scale "
            "applied too late)"
        )
    if np.isnan(kernel) and np.isfinite(oracle):
        return (
            f"the kernel's nan where the exact result {oracle:.6g} is finite: likely an intermediate that "
            "overflowed (inf - inf, 0 * inf) or a 0 / 0"
        )
    if np.isfinite(kernel) and np.isinf(oracle):
        return (
            f"the exact result is {oracle} where the kernel's {kernel:.6g} is finite: the kernel saturates or "
            "clamps, or an intermediate underflowed (the log of a tiny positive value where the exact one is 0)"
        )
    return ""


def _ratio(xp: Any, actual: Any, expected: Any, bound: Any) -> tuple[Any, Any, Any]:
    """Elementwise: the budget used, the error, and whether a non-finite oracle value
    was matched (``compare``'s rules)."""
    actual = actual.astype(np.float64)
    finite = xp.isfinite(expected)
    special_ok = xp.where(xp.isnan(expected), xp.isnan(actual), xp.where(finite, True, actual == expected))
    error = xp.where(finite, xp.abs(actual - expected), 0.0)
    error = xp.where(finite & ~xp.isfinite(actual), np.inf, error)
    ratio = xp.where((error == 0) | (finite & (bound == np.inf)), 0.0, error / bound)
    ratio = xp.where(special_ok, ratio, np.inf)
    # a NaN bound (e.g. inf * 0 in a bound model) bounds nothing: fail there, by name,
    # instead of a NaN budget that max() and argmax() would pass over
    return xp.where(xp.isnan(ratio), np.inf, ratio), error, special_ok


def _worst(xp: Any, actual: Any, expected: Any, bound: Any) -> tuple[Any, ...]:
    """The flat index of ``compare``'s worst element and, there: the budget used, the
    kernel's and the oracle's values, the error, the bound and whether a non-finite
    oracle value was matched. Only the argmax sees whole arrays; the rest is recomputed
    at the one element."""
    bound = xp.broadcast_to(bound, expected.shape)
    flat = xp.argmax(_ratio(xp, actual, expected, bound)[0])
    there = xp.unravel_index(flat, expected.shape)
    kernel, oracle, bound_there = actual[there], expected[there], bound[there]
    ratio, error, special_ok = _ratio(xp, kernel, oracle, bound_there)
    return flat, ratio, kernel.astype(np.float64), oracle, error, bound_there, special_ok


# On the device one program per shape: XLA fuses the comparison into the argmax. Run
# operation by operation, each step held a float64 array of the case's size and
# compiled a program of its own; picking the worst element from the whole ratio, error
# and bound arrays held all three (12 GiB for a production attention dbias of 5e8
# elements, out of the GPU's memory).
_device_worst = jax.jit(functools.partial(_worst, jnp))
# Elements of one block of a comparison with results held on the host: three float64
# blocks of 2^25 elements (268 MB each) on the device at a time (HELD_BYTES, for the
# production tier's memory rule).
HELD_BLOCK = 2**25
HELD_BYTES = 3 * 8 * HELD_BLOCK


def _held_worst(actual: np.ndarray, expected: np.ndarray, bound: Any) -> tuple[Any, ...]:
    """``_worst`` of arrays on the host, computed on the oracle device a block of
    ``HELD_BLOCK`` elements at a time: the worst element of the block where the budget
    used is largest, the first such block (argmax's first worst element). Each block is
    copied in and waited for before the comparison runs (numeric.placed says
    why)."""
    flats = (actual.reshape(-1), expected.reshape(-1), np.broadcast_to(bound, expected.shape).reshape(-1))
    best: tuple[Any, ...] | None = None
    for start in range(0, expected.size, HELD_BLOCK):
        blocks = jax.block_until_ready([jax.device_put(f[start : start + HELD_BLOCK]) for f in flats])
        flat, *rest = jax.device_get(_device_worst(*blocks))
        if best is None or rest[0] > best[1]:
            best = (start + int(flat), *rest)
    assert best is not None  # an empty expected returned before
    return best


def check_values(
    actual: Any,
    expected: Any,
    bound: Any,
    *,
    context: Context,
    name: str = "out",
    raise_on_failure: bool = True,
) -> Outcome:
    """The kernel's output is within ``bound`` of the float64 oracle, elementwise."""
    return _raise_unless(compare(actual, expected, bound, name=name), context, raise_on_failure)


def _compare_trees(
    actual: Mapping[str, Any], expected: Mapping[str, Any], bounds: Mapping[str, Any], check: str
) -> Outcome:
    missing = set(actual) - (set(expected) & set(bounds))
    if missing or not actual:
        return Outcome(check, False, np.inf, f"no oracle or bound for {sorted(missing) or 'anything'}")
    outcomes = [compare(actual[k], expected[k], bounds[k], name=k, check=check) for k in sorted(actual)]
    worst = max(outcomes, key=lambda o: o.budget_used)
    return Outcome(check, all(o.passed for o in outcomes), worst.budget_used, worst.detail, worst=worst.worst)


def check_gradients(
    actual: Mapping[str, Any],
    expected: Mapping[str, Any],
    bounds: Mapping[str, Any],
    *,
    context: Context,
    raise_on_failure: bool = True,
) -> Outcome:
    """Each named gradient the kernel returns (dx, dscale, ...) is within its bound of
    the float64 VJP (``expected`` may hold more, e.g. intermediates the bound uses)."""
    return _raise_unless(_compare_trees(actual, expected, bounds, "gradients"), context, raise_on_failure)


def check_gradient_dtypes(
    actual: Mapping[str, Any],
    primals: Mapping[str, Any],
    *,
    context: Context,
    raise_on_failure: bool = True,
) -> Outcome:
    """Each gradient ``d<name>`` has the dtype of its primal ``<name>``, as JAX's VJPs
    promise: a bf16 parameter's gradient returned in f32 is within any bound of the
    oracle, yet every optimiser step downstream then sees another dtype."""
    wrong = {
        k: (np.asarray(v).dtype.name, np.asarray(primals[k[1:]]).dtype.name)
        for k, v in actual.items()
        if k.startswith("d") and k[1:] in primals and np.asarray(v).dtype != np.asarray(primals[k[1:]]).dtype
    }
    if not wrong:
        return Outcome("gradients", True, 0.0, f"{len(actual)} gradients in their primals' dtypes")
    detail = "; ".join(f"{k} is {got}, its primal {k[1:]} is {want}" for k, (got, want) in sorted(wrong.items()))
    worst = sorted(wrong)[0]
    outcome = Outcome(
        "gradients", False, np.inf, f"gradient dtype: {detail}", worst=Worst(worst, (), tuple(np.shape(actual[worst])))
    )
    return _raise_unless(outcome, context, raise_on_failure)


def _bitwise_equal(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def check_deterministic(
    run: Callable[[], Any], *, context: Context, runs: int = 2, raise_on_failure: bool = True
) -> Outcome:
    """``run()`` returns bitwise-identical results every time (a tuple/dict of
    arrays or one array). Vary what should not matter (a TPU-interpreter shuffle
    seed) inside ``run`` by passing a list of thunks via :func:`check_same_bits`."""
    return check_same_bits([run] * runs, context=context, raise_on_failure=raise_on_failure)


def _leaves(result: Any) -> list[np.ndarray]:
    if isinstance(result, Mapping):
        return [np.asarray(result[k]) for k in sorted(result)]
    if isinstance(result, (tuple, list)):
        return [np.asarray(r) for r in result]
    return [np.asarray(result)]


def changed_elements(a: Any, b: Any) -> int:
    """How many elements of ``b`` differ in their bits from ``a``'s (every element where
    the shapes or dtypes differ)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.size, b.size)
    a_bytes, b_bytes = (np.ascontiguousarray(x).reshape(-1).view(np.uint8).reshape(x.size, -1) for x in (a, b))
    return int(np.count_nonzero((a_bytes != b_bytes).any(axis=1)))


def changed_bits(a: Any, b: Any) -> int:
    """``changed_elements`` over a check's whole result (an array, or a mapping or
    sequence of them, as ``_leaves`` takes it): how many elements of ``b`` differ in
    their bits from ``a``'s."""
    return sum(changed_elements(x, y) for x, y in zip(_leaves(a), _leaves(b)))


def rerun_note(failing: Any, reruns: Sequence[Any], judge: Callable[[Any], Outcome], device: str | None = None) -> str:
    """What ``reruns`` (outputs of the kernel run again on the failing case's inputs,
    or the exceptions those runs raised) say of a failure: a steady one (the same bits
    each time), or an output that changes from run to run, which no rounding explains.
    ``judge`` checks a rerun's output as the failing one was checked; ``device`` names
    the GPU they ran on (properties/device/identity.py)."""
    leaves = _leaves(failing)
    notes, changed, passed = [], 0, []
    for again in reruns:
        if isinstance(again, BaseException):
            notes.append(f"raised {type(again).__name__}: {again}")
            continue
        count = changed_bits(failing, again)
        changed += count
        passed.append(judge(again).passed)
        notes.append(
            f"{count} of {sum(a.size for a in leaves)} elements differ from the failing run's bits, "
            + ("passes" if passed[-1] else "fails")
        )
    said = f"run {len(reruns)} more times on the same inputs: " + "; ".join(notes)
    if not changed:
        return f"{said} (a steady failure)" if len(passed) == len(reruns) else said
    where = (
        (
            f" It ran on {device}: failures like this one that gather on one GPU, and pass on others, point at "
            f"that device."
        )
        if device
        else ""
    )
    return (
        f"{said}. The output changes from run to run on the same inputs, which rounding does not explain: "
        f"a read of memory the kernel never wrote (an accumulator or buffer not initialised), a race in the "
        f"kernel, or a fault of the runtime or the device ('pallascheck replay FILE --repeat N' reruns a "
        f"saved case; 'pallascheck bench --dispatch-stress KERNEL' with --reference and --inputs host tells "
        f"the kernel's fault from the runtime's).{where}"
    )


def check_same_bits(thunks: list[Callable[[], Any]], *, context: Context, raise_on_failure: bool = True) -> Outcome:
    """Every thunk returns the same bits as the first."""
    first = _leaves(thunks[0]())
    for i, thunk in enumerate(thunks[1:], start=1):
        again = _leaves(thunk())
        for j, (a, b) in enumerate(zip(first, again)):
            if not _bitwise_equal(a, b):
                diff = np.argwhere(np.asarray(a) != np.asarray(b))
                where = tuple(int(v) for v in diff[0]) if len(diff) else "dtype/shape"
                outcome = Outcome(
                    "deterministic",
                    False,
                    np.inf,
                    f"run {i} output {j} differs from run 0 at {where}: {np.asarray(a)[where] if len(diff) else ''} vs {np.asarray(b)[where] if len(diff) else ''}",
                    worst=Worst(f"output {j}", cast(tuple[int, ...], where) if len(diff) else (), np.shape(a)),
                )
                return _raise_unless(outcome, context, raise_on_failure)
    return Outcome("deterministic", True, 0.0, f"{len(thunks)} runs bitwise equal")


def check_configs_agree(
    results: Mapping[Any, tuple[Any, Any]], *, context: Context, raise_on_failure: bool = True
) -> Outcome:
    """Every pair of configs agrees within the sum of their bounds.

    ``results`` maps a config to (output, bound of that output against the oracle).
    If both are within their bounds of the oracle, the triangle inequality gives
    |a - b| <= bound_a + bound_b; a larger gap proves one of them wrong even where
    no oracle is at hand.
    """
    items = list(results.items())
    worst = Outcome("configs_agree", True, 0.0, f"{len(items)} configs")
    base_cfg, (base, base_bound) = items[0]
    for cfg, (out, out_bound) in items[1:]:
        both = namespace(base_bound, out_bound)  # device bounds are added where they are
        allowed = both.asarray(base_bound, dtype=np.float64) + both.asarray(out_bound, dtype=np.float64)
        o = compare(out, _as_f64(base), allowed, name=f"{cfg} vs {base_cfg}", check="configs_agree")
        if o.budget_used >= worst.budget_used:
            worst = Outcome("configs_agree", o.passed and worst.passed, o.budget_used, o.detail, worst=o.worst)
        elif not o.passed:
            worst.passed = False
    return _raise_unless(worst, context, raise_on_failure)


def check_errors(
    thunk: Callable[[], Any],
    exception: type[BaseException],
    match: str,
    *,
    context: Context,
    raise_on_failure: bool = True,
) -> Outcome:
    """Bad input raises ``exception`` with a message matching the regex ``match``."""
    try:
        thunk()
    except exception as err:
        if re.search(match, str(err)):
            return Outcome("errors", True, 0.0, f"{exception.__name__}: {err}")
        outcome = Outcome(
            "errors", False, np.inf, f"{exception.__name__} message {str(err)!r} does not match {match!r}"
        )
    except Exception as err:  # noqa: BLE001 - the wrong exception is the finding
        outcome = Outcome(
            "errors",
            False,
            np.inf,
            f"expected {exception.__name__} matching {match!r}, got {type(err).__name__}: {err}",
        )
    else:
        outcome = Outcome(
            "errors", False, np.inf, f"expected {exception.__name__} matching {match!r}, nothing was raised"
        )
    return _raise_unless(outcome, context, raise_on_failure)


def check_relation(
    lhs: Any, rhs: Any, bound: Any, *, relation: str, context: Context, raise_on_failure: bool = True
) -> Outcome:
    """A metamorphic relation ``lhs == rhs`` that holds exactly in real arithmetic,
    up to ``bound`` (typically the sum of both sides' bounds against the oracle)."""
    o = compare(lhs, _as_f64(rhs), bound, name=relation, check=f"metamorphic:{relation}")
    return _raise_unless(o, context, raise_on_failure)
