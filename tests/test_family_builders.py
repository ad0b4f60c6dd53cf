"""The spec builders ``top_k_like`` and ``cross_entropy_like`` on user kernels written
here, as a user would write them: real Pallas kernels, jitted, with an ``interpret``
keyword. Top-k is one block, k rounds of "largest not yet taken" (short, and it
compares numbers, so its spec states ``order="numbers"``); ``jax.lax.top_k``, wrapped,
stands for a kernel that keeps the total order. Cross-entropy is a grid over token
blocks computing per-token losses with an f32, max-subtracted logsumexp, and a
custom VJP. Each good kernel passes every check; each bug (a flipped tie rule, a slot
short of k, indices that are not the values', no max subtraction, smoothing over
V - 1) fails the values check, not by a crash; a kernel that does not validate its
input is reported (``must_refuse``).

Shapes come from few buckets, so the examples reuse a few compiled kernels per dtype
and option set; the example counts are small ones that reach each bug's inputs from
seed 0 (ties for the tie rule, NaN for the order, large logits or smoothing for the
losses).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels.backends import Backend
from pallascheck.properties import checks, runner
from pallascheck.properties.families.cross_entropy import cross_entropy_like
from pallascheck.properties.families.top_k import top_k_like
from pallascheck.properties.spec import KernelSpec

INTERPRET = Backend("interpret")
DTYPES = ("float32", "bfloat16", "float16")


def _check(spec: KernelSpec, dtype: str, examples: int, **kw) -> runner.Tally:
    return runner.run_property(spec, dtype, INTERPRET, examples=examples, seed=0, **kw)


def _refusal(spec: KernelSpec) -> checks.Outcome:
    return runner.run_errors(spec, context=checks.Context(kernel=spec.name))


# ---------------------------------------------------------------------------- top-k


def _top_k_kernel(x_ref, values_ref, indices_ref, *, steps: int, lower_index_wins: bool):
    """k rounds of: the largest value not yet taken, and the lowest (or, broken, the
    highest) index holding it. Compares numbers: NaN and -0.0 are not its promise."""
    x = x_ref[...]
    n = x.shape[1]
    cols = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    slots = lax.broadcasted_iota(jnp.int32, values_ref.shape, 1)

    def step(j, carry):
        taken, values, indices = carry
        best = jnp.max(jnp.where(taken, -jnp.inf, x), axis=1, keepdims=True)
        holders = ~taken & (x == best)  # the untaken -inf too, once only they are left
        if lower_index_wins:
            index = jnp.min(jnp.where(holders, cols, n), axis=1, keepdims=True)
        else:
            index = jnp.max(jnp.where(holders, cols, -1), axis=1, keepdims=True)
        return taken | (cols == index), jnp.where(slots == j, best, values), jnp.where(slots == j, index, indices)

    start = (jnp.zeros(x.shape, bool), jnp.zeros(values_ref.shape, x.dtype), jnp.zeros(indices_ref.shape, jnp.int32))
    _, values, indices = lax.fori_loop(0, steps, step, start)
    values_ref[...] = values
    indices_ref[...] = indices


@functools.partial(
    jax.jit,
    static_argnums=(1,),
    static_argnames=("interpret", "lower_index_wins", "one_short", "first_k_indices", "check_k"),
)
def pallas_top_k(
    x: jax.Array,
    k: int,
    *,
    interpret: bool = False,
    lower_index_wins: bool = True,
    one_short: bool = False,
    first_k_indices: bool = False,
    check_k: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """(values, indices) of the k largest per row of x [rows, n]; the flags are the bugs."""
    if check_k and not 1 <= k <= x.shape[1]:
        raise ValueError(f"k must satisfy 1 <= k <= n = {x.shape[1]}, got {k}")
    body = functools.partial(_top_k_kernel, steps=k - 1 if one_short else k, lower_index_wins=lower_index_wins)
    out_shape = (jax.ShapeDtypeStruct((x.shape[0], k), x.dtype), jax.ShapeDtypeStruct((x.shape[0], k), jnp.int32))
    values, indices = pl.pallas_call(body, out_shape=out_shape, interpret=interpret)(x)
    return values, lax.broadcasted_iota(jnp.int32, indices.shape, 1) if first_k_indices else indices


TOP_K_K, TOP_K_N = (5, 16), (37, 300)


def _top_k(
    name: str, output: str = "values_indices", ties: str = "lower_index", order: str = "numbers", **bugs
) -> KernelSpec:
    def fn(x, k, interpret):
        values, indices = pallas_top_k(x, k, interpret=interpret, **bugs)
        return {"values_indices": (values, indices), "indices_values": (indices, values), "values": values}[output]

    return top_k_like(
        fn,
        name=name,
        k=TOP_K_K,
        rows=(3,),
        n=TOP_K_N,
        output=output,
        ties=ties,
        order=order,
        backends=("interpret",),
        interpret="interpret",
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_like_passes(dtype: str) -> None:
    tally = _check(_top_k("pallas_top_k"), dtype, examples=4)
    assert not tally.failure, tally.failure
    assert {"values", "reference", "contract", "deterministic", "metamorphic"} <= set(tally.outcomes)
    assert tally.outcomes["values"].examples >= 8 and tally.outcomes["values"].budget_used == 0.0


@pytest.mark.parametrize(
    ("output", "ties", "bugs"),
    [
        ("indices_values", "lower_index", {}),
        ("values", "lower_index", {"lower_index_wins": False}),  # no indices: their tie rule is not checked
        ("values_indices", "any", {"lower_index_wins": False}),  # stated: any of equal values may come first
    ],
)
def test_top_k_like_output_and_tie_facts(output: str, ties: str, bugs: dict) -> None:
    tally = _check(
        _top_k(f"pallas_top_k[{output},{ties}]", output, ties, **bugs), "bfloat16", examples=3, selected=("values",)
    )
    assert not tally.failure, tally.failure


@pytest.mark.parametrize(
    ("output", "ties", "bugs"),
    [
        ("values_indices", "lower_index", {"lower_index_wins": False}),  # a tie rule other than the one stated
        ("values", "lower_index", {"one_short": True}),  # the k-th slot never filled: caught on the values alone
        ("values_indices", "any", {"first_k_indices": True}),  # right values, indices 0..k-1: no tie rule excuses them
    ],
)
def test_top_k_like_catches(output: str, ties: str, bugs: dict) -> None:
    tally = _check(_top_k(f"broken_top_k[{bugs}]", output, ties, **bugs), "bfloat16", examples=3, selected=("values",))
    assert tally.failure.startswith("[values]"), tally.failure or "not caught"


def test_top_k_like_order_fact() -> None:
    """Under the total order (the default) lax.top_k passes; the kernel above, which
    compares numbers, fails the values check on NaN or -0.0."""
    exact = top_k_like(
        lambda x, k, interpret: jax.lax.top_k(x, k),
        name="lax_top_k",
        k=TOP_K_K,
        rows=(3,),
        n=TOP_K_N,
        dtypes=("float32",),
        backends=("interpret",),
        interpret="interpret",
    )
    tally = _check(exact, "float32", examples=3)
    assert not tally.failure, tally.failure
    tally = _check(
        _top_k("pallas_top_k_under_the_total_order", order="total"), "float32", examples=3, selected=("values",)
    )
    assert tally.failure.startswith("[values]"), tally.failure or "not caught"


def test_top_k_like_reports_k_above_n_computed_silently() -> None:
    assert _refusal(_top_k("pallas_top_k")).passed
    outcome = _refusal(_top_k("unchecked_top_k", check_k=False))
    assert not outcome.passed and "k above n" in outcome.detail and "nothing was raised" in outcome.detail


# -------------------------------------------------------------------- cross-entropy

BLOCK_T = 8  # tokens per program: 7 tokens leave a partial block


class Bugs(NamedTuple):
    """The broken variants' switches (a static argument of the jitted function)."""

    no_max_subtraction: bool = False
    smoothing_over_v_minus_one: bool = False
    check_labels: bool = True


