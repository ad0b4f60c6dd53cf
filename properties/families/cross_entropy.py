"""KernelSpec for kernels/cross_entropy.py, with adversarial logits and labels.

Element kinds of the logits (per case):
- ``normal``: N(0, sigma^2), sigma in {1, 8};
- ``large``: 1e4 * N(0, 1): lse and z_y are large and cancel in the loss;
- ``offset``: sigma * N(0, 1) plus one offset per row of size 1e4 to 2e4, either sign:
  a loss of order 1 carried by logits of order 1e4. ``lse - z_y`` keeps only
  about 10 bits of it in f32; the accuracy contract is relative to |z - max|;
- ``near_max``: uniform in [max/4, max/2] of the dtype (label smoothing 0: the sum of
  a row's logits would overflow f32, which the kernel documents; reduction "none":
  the sum of such per-token losses overflows f32 as well);
- ``one_finite``: every logit -inf except one per row, placed at a tile boundary
  (0, 63, 64, 127, 128) or at the last index V-1, and the label on it (smoothing 0);
- ``few_distinct``: three distinct values (ties in the max).
Labels: uniform, or pinned to 0 / V-1; a fraction of them (0, 30 %, or all) set to
``ignore_index``. Smoothing in {0, 0.1, 1}; every reduction.

The metamorphic relation adds a constant per token (0, up to 50 or up to 5000). The
shifted logits are rounded to the dtype, so the exact losses of the two inputs differ
by the effect of that rounding; the oracle computes it, and the allowed gap is both
accuracy contracts plus it: a loss whose error grows with |z| breaks it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels import cross_entropy as ce
from pallascheck.kernels.backends import GENERIC, Backend, get_backend
from pallascheck.oracles import cross_entropy as oracle
from pallascheck.oracles.tolerance import Arithmetic, arithmetic_for
from pallascheck.properties import builders, relations, strategies
from pallascheck.properties.spec import (
    BadInput,
    Case,
    GradientSpec,
    KernelSpec,
    Relation,
    config_fields,
)

DTYPES = ("float32", "bfloat16", "float16")
LEADING_SHAPES = ((1,), (7,), (3, 11))  # tokens 1, 7, 33
VOCABS = (16, 100, 300)  # 100 and 300 leave a partial last tile
LOGIT_KINDS = ("normal", "large", "offset", "near_max", "one_finite", "few_distinct")
SMOOTHING = (0.0, 0.1, 1.0)
EXACT_KINDS = ("near_max", "one_finite")  # drawn without smoothing: their exact loss is known
IGNORE_INDEX = -100
IGNORED = (0.0, 0.3, 1.0)  # fractions of the tokens labelled ignore_index
ONE_FINITE_AT = (0, 63, 64, 127, 128)  # tile boundaries of the 64/128-column tiles


def logits_of(seed: int, tokens: int, vocab: int, dtype: str, kind: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(logits [tokens, vocab] in ``dtype``, labels forced by the kind or None)."""
    rng = np.random.default_rng(seed)
    np_dtype = strategies.np_dtype(dtype)
    top = float(ml_dtypes.finfo(np_dtype).max)
    forced = None
    if kind == "normal":
        z = rng.standard_normal((tokens, vocab)) * rng.choice([1.0, 8.0])
    elif kind == "large":
        z = 1e4 * rng.standard_normal((tokens, vocab))
    elif kind == "offset":
        offset = rng.choice([-1.0, 1.0], (tokens, 1)) * rng.uniform(1e4, 2e4, (tokens, 1))
        z = offset + rng.standard_normal((tokens, vocab)) * rng.choice([1.0, 8.0])
    elif kind == "near_max":
        z = rng.uniform(top / 4, top / 2, (tokens, vocab))
    elif kind == "one_finite":
        z = np.full((tokens, vocab), -np.inf)
        places = [p for p in ONE_FINITE_AT if p < vocab] + [vocab - 1]
        forced = rng.choice(places, size=tokens)
        z[np.arange(tokens), forced] = rng.standard_normal(tokens) * 4
    elif kind == "few_distinct":
        z = rng.choice(rng.standard_normal(3) * 4, size=(tokens, vocab))
    else:
        raise ValueError(f"logit kind must be one of {LOGIT_KINDS}, got {kind!r}")
    return z.astype(np_dtype), forced


