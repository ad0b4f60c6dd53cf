"""KernelSpec for kernels/top_k.py: exact, so every check is bit for bit.

The kernel's two outputs are compared as one float64 array per case,
``[bit patterns of the values | indices]`` (oracles/top_k.encode), with a bound of
zero: a NaN's sign and payload, -0.0 vs +0.0, and every index must match exactly.

Cases come from small shape buckets (compiles are reused) and adversarial element
kinds: ties (few distinct values, all equal, +-0.0), degenerate 16-bit patterns
(every bf16/f16 bit pattern equally likely: at most 65536 distinct values, many ties
in long rows), the strided worst case (every s-th logit 1, the rest 0: one block
holds all the large values, which forces the deepest m stage), log-probabilities
(all negative, catches a compare on raw float bits; from logits on a coarse grid, so
with ties) and sprinkled NaN/+-inf/-0.0. NaNs are the
canonical quiet NaN of either sign: ``lax.top_k`` on the CPU orders NaN payloads
for f32/f16 but not for bf16 (see kernels/top_k.py), and xla_reference is checked
against the same oracle.

The kernel is checked bit for bit everywhere. xla_reference is too, with one
exception where ``lax.top_k``'s own observed behaviour differs: a **bf16** NaN that it
returns is compared as the input's bits at the index it returned (on the GPU,
H200/jax 0.11.2, it returns every bf16 NaN as 0x7FFF, a -NaN included). So its
indices stay exact (which NaN it picked, and that -NaN ranks last), its value must
still be a NaN exactly where the input holds one; only the NaN's sign and payload
bits in its *values* are not held against it. f32/f16 values and all non-NaN bf16
values are compared bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels import top_k
from pallascheck.kernels.backends import GENERIC, Backend, get_backend
from pallascheck.oracles import top_k as oracle
from pallascheck.oracles.tolerance import Arithmetic
from pallascheck.properties import builders, relations, strategies
from pallascheck.properties.spec import (
    BadInput,
    Case,
    KernelSpec,
    Relation,
    config_fields,
)

# Hypothesis starts from the first entry of each bucket, so each bucket leads with a
# hard case: several stages run and stop early, and the candidates reach deep slots.
TOKENS = (3, 1, 9)  # 9: a partial last token block for block_tokens 8
VOCABS = (300, 37, 1000)  # 300 and 37 are multiples of none of the block counts 8, 32, 128
KS = (16, 5, 33, 1, 2, 8)
ELEMENT_KINDS = (
    "log_probs",
    "few_distinct",
    "degenerate_bits",
    "strided_ones",
    "all_equal",
    "signed_zeros",
    "normal",
    "specials",
)
STRIDES = (8, 32, 128)  # the block counts of the configs: all large values in one block


def logits(seed: int, shape: tuple[int, int], dtype: str, kind: str) -> np.ndarray:
    """An adversarial logits array of ``kind`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    np_dtype = strategies.np_dtype(dtype)
    if kind == "normal":
        return strategies.elements(seed, shape, dtype, "normal")
    if kind == "few_distinct":
        return strategies.elements(seed, shape, dtype, "few_distinct")
    if kind == "all_equal":
        return np.full(shape, rng.standard_normal()).astype(np_dtype)
    if kind == "signed_zeros":
        return np.where(rng.random(shape) < 0.5, -0.0, 0.0).astype(np_dtype)
    if kind == "degenerate_bits":
        half = rng.integers(0, 2**16, shape, dtype=np.uint32)
        values = (half << 16).view(np.float32) if np_dtype.itemsize == 4 else half.astype(np.uint16).view(np_dtype)
        values = values.astype(np_dtype) if np_dtype.itemsize == 4 else values
        nan = np.isnan(values.astype(np.float32))
        canonical = np.where(np.signbit(values.astype(np.float32)), -np.nan, np.nan)
        return np.where(nan, canonical, values.astype(np.float32)).astype(np_dtype)
    if kind == "strided_ones":
        stride = int(rng.choice(STRIDES))
        values = np.zeros(shape)
        values[:, ::stride] = 1.0
        return values.astype(np_dtype)
    if kind == "log_probs":  # all negative, as top-k over log-probabilities sees them;
        # logits on a grid of 1/4 (as from a low-precision matmul): ties between blocks
        z = np.round(rng.standard_normal(shape) * 12.0) / 4.0
        z = z - z.max(axis=-1, keepdims=True)
        return (z - np.log(np.exp(z).sum(axis=-1, keepdims=True))).astype(np_dtype)
    if kind == "specials":
        values = strategies.with_specials(seed + 1, strategies.elements(seed, shape, dtype, "normal"), 0.1)
        flip = rng.random(shape) < 0.3  # negative NaNs and -0.0 too
        values = np.where(flip & (np.isnan(values.astype(np.float32)) | (values == 0)), -values, values)
        values[rng.random(shape) < 0.05] = -0.0
        return values.astype(np_dtype)
    raise ValueError(f"element kind must be one of {ELEMENT_KINDS}, got {kind!r}")


def numbers_only(values: np.ndarray) -> np.ndarray:
    """``values`` with every NaN made the infinity of its sign and -0.0 made +0.0:
    where the total order and the order of numbers (NaN unordered, -0.0 == +0.0)
    part ways, nothing is left."""
    wide = values.astype(np.float32)
    wide = np.where(np.isnan(wide), np.where(np.signbit(wide), -np.inf, np.inf), wide)
    return np.where(wide == 0.0, 0.0, wide).astype(values.dtype)


@dataclasses.dataclass(frozen=True)
class Domain:
    """The inputs a kernel accepts: the default is everything kernels/top_k.py accepts."""

    tokens: tuple[int, ...] = TOKENS
    vocab: tuple[int, ...] = VOCABS
    ks: tuple[int, ...] = KS  # each case draws a k <= its vocab
    # False: the logits hold no NaN and no -0.0 (``numbers_only``), for a kernel that
    # compares them as numbers and so promises nothing about the total order there
    total_order: bool = True


DOMAIN = Domain()
# Under the order of numbers signed_zeros is all_equal again.
NUMBER_KINDS = tuple(kind for kind in ELEMENT_KINDS if kind != "signed_zeros")


def cases(dtype: str, backend: Backend, domain: Domain = DOMAIN) -> st.SearchStrategy[Case]:
    @st.composite
    def draw(draw_) -> Case:
        tokens, vocab = (
            draw_(strategies.layout_choice(f"top_k.{a}", bucket))
            for a, bucket in (("tokens", domain.tokens), ("vocab", domain.vocab))
        )
        k = draw_(strategies.layout_choice("top_k.k", [k for k in domain.ks if k <= vocab]))
        kind = draw_(strategies.element_kinds(ELEMENT_KINDS if domain.total_order else NUMBER_KINDS))
        seed = draw_(strategies.seeds())
        x = logits(seed, (tokens, vocab), dtype, kind)
        return Case(arrays={"logits": x if domain.total_order else numbers_only(x)}, params={"k": k, "kind": kind})

    return draw()


def _run(kernel: Callable[..., Any], case: Case, config: Any, backend: Backend) -> np.ndarray:
    values, indices = kernel(jnp.asarray(case.arrays["logits"]), case.params["k"], config=config, backend=backend)
    return oracle.encode(np.asarray(values), np.asarray(indices))


def _reference(case: Case) -> np.ndarray:
    x = case.arrays["logits"]
    values, indices = top_k.xla_reference(jnp.asarray(x), case.params["k"])
    values, indices = np.asarray(values), np.asarray(indices)
    if values.dtype == ml_dtypes.bfloat16:  # lax.top_k canonicalises bf16 NaNs (module docstring)
        picked = np.take_along_axis(x, np.clip(indices, 0, x.shape[1] - 1), axis=1)
        values = np.where(np.isnan(values) & np.isnan(picked), picked, values)
    return oracle.encode(values, indices)


def _oracle(case: Case) -> oracle.TopKOracle:
    return oracle.oracle(case.arrays["logits"], case.params["k"])


def _bound(case: Case, ref: oracle.TopKOracle, config: Any, arith: Arithmetic) -> np.ndarray:
    return oracle.bound(ref)


def mirrored(config: top_k.Config, k: int, backend: Backend) -> top_k.Config | None:
    """``config`` in the other slot layout and the other stop state, where the
    interpreters compile the unrolled layout cheaply (k up to
    top_k.UNROLLED_INTERPRETED_MAX_K); None past it and off the interpreters (a TPU or
    GPU lowers only the forms its backend picks)."""
    if not backend.is_interpreted or k > top_k.UNROLLED_INTERPRETED_MAX_K:
        return None
    stacked, scalars = top_k.forms(config, backend)
    return dataclasses.replace(
        config, layout="unrolled" if stacked else "stacked", stop_state="vector" if scalars else "scalars"
    )


def forms_agree(run: Callable[[Case, Any, Backend], np.ndarray]) -> Relation:
    """The kernel's other forms give the same bits: the slot layout (stacked, as the
    interpreters and the TPU run it, or unrolled, as Triton does) and the stop state
    (a vector, or SMEM scalars as on a TPU), both flipped in one more compiled kernel,
    on every case with k <= top_k.UNROLLED_INTERPRETED_MAX_K (past it, the output is
    compared with itself): the drawn config's slots and stages, so the deep configs
    (8 blocks, several stages, rows that stop at different stages) run the other
    forms too. Selection is exact: the bound is 0."""

    def relation(case: Case, config: Any, backend: Backend, out: np.ndarray):
        other = mirrored(config, case.params["k"], backend)
        if other is None:
            return np.asarray(out), np.asarray(out), np.float64(0.0)
        return np.asarray(run(case, other, backend)), np.asarray(out), np.float64(0.0)

    return Relation("forms_agree", relation)


def _bad_inputs() -> list[BadInput]:
    x = jnp.ones((2, 50), jnp.float32)
    return [
        BadInput(
            "rank-3 logits", lambda: top_k.top_k(jnp.ones((2, 3, 50)), 4), ValueError, r"logits must have rank 2.*vmap"
        ),
        BadInput(
            "integer logits",
            lambda: top_k.top_k(jnp.ones((2, 50), jnp.int32), 4),
            TypeError,
            r"logits must have dtype in",
        ),
        BadInput("k zero", lambda: top_k.top_k(x, 0), ValueError, r"k must satisfy 1 <= k"),
        BadInput("k above vocab", lambda: top_k.top_k(x, 51), ValueError, r"k must satisfy 1 <= k <= min\(vocab"),
        BadInput("k not an int", lambda: top_k.top_k(x, cast(Any, 4.0)), TypeError, r"k must be an int"),
        BadInput(
            "empty logits", lambda: top_k.top_k(jnp.ones((0, 50)), 4), ValueError, r"logits must not have a zero-sized"
        ),
        BadInput(
            "config type",
            lambda: top_k.top_k(x, 4, config=cast(Any, {"num_blocks": 8})),
            TypeError,
            r"config must be a top_k.Config",
        ),
        BadInput(
            "blocks not power of two",
            lambda: top_k.Config(num_blocks=100),
            ValueError,
            r"config.num_blocks must be a power of two",
        ),
        BadInput(
            "schedule not increasing",
            lambda: top_k.Config(m_schedule=(9, 5)),
            ValueError,
            r"config.m_schedule must be a strictly increasing",
        ),
        BadInput(
            "schedule below 2",
            lambda: top_k.Config(m_schedule=(1, 5)),
            ValueError,
            r"config.m_schedule must be .* >= 2",
        ),
        BadInput("unknown layout", lambda: top_k.Config(layout="packed"), ValueError, r"config.layout must be one of"),
        BadInput(
            "unknown stop state",
            lambda: top_k.Config(stop_state="smem"),
            ValueError,
            r"config.stop_state must be one of",
        ),
    ]


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The one config of a top-k kernel that is not ours. Selection does no
    arithmetic, so no block size enters its bound (zero): there is nothing to state."""


def make_spec(
    kernel: Callable[..., Any] = top_k.top_k,
    name: str = "top_k",
    *,
    domain: Domain = DOMAIN,
    blocks: Blocks | None = None,
    dtypes: Sequence[str] = strategies.DTYPES,
    backends: Sequence[str] = GENERIC,
    bad_inputs: Callable[[], Sequence[BadInput]] | None = None,
) -> KernelSpec:
    """The top_k spec for ``kernel`` (any callable with top_k.top_k's signature).
    ``blocks``: a kernel that is not ours (one "config"; the default checks ours over
    its config space)."""
    run = functools.partial(_run, kernel)

    def configs(case: Case, backend: Backend) -> Sequence[Any]:
        return top_k.configs(*cast(tuple[int, int], case.arrays["logits"].shape), case.params["k"], backend)

    return KernelSpec(
        name=name,
        dtypes=dtypes,
        cases=functools.partial(cases, domain=domain),
        kernel=run,
        reference=_reference,
        oracle=_oracle,
        expected=lambda ref: ref.out,
        bound=_bound,
        # Selection is exact: any correct top-k returns these values and indices, so
        # the op's contract is the implementation bound, 0.
        contract=lambda case, ref, arith: oracle.bound(ref),
        **config_fields(blocks, configs, top_k.Config()),
        relations=(
            relations.row_permutation(("logits",), run, lambda case, config, backend: oracle.bound(_oracle(case))),
        )
        + ((forms_agree(run),) if blocks is None else ()),
        bad_inputs=bad_inputs or _bad_inputs,
        backends=backends,
    )


SPEC = make_spec()


# ------------------------------------------------------------------------ builder

OUTPUTS = ("values_indices", "indices_values", "values")
TIES = ("lower_index", "any")
ORDERS = ("total", "numbers")


def lowest_indices(x: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The indices our tie rule gives ``values`` [rows, k] taken from ``x`` [rows, n]:
    the r-th value of a bit pattern gets the r-th lowest index of x holding that
    pattern, -1 where x holds it fewer times (values that are not x's). For the
    right values these are the oracle's indices: it takes each tie group in index
    order."""
    out = np.full(values.shape, -1, np.int64)
    if values.dtype != x.dtype:  # the values check fails; their bits are no pattern of x
        return out
    x_bits, value_bits = oracle.bits(x), oracle.bits(values)
    for row in range(values.shape[0]):
        seen: dict[int, int] = {}
        for slot, pattern in enumerate(value_bits[row].tolist()):
            holders = np.flatnonzero(x_bits[row] == pattern)
            rank = seen[pattern] = seen.get(pattern, -1) + 1
            if rank < holders.size:
                out[row, slot] = holders[rank]
    return out


def points_at(x: np.ndarray, values: np.ndarray, indices: np.ndarray) -> bool:
    """Whether ``indices`` are one valid choice for ``values``: in range, each at most
    once per row, and x holds each value's bit pattern at its index."""
    if indices.shape != values.shape or values.dtype != x.dtype:
        return False
    if ((indices < 0) | (indices >= x.shape[1])).any():
        return False
    once = all(np.unique(row).size == row.size for row in indices)
    return once and bool((oracle.bits(np.take_along_axis(x, indices, axis=1)) == oracle.bits(values)).all())


def top_k_like(
    fn: Callable[..., Any],
    *,
    name: str,
    k: Sequence[int] = KS,
    rows: Sequence[int] = TOKENS,
    n: Sequence[int] = VOCABS,
    output: str = "values_indices",
    ties: str = "lower_index",
    order: str = "total",
    dtypes: Sequence[str] = strategies.DTYPES,
    backends: Sequence[str] = GENERIC,
    interpret: str | None = None,
) -> KernelSpec:
    """The spec of a user's top-k along the last axis, ``fn(x, k)`` for x [rows, n]
    (f32, bf16 or f16) and a Python int k: per row the k largest values, largest
    first, in x's dtype, and their indices in the row. Selection does no arithmetic:
    values are compared bit for bit, indices exactly.

    - ``output``: what it returns: "values_indices" ((values, indices)),
      "indices_values" ((indices, values)) or "values" (no indices: the values alone
      are checked);
    - ``ties``: the order of equal values: "lower_index" (the lower index first, as
      ours and ``jax.lax.top_k``) or "any" (indices that point at the values, each
      once, pass whichever of the equal entries they pick);
    - ``order``: "total" (IEEE-754 total order, as ``jax.lax.top_k``: +NaN above
      +inf, +0.0 above -0.0, -NaN last, NaN payloads ordered) or "numbers" (it
      compares as numbers: cases then hold no NaN and no -0.0);
    - ``k``, ``rows``, ``n``: the k and sizes it accepts (each k <= n is drawn);
    - ``backends`` / ``interpret``: see ``builders.call_on``.
    Top-k has no gradient here (ours has none to compare with).
    """
    for fact, value, allowed in (("output", output, OUTPUTS), ("ties", ties, TIES), ("order", order, ORDERS)):
        if value not in allowed:
            raise ValueError(f"{fact} must be one of {allowed}, got {value!r}")
    if any(all(k_ > n_ for k_ in k) for n_ in n):
        raise ValueError(f"every n must admit some k <= n; got k={tuple(k)}, n={tuple(n)}")

    def called(x, k_, backend):
        return builders.call_on(fn, get_backend(backend), backends, interpret, x, k_)

    def adapted(x, k_, *, config=None, backend=None):
        del config  # nothing of the tiling enters the bound
        out = called(x, k_, backend)
        x = np.asarray(x)
        # The check compares indices exactly under our tie rule: values alone, or a
        # valid choice among equal values, are given the indices that rule picks.
        if output == "values":
            values = np.asarray(out)
            return values, lowest_indices(x, values)
        values, indices = (np.asarray(a) for a in (out if output == "values_indices" else out[::-1]))
        if ties == "any" and points_at(x, values, indices):
            indices = lowest_indices(x, values)
        return values, indices

    def bad() -> list[BadInput]:
        chosen = builders.checking_backend(backends)
        x = jnp.ones((max(rows), max(n)), dtypes[-1])
        # fn itself, not ``adapted``: the index bookkeeping must not stand in for a refusal
        return [builders.must_refuse("k above n", lambda: called(x, max(n) + 1, chosen))]

    domain = Domain(tuple(rows), tuple(n), tuple(k), total_order=order == "total")
    return make_spec(adapted, name, domain=domain, blocks=Blocks(), dtypes=dtypes, backends=backends, bad_inputs=bad)