def _loss_kernel(z_ref, y_ref, loss_ref, *, eps: float, ignore_index: int, subtract_max: bool, smoothing_over: int):
    """Per-token loss in f32, every term a difference to the row's max:
    (log s + (1 - eps)(m - z_y)) + eps * (-(sum(z - m) / V))."""
    z = z_ref[...].astype(jnp.float32)
    y = y_ref[...][:, None]
    m = jnp.max(z, axis=1, keepdims=True) if subtract_max else jnp.zeros_like(z[:, :1])
    loss = jnp.log(jnp.sum(jnp.exp(z - m), axis=1, keepdims=True))
    if eps != 1.0:
        target = jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, z.shape, 1) == y, z, 0.0), axis=1, keepdims=True)
        loss = loss + (1.0 - eps) * (m - target)
    if eps != 0.0:
        loss = loss + eps * (-(jnp.sum(z - m, axis=1, keepdims=True) / smoothing_over))
    loss_ref[...] = jnp.where(y == ignore_index, 0.0, loss)[:, 0]


def _token_losses(logits, labels, eps, ignore_index, interpret, bugs):
    """Per-token losses [T] in f32: one program per BLOCK_T tokens."""
    tokens, vocab = logits.shape
    body = functools.partial(
        _loss_kernel,
        eps=eps,
        ignore_index=ignore_index,
        subtract_max=not bugs.no_max_subtraction,
        smoothing_over=vocab - 1 if bugs.smoothing_over_v_minus_one else vocab,
    )
    return pl.pallas_call(
        body,
        grid=(pl.cdiv(tokens, BLOCK_T),),
        in_specs=[pl.BlockSpec((BLOCK_T, vocab), lambda i: (i, 0)), pl.BlockSpec((BLOCK_T,), lambda i: (i,))],
        out_specs=pl.BlockSpec((BLOCK_T,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((tokens,), jnp.float32),
        interpret=interpret,
    )(logits, labels)


token_losses = jax.custom_vjp(_token_losses, nondiff_argnums=(2, 3, 4, 5))


def _token_losses_bwd(eps, ignore_index, interpret, bugs, residuals, g):
    """softmax as exp((z - m) - log s), minus the smoothed target, times g (plain jnp)."""
    logits, labels = residuals
    z = logits.astype(jnp.float32)
    shifted = z - jnp.max(z, axis=1, keepdims=True)
    p = jnp.exp(shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=1, keepdims=True)))
    onehot = lax.broadcasted_iota(jnp.int32, z.shape, 1) == labels[:, None]
    d = (p - jnp.where(onehot, 1.0 - eps, 0.0)) - eps / z.shape[1]
    return jnp.where((labels == ignore_index)[:, None], 0.0, g[:, None] * d).astype(logits.dtype), None