@dataclasses.dataclass(frozen=True)
class Domain:
    """The inputs a kernel accepts: the default is everything kernels/cross_entropy.py
    accepts (vocabulary-parallel cases are tests/test_losses.py's)."""

    leading: tuple[tuple[int, ...], ...] = LEADING_SHAPES
    vocab: tuple[int, ...] = VOCABS
    label_smoothing: tuple[float, ...] = SMOOTHING
    ignore_index: int = IGNORE_INDEX
    ignored: tuple[float, ...] = IGNORED  # (0.0,): it ignores no label
    reductions: tuple[str, ...] = ce.REDUCTIONS


DOMAIN = Domain()


def cases(
    dtype: str, backend: Backend, regime: Mapping[str, Any] | None = None, domain: Domain = DOMAIN
) -> st.SearchStrategy[Case]:
    """Drawn cases from ``domain``; ``regime`` pins some choices (keys "kind",
    "ignored", "label_smoothing", "reduction") to aim a campaign at one part of it."""
    regime = dict(regime or {})

    def pick(key: str, options: Any) -> st.SearchStrategy[Any]:
        return st.just(regime[key]) if key in regime else st.sampled_from(options)

    @st.composite
    def draw(draw_) -> Case:
        leading = draw_(strategies.layout_choice("cross_entropy.leading", domain.leading))
        vocab = draw_(strategies.layout_choice("cross_entropy.vocab", domain.vocab))
        tokens = int(np.prod(leading))
        # near_max per-token losses reach max/4: their sum would overflow f32; near_max
        # and one_finite are the cases with a known exact loss, which smoothing would change.
        pinned_kind = regime.get("kind")
        reductions = ("none",) if pinned_kind == "near_max" else domain.reductions
        reduction = draw_(strategies.layout("cross_entropy.reduction", pick("reduction", reductions)))
        smoothing = (0.0,) if pinned_kind in EXACT_KINDS else domain.label_smoothing
        eps = draw_(strategies.layout("cross_entropy.label_smoothing", pick("label_smoothing", smoothing)))
        kinds = [
            k
            for k in LOGIT_KINDS
            if not (k == "near_max" and reduction != "none") and not (k in EXACT_KINDS and eps != 0.0)
        ]
        kind = draw_(pick("kind", ()) if "kind" in regime else strategies.element_kinds(kinds))
        seed = draw_(strategies.seeds())
        rng = np.random.default_rng(seed + 1)
        logits, forced = logits_of(seed, tokens, vocab, dtype, kind)
        pinned = draw_(st.sampled_from(("uniform", "first", "last")))
        labels = {
            "uniform": rng.integers(0, vocab, tokens),
            "first": np.zeros(tokens, np.int64),
            "last": np.full(tokens, vocab - 1),
        }[pinned]
        if forced is not None:
            labels = forced
        ignored = rng.random(tokens) < draw_(pick("ignored", domain.ignored))
        labels = np.where(ignored, domain.ignore_index, labels).astype(np.int32)
        out_shape = leading if reduction == "none" else ()
        return Case(
            arrays={
                "logits": logits.reshape(leading + (vocab,)),
                "labels": labels.reshape(leading),
                "cotangent": rng.standard_normal(out_shape).astype(np.float32),
                "shift": (rng.uniform(-50, 50, leading) * rng.choice([0.0, 1.0, 100.0])).astype(np.float64),
            },
            params={"label_smoothing": eps, "ignore_index": domain.ignore_index, "reduction": reduction},
        )

    return draw()


def _kwargs(case: Case) -> dict[str, Any]:
    p = case.params
    return dict(label_smoothing=p["label_smoothing"], ignore_index=p["ignore_index"], reduction=p["reduction"])


def _oracle(case: Case) -> oracle.CrossEntropyOracle:
    p = case.params
    return oracle.oracle(
        case.arrays["logits"],
        case.arrays["labels"],
        eps=p["label_smoothing"],
        ignore_index=p["ignore_index"],
        reduction=p["reduction"],
    )


def _block_v(config: Any, case: Case) -> int | None:
    # config None: xla_reference, one tile in unknown order and its own finish; a
    # block of None: the whole vocabulary in any order, the contract
    return None if config is None else config.block_v or case.arrays["logits"].shape[-1]


def _bound(case: Case, ref: oracle.CrossEntropyOracle, config: Any, arith: Arithmetic) -> np.ndarray:
    return oracle.loss_bound(ref, arith=arith, block_v=_block_v(config, case))


def _gradient_bound(case: Case, ref, grads, config: Any, arith: Arithmetic) -> dict[str, np.ndarray]:
    logits = case.arrays["logits"]
    bounds = oracle.gradient_bound(
        ref, case.arrays["cotangent"], logits_dtype=logits.dtype, arith=arith, block_v=_block_v(config, case)
    )
    return {"dlogits": bounds["dlogits"].reshape(logits.shape)}


def _contract(case: Case, ref: oracle.CrossEntropyOracle, arith: Arithmetic) -> np.ndarray:
    return oracle.contract_bound(ref, arith=arith)


def _gradient_contract(case: Case, ref, grads, arith: Arithmetic) -> dict[str, np.ndarray]:
    logits = case.arrays["logits"]
    bounds = oracle.gradient_contract(ref, case.arrays["cotangent"], logits_dtype=logits.dtype, arith=arith)
    return {"dlogits": bounds["dlogits"].reshape(logits.shape)}


def _oracle_vjp(case: Case, ref: oracle.CrossEntropyOracle) -> dict[str, np.ndarray]:
    return {"dlogits": oracle.oracle_vjp(ref, case.arrays["cotangent"])["dlogits"].reshape(case.arrays["logits"].shape)}


def _sharded_vjp(
    kernel: Callable[..., jax.Array],
    logits: jax.Array,
    labels: jax.Array,
    cotangent: jax.Array,
    axis_name: str,
    case: Case,
    config: Any,
    backend: Backend,
) -> tuple[jax.Array, jax.Array]:
    """One vocabulary shard's loss and its gradient, differentiated inside the shard."""
    loss, pullback = jax.vjp(
        lambda z: kernel(z, labels, config=config, backend=backend, axis_name=axis_name, **_kwargs(case)), logits
    )
    return loss, pullback(cotangent)[0]


def _shifted(case: Case) -> Case:
    logits = case.arrays["logits"]
    moved = (logits.astype(np.float64) + case.arrays["shift"][..., None]).astype(logits.dtype)
    return Case({**case.arrays, "logits": moved}, case.params)


SHARD_COUNTS = (4, 3, 2)  # the vocabulary splits the sharded relation tries, most shards first