token_losses.defvjp(lambda *args: (_token_losses(*args), args[:2]), _token_losses_bwd)


@functools.partial(jax.jit, static_argnames=("reduction", "ignore_index", "label_smoothing", "interpret", "bugs"))
def _pallas_cross_entropy(logits, labels, *, reduction, ignore_index, label_smoothing, interpret, bugs):
    if bugs.check_labels and labels.shape != logits.shape[:-1]:
        raise ValueError(f"labels must have shape logits.shape[:-1] = {logits.shape[:-1]}, got {labels.shape}")
    losses = token_losses(logits, labels, float(label_smoothing), ignore_index, interpret, bugs)
    if reduction == "none":
        return losses
    return jnp.sum(losses) / jnp.maximum(jnp.sum(labels != ignore_index), 1).astype(jnp.float32)


def pallas_cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    interpret: bool = False,
    bugs: Bugs = Bugs(),
) -> jax.Array:
    """Softmax cross-entropy of logits [T, V] against int labels [T], f32 loss."""
    return _pallas_cross_entropy(
        logits,
        labels,
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        interpret=interpret,
        bugs=bugs,
    )


def _cross_entropy(name: str, differentiable: bool = True, **bugs) -> KernelSpec:
    return cross_entropy_like(
        functools.partial(pallas_cross_entropy, bugs=Bugs(**bugs)),
        name=name,
        reduction=("none", "mean"),
        ignore_index=-100,
        label_smoothing=(0.0, 0.1),
        tokens=(7,),
        vocab=(100,),
        differentiable=differentiable,
        backends=("interpret",),
        interpret="interpret",
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_like_passes(dtype: str) -> None:
    tally = _check(_cross_entropy("pallas_cross_entropy"), dtype, examples=3)
    assert not tally.failure, tally.failure
    assert {"values", "reference", "gradients", "contract", "deterministic", "metamorphic"} <= set(tally.outcomes)
    assert 0.0 < tally.outcomes["values"].budget_used <= 1.0


@pytest.mark.parametrize("bug", ["no_max_subtraction", "smoothing_over_v_minus_one"])
def test_cross_entropy_like_catches(bug: str) -> None:
    tally = _check(
        _cross_entropy(f"broken_cross_entropy[{bug}]", differentiable=False, **{bug: True}),
        "float32",
        examples=4,
        selected=("values",),
    )
    assert tally.failure.startswith("[values]"), tally.failure or "not caught"


def test_cross_entropy_like_passes_only_the_options_stated() -> None:
    """One reduction, no ignore index, no smoothing: fn gets no keyword but interpret."""
    bare = cross_entropy_like(
        lambda z, y, interpret: pallas_cross_entropy(z, y, reduction="none", interpret=interpret),
        name="bare_cross_entropy",
        tokens=(7,),
        vocab=(100,),
        differentiable=False,
        backends=("interpret",),
        interpret="interpret",
    )
    tally = _check(bare, "float32", examples=2, selected=("values",))
    assert not tally.failure, tally.failure


def test_cross_entropy_like_reports_short_labels_computed_silently() -> None:
    assert _refusal(_cross_entropy("pallas_cross_entropy")).passed
    outcome = _refusal(_cross_entropy("unchecked_cross_entropy", check_labels=False))
    assert not outcome.passed and "labels one shorter" in outcome.detail and "nothing was raised" in outcome.detail


# ---------------------------------------------------------------------------- facts


@pytest.mark.parametrize(
    "build",
    [
        lambda: top_k_like(pallas_top_k, name="x", output="indices"),
        lambda: top_k_like(pallas_top_k, name="x", ties="first"),
        lambda: top_k_like(pallas_top_k, name="x", order="bits"),
        lambda: top_k_like(pallas_top_k, name="x", k=(50,), n=(37,)),
        lambda: cross_entropy_like(pallas_cross_entropy, name="x", reduction=("avg",)),
        lambda: cross_entropy_like(pallas_cross_entropy, name="x", label_smoothing=(1.5,)),
    ],
)
def test_builders_refuse_unknown_facts(build) -> None:
    with pytest.raises(ValueError):
        build()