def vocab_sharded(run_vjp: Callable[..., tuple[jax.Array, jax.Array]]) -> Relation:
    """The vocabulary-parallel kernel (``axis_name``) on every case: the logits' last
    axis split into the most shards of ``SHARD_COUNTS`` that divide it, each shard a
    member of ``jax.vmap`` over a named axis, so the kernel's pmax, psum and
    axis_index combine the shards in this process, without a mesh of devices (the
    multi-device property, verify's distributed unit, runs the same code under
    shard_map on several CPU devices, and only there). Every shard's loss and its
    slice of the gradient (each shard differentiates its own part, as under shard_map)
    must be within the sharded bound (oracles/cross_entropy.py, ``shards``) of the
    float64 oracle; ignored labels fall on every shard. ``run_vjp(logits, labels,
    cotangent, axis_name, case, config, backend)`` returns (loss, dlogits) of one
    shard."""

    def relation(case: Case, config: Any, backend: Backend, out: np.ndarray):
        logits = case.arrays["logits"]
        shards = next((n for n in SHARD_COUNTS if logits.shape[-1] % n == 0), None)
        if shards is None:  # a prime vocabulary: no equal shards
            return np.asarray(out), np.asarray(out), np.float64(0.0)
        split = jnp.asarray(np.stack(np.split(logits, shards, axis=-1)))
        labels, cotangent = (jnp.asarray(case.arrays[a]) for a in ("labels", "cotangent"))
        loss, per_shard = jax.vmap(
            lambda z: run_vjp(z, labels, cotangent, "vocab", case, config, backend), axis_name="vocab"
        )(split)
        dlogits = np.concatenate(list(np.asarray(per_shard)), axis=-1)
        ref = _oracle(case)
        arith = arithmetic_for(backend)
        block_v = _block_v(config, case)
        loss_bound = oracle.loss_bound(ref, arith=arith, block_v=block_v, shards=shards)
        grad_bound = oracle.gradient_bound(
            ref, case.arrays["cotangent"], logits_dtype=logits.dtype, arith=arith, block_v=block_v, shards=shards
        )["dlogits"]
        exact = oracle.oracle_vjp(ref, case.arrays["cotangent"])["dlogits"]
        every_shard = lambda a: np.broadcast_to(a, (shards,) + np.shape(a)).ravel()  # noqa: E731
        lhs = np.concatenate([np.asarray(loss, np.float64).ravel(), dlogits.astype(np.float64).ravel()])
        rhs = np.concatenate([every_shard(ref.out), np.reshape(exact, -1)])
        return lhs, rhs, np.concatenate([every_shard(loss_bound), np.reshape(grad_bound, -1)])

    return Relation("vocab_sharded", relation)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The tiling of a cross-entropy kernel that is not ours: the vocabulary columns
    per step of its running-max logsumexp (None, unknown: the whole vocabulary in one
    sum in any order, the contract)."""

    block_v: int | None = None


def make_spec(
    kernel: Callable[..., jax.Array] = ce.cross_entropy,
    name: str = "cross_entropy",
    *,
    domain: Domain = DOMAIN,
    blocks: Blocks | None = None,
    dtypes: Sequence[str] = DTYPES,
    differentiable: bool = True,
    backends: Sequence[str] = GENERIC,
    bad_inputs: Callable[[], Sequence[BadInput]] | None = None,
    regime: Mapping[str, Any] | None = None,
) -> KernelSpec:
    """The spec for ``kernel`` (default: the shipped one; any callable with its
    signature); ``regime`` pins parts of the case strategy (see ``cases``);
    ``blocks``: the tiling of a kernel that is not ours (one "config"; the default
    checks ours over its config space)."""

    def run(case: Case, config: Any, backend: Backend) -> jax.Array:
        return kernel(
            jnp.asarray(case.arrays["logits"]),
            jnp.asarray(case.arrays["labels"]),
            config=config,
            backend=backend,
            **_kwargs(case),
        )

    def run_reference(case: Case) -> jax.Array:
        return ce.xla_reference(jnp.asarray(case.arrays["logits"]), jnp.asarray(case.arrays["labels"]), **_kwargs(case))

    def kernel_vjp(case: Case, config: Any, backend: Backend) -> dict[str, jax.Array]:
        labels = jnp.asarray(case.arrays["labels"])
        fn = lambda z: kernel(z, labels, config=config, backend=backend, **_kwargs(case))  # noqa: E731
        _, pullback = jax.vjp(fn, jnp.asarray(case.arrays["logits"]))
        (dz,) = pullback(jnp.asarray(case.arrays["cotangent"]))
        return {"dlogits": dz}

    def configs(case: Case, backend: Backend) -> Sequence[Any]:
        return ce.configs(int(case.arrays["labels"].size), case.arrays["logits"].shape[-1], backend)

    return KernelSpec(
        name=name,
        dtypes=dtypes,
        cases=functools.partial(cases, regime=regime, domain=domain),
        kernel=run,
        reference=run_reference,
        oracle=_oracle,
        expected=lambda ref: ref.out,
        bound=_bound,
        contract=_contract,
        **config_fields(blocks, configs, ce.Config()),
        gradients=GradientSpec(kernel_vjp, _oracle_vjp, _gradient_bound, contract=_gradient_contract)
        if differentiable
        else None,
        relations=(relations.invariance_within_contract("shift_invariance", run, _shifted, _oracle, _contract),)
        + ((vocab_sharded(functools.partial(_sharded_vjp, kernel)),) if blocks is None and differentiable else ()),
        adversarial=_adversarial,
        bad_inputs=bad_inputs or _bad_inputs(kernel),
        backends=backends,
    )


def _adversarial(case: Case, seed: int) -> list[Case]:
    """The logits redrawn with each kind at case's shape, labels kept (or placed on the
    one finite logit); the kinds whose exact loss needs smoothing 0, or whose row sums
    overflow a reduced loss, only where the case allows them (as ``cases`` draws)."""
    logits, labels, p = case.arrays["logits"], case.arrays["labels"], case.params
    tokens, vocab = int(np.prod(logits.shape[:-1])), logits.shape[-1]
    out = []
    for i, kind in enumerate(LOGIT_KINDS):
        if (kind in EXACT_KINDS and p["label_smoothing"] != 0.0) or (kind == "near_max" and p["reduction"] != "none"):
            continue
        z, forced = logits_of(seed + i, tokens, vocab, logits.dtype.name, kind)
        y = (
            labels
            if forced is None
            else np.where(labels.reshape(-1) == p["ignore_index"], labels.reshape(-1), forced)
            .astype(labels.dtype)
            .reshape(labels.shape)
        )
        out.append(Case({**case.arrays, "logits": z.reshape(logits.shape), "labels": y}, p))
    return out


def _bad_inputs(fn: Callable[..., jax.Array]) -> Callable[[], list[BadInput]]:
    def bad() -> list[BadInput]:
        z = jnp.zeros((4, 10), jnp.float32)
        y = jnp.zeros((4,), jnp.int32)
        return [
            BadInput(
                "float labels",
                lambda: fn(z, jnp.zeros((4,), jnp.float32)),
                TypeError,
                r"labels must have an integer dtype",
            ),
            BadInput(
                "labels shape",
                lambda: fn(z, jnp.zeros((4, 1), jnp.int32)),
                ValueError,
                r"labels must have shape logits.shape\[:-1\] = \(4,\)",
            ),
            BadInput(
                "label >= V",
                lambda: fn(z, y.at[2].set(10)),
                ValueError,
                r"labels must lie in \[0, V\) = \[0, 10\).*labels\[2\] = 10",
            ),
            BadInput("negative label", lambda: fn(z, y.at[1].set(-1)), ValueError, r"labels\[1\] = -1"),
            BadInput("reduction", lambda: fn(z, y, reduction="avg"), ValueError, r"reduction must be one of"),
            BadInput(
                "smoothing > 1",
                lambda: fn(z, y, label_smoothing=1.5),
                ValueError,
                r"label_smoothing must be a float in \[0, 1\]",
            ),
            BadInput(
                "integer logits", lambda: fn(jnp.zeros((4, 10), jnp.int32), y), TypeError, r"logits must have dtype in"
            ),
            BadInput("rank-0 logits", lambda: fn(jnp.float32(0.0), y), ValueError, r"logits must have rank >= 1"),
            BadInput(
                "config type", lambda: fn(z, y, config=(16, 128)), TypeError, r"config must be a cross_entropy.Config"
            ),
            BadInput(
                "block_v", lambda: ce.Config(block_v=100), ValueError, r"config.block_v must be a power of two >= 16"
            ),
        ]

    return bad


SPEC = make_spec()


# ------------------------------------------------------------------------ builder

TOKENS = (1, 7, 33)  # the token counts of LEADING_SHAPES, as the rows of 2-D logits


def cross_entropy_like(
    fn: Callable[..., jax.Array],
    *,
    name: str,
    reduction: Sequence[str] = ("none",),
    ignore_index: int | None = None,
    label_smoothing: Sequence[float] = (0.0,),
    blocks: Blocks = Blocks(),
    tokens: Sequence[int] = TOKENS,
    vocab: Sequence[int] = VOCABS,
    dtypes: Sequence[str] = DTYPES,
    differentiable: bool = True,
    backends: Sequence[str] = GENERIC,
    interpret: str | None = None,
) -> KernelSpec:
    """The spec of a user's softmax cross-entropy ``fn(logits, labels, **options)``
    for logits [tokens, vocab] (f32, bf16 or f16; finite or -inf) and int32 labels
    [tokens], the loss in float32, with our semantics (kernels/cross_entropy.py): per
    token ``lse - (1 - eps) z_y - eps mean_j z_j``; a token labelled ``ignore_index``
    adds 0 and gets gradient 0; "mean" is over the tokens not ignored (0 if none).

    - ``reduction``: the reductions it computes. One ("none": per-token losses
      [tokens], "sum" or "mean"): it takes no keyword; several: passed as ``reduction=``;
    - ``ignore_index``: None: it ignores no label (no keyword; no token drawn
      ignored); an int: passed as ``ignore_index=``, and no, some or all tokens get it;
    - ``label_smoothing``: the eps it is called with; ``(0.0,)``: it has none (no
      keyword), else passed as ``label_smoothing=``;
    - ``blocks``: the vocabulary block of its running-max logsumexp, for the bound;
    - ``tokens``, ``vocab``: the sizes it accepts;
    - ``differentiable``: its VJP in the logits is checked against the float64 one;
    - ``backends`` / ``interpret``: see ``builders.call_on``.
    Its accuracy contract and the shift-invariance relation hold whatever the blocks:
    the error may grow with |z - max|, never with |z|.
    """
    if not reduction or any(r not in ce.REDUCTIONS for r in reduction):
        raise ValueError(f"reduction must be a non-empty sequence of {ce.REDUCTIONS}, got {reduction!r}")
    if any(not 0.0 <= eps <= 1.0 for eps in label_smoothing):
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing!r}")
    domain = Domain(
        leading=tuple((t,) for t in tokens),
        vocab=tuple(vocab),
        label_smoothing=tuple(label_smoothing),
        ignore_index=IGNORE_INDEX if ignore_index is None else ignore_index,
        ignored=(0.0,) if ignore_index is None else IGNORED,
        reductions=tuple(reduction),
    )
    passed = {
        "reduction": len(domain.reductions) > 1,
        "ignore_index": ignore_index is not None,
        "label_smoothing": any(eps != 0.0 for eps in domain.label_smoothing),
    }

    def adapted(logits, labels, *, config=None, backend=None, **options):
        del config  # the blocks are fixed
        options = {key: value for key, value in options.items() if passed[key]}
        return builders.call_on(fn, get_backend(backend), backends, interpret, logits, labels, **options)

    def bad() -> list[BadInput]:
        chosen = builders.checking_backend(backends)
        z = jnp.zeros((max(tokens), max(vocab)), dtypes[-1])
        short = jnp.zeros((max(tokens) - 1,), jnp.int32)
        options = dict(
            reduction=domain.reductions[0], ignore_index=domain.ignore_index, label_smoothing=domain.label_smoothing[0]
        )
        return [
            builders.must_refuse(
                "labels one shorter than the tokens", lambda: adapted(z, short, backend=chosen, **options)
            )
        ]

    spec = make_spec(
        adapted,
        name,
        domain=domain,
        blocks=blocks,
        dtypes=dtypes,
        differentiable=differentiable,
        backends=backends,
        bad_inputs=bad,
    )
    return builders.backward_on_backend(spec, interpret)
