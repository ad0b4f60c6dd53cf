"""Focused rules of the loss kernels that the generic spec checks do not state:
every token ignored, vocabulary-parallel equal to unsharded on 2/4/8 devices, the
traced-label contract, real vocabulary sizes, the fused kernel's memory, and the
loss of logits with a large common offset (plain, fused and vocabulary-parallel)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallascheck.bench.losses import linear_memory
from pallascheck.kernels import cross_entropy as ce
from pallascheck.kernels import linear_cross_entropy as lce
from pallascheck.kernels.backends import Backend
from pallascheck.oracles import cross_entropy as ce_oracle
from pallascheck.oracles import linear_cross_entropy as lce_oracle
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import checks, runner
from pallascheck.properties.device.multidevice import run_with_cpu_devices
from pallascheck.properties.families.cross_entropy import IGNORE_INDEX, SPEC, logits_of
from pallascheck.properties.spec import Case


@pytest.mark.parametrize("reduction", ce.REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_every_token_ignored_gives_zero_loss_and_zero_gradient(reduction: str, eps: float, backend) -> None:
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((5, 100)), jnp.float32)
    labels = jnp.full((5,), IGNORE_INDEX, jnp.int32)
    fn = lambda z: ce.cross_entropy(z, labels, label_smoothing=eps, reduction=reduction, backend=backend)  # noqa: E731
    loss, pullback = jax.vjp(fn, logits)
    (grad,) = pullback(jnp.ones_like(loss))
    assert np.all(np.asarray(loss) == 0.0), loss
    assert np.all(np.asarray(grad) == 0.0)


def test_out_of_range_label_under_jit_is_nan_not_garbage(backend) -> None:
    logits = jnp.zeros((3, 10), jnp.float32)
    labels = jnp.asarray([1, 10, IGNORE_INDEX], jnp.int32)  # 10 >= V: unchecked when traced
    per_token = jax.jit(lambda z, y: ce.cross_entropy(z, y, reduction="none", backend=backend))
    out = np.asarray(per_token(logits, labels))
    assert np.isfinite(out[0]) and np.isnan(out[1]) and out[2] == 0.0
    grad = np.asarray(
        jax.jit(jax.grad(lambda z, y: ce.cross_entropy(z, y, reduction="sum", backend=backend)))(logits, labels)
    )
    assert np.isfinite(grad[0]).all() and np.isnan(grad[1]).all() and (grad[2] == 0).all()


# Logits [z, z, z - 1, z - 2], label 0: the loss is log(2 + e^-1 + e^-2) = 0.9175758 at
# every z. In f32, z - 1 and z - 2 exist up to 2^24; at z = 1e8 (spacing 8) they round
# to z, the input is [z, z, z, z] and its exact loss is log 4. [z, z, z - 8, z - 16] is
# exact at 1e8. Each row's expected loss and gradient are the float64 oracle's for the
# f32 input; the kernels must be within 1e-6 of it (relative to a loss of order 1).
LARGE_LOGITS = np.asarray([[z, z, z - 1, z - 2] for z in (1e4, 1e5, 1e8)] + [[1e8, 1e8, 1e8 - 8, 1e8 - 16]], np.float32)


def _exact_loss_and_gradient(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    labels = np.zeros(len(logits), np.int64)
    ref = ce_oracle.oracle(logits, labels, eps=0.0, ignore_index=IGNORE_INDEX, reduction="none")
    return ref.out, ce_oracle.oracle_vjp(ref, np.ones(len(logits)))["dlogits"]


def test_exact_loss_at_large_logits(backend) -> None:
    loss, grad = _exact_loss_and_gradient(LARGE_LOGITS)
    assert np.allclose(loss[:2], 0.9175758, atol=1e-7) and np.isclose(loss[2], np.log(4.0))
    labels = jnp.zeros(len(LARGE_LOGITS), jnp.int32)
    fn = lambda z: ce.cross_entropy(z, labels, reduction="none", backend=backend)  # noqa: E731
    got, pullback = jax.vjp(fn, jnp.asarray(LARGE_LOGITS))
    (got_grad,) = pullback(jnp.ones_like(got))
    np.testing.assert_allclose(np.asarray(got), loss, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_grad), grad, rtol=0, atol=1e-6)
    # The inputs do stress the loss: the textbook lse - z_y (xla_reference) misses it.
    textbook = np.asarray(ce.xla_reference(jnp.asarray(LARGE_LOGITS), labels, reduction="none"))
    assert np.abs(textbook - loss)[1:].min() > 1e-3, textbook


# Logits near bf16's largest finite value, the row's max tied at two columns (the target
# one): the loss is exactly ln 2 and dlogits at the target g (1/2 - 1), where the other
# logits lie 1e36 below. float64 spaces numbers of 1.7e38 2e22 apart, so an oracle that
# forms lse = M + log s and subtracts z_y computes a loss of 0 and a softmax of 1 at
# both maxima: a GPU soak's Triton runs failed the correct kernel so (values at 1e5
# times the bound, gradients at 80x, where the bound charged nothing for rounding).
def test_tied_max_near_the_largest_logit(backend) -> None:
    big = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max) / 2
    logits = np.full((3, 40), big / 2, np.float32)
    logits[:, [7, 29]] = big
    labels = np.asarray([7, 29, 3], np.int32)  # the last: a label below the max
    case = Case(
        {
            "logits": logits.astype(ml_dtypes.bfloat16),
            "labels": labels,
            "cotangent": np.asarray([1.0, -0.75, 0.5], np.float32),
            "shift": np.zeros(3),
        },
        {"label_smoothing": 0.0, "ignore_index": IGNORE_INDEX, "reduction": "none"},
    )
    ref = SPEC.oracle(case)
    assert np.array_equal(SPEC.expected(ref)[:2], [np.log(2.0)] * 2), SPEC.expected(ref)
    assert np.isclose(ce_oracle.oracle_vjp(ref, case.arrays["cotangent"])["dlogits"][1, 29], -0.75 * -0.5)
    config = SPEC.configs(case, backend)[0]
    tally = runner.check_case(
        SPEC,
        case,
        config,
        backend,
        context=checks.Context("cross_entropy", "bfloat16", str(backend)),
        selected=("values", "gradients"),
    )
    assert all(o.passed for o in tally.outcomes.values())


def test_unbounded_logit_error_times_a_zero_weight_leaves_the_gradient_bound_a_number() -> None:
    """Logits near 1e37 make some dlogits errors unbounded (inf); where a weight or an
    input is exactly 0 their product adds nothing, so no element of the dx and dw
    bounds is NaN (a NaN bound failed a correct Triton kernel in a GPU soak)."""
    x = np.zeros((3, 4), np.float32)
    x[:, 0], x[1, 1] = 1e18, 1.0
    w = np.zeros((4, 6), np.float32)
    w[0], w[1, 2] = np.linspace(-1e19, 1e19, 6), 0.5
    ref = lce_oracle.oracle(x, w, np.asarray([0, 2, 5], np.int32), eps=0.0, ignore_index=IGNORE_INDEX, reduction="mean")
    bound = lce_oracle.gradient_bound(
        ref,
        np.float32(1.0),
        operand_dtype=np.float32,
        arith=arithmetic_for(Backend("interpret")),
        block_h=32,
        block_v=64,
        block_t=32,
    )
    assert not any(np.isnan(b).any() for b in bound.values()), bound
    assert all(np.isinf(b).any() for b in bound.values())  # the case does reach unbounded errors


# The fused kernel forms its logits as x @ w: with x = [1, 1] and w = [offset row; small
# row], every product is exact even where f32 dots run as tf32 (GPUs) or the inputs are
# bf16, and the f32 sum z + small is exact (z < 2^24, or multiples of 8 at 1.5 * 2^26).
FUSED_OFFSETS = (
    (10240.0, (0.0, 0.0, -1.0, -2.0)),
    (131072.0, (0.0, 0.0, -1.0, -2.0)),
    (1.5 * 2.0**26, (0.0, 0.0, -8.0, -16.0)),
)


def test_fused_exact_loss_at_large_logits(backend) -> None:
    """One token per call, logits z + small with z up to 1e8, label 0: the loss within
    1e-6 of the float64 one. dw's small row is x[0, 1] * dlogits = dlogits rounded once
    to the backward dot's operand precision (f32 here, tf32 where the GPU runs f32 dots
    so), so it is within 1e-6 + that rounding of the exact gradient."""
    u_operand = arithmetic_for(backend).operand_unit(np.float32)
    for z, small in FUSED_OFFSETS:
        x, w = np.ones((1, 2), np.float32), np.asarray([[z] * 4, small], np.float32)
        loss, grad = _exact_loss_and_gradient(x.astype(np.float64) @ w.astype(np.float64))
        labels = jnp.zeros((1,), jnp.int32)
        fn = lambda a, b: lce.linear_softmax_cross_entropy(a, b, labels, reduction="sum", backend=backend)  # noqa: E731
        got, pullback = jax.vjp(fn, jnp.asarray(x), jnp.asarray(w))
        _, dw = pullback(jnp.ones_like(got))
        np.testing.assert_allclose(float(got), loss[0], rtol=0, atol=1e-6)
        assert np.all(np.abs(np.asarray(dw)[1] - grad[0]) <= 1e-6 + u_operand * np.abs(grad[0])), (dw, grad)


def test_vocab_parallel_exact_loss_at_large_logits() -> None:
    """Two devices, two columns each: the max and the target live on either shard."""
    loss, grad = _exact_loss_and_gradient(LARGE_LOGITS)
    rows = LARGE_LOGITS[:, [2, 0, 3, 1]]  # the max on both shards, the label (now 1) on the first
    result = run_with_cpu_devices(
        "pallascheck.properties.families.cross_entropy_sharded:sharded_losses",
        2,
        {"logits": rows.astype(np.float64).tolist(), "labels": [1] * len(rows)},
        timeout_s=300,
    )
    np.testing.assert_allclose(result["loss"], loss, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(result["dlogits"])[:, [1, 3, 0, 2]], grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_vocab_parallel_equals_unsharded(devices: int, examples: int) -> None:
    """One child process per device count; both dtypes, a quarter of the profile's
    examples each (every case compiles a sharded and an unsharded kernel)."""
    per_dtype = max(1, examples // 4)
    result = run_with_cpu_devices(
        "pallascheck.properties.families.cross_entropy_sharded:sharded_matches_unsharded",
        devices,
        {"examples": per_dtype, "seed": devices},
        timeout_s=600,
    )
    assert not result["failure"], result["failure"]
    assert result["devices"] == devices and result["examples"] == 2 * per_dtype


@pytest.mark.parametrize("vocab", [50257, 128256, 201088])
def test_real_vocabulary_sizes(vocab: int, backend) -> None:
    """Values and gradients at the vocabulary sizes of GPT-2, Llama 3 and o200k (two
    tokens: a partial last tile, labels 0 and V-1, one logit per row at the end)."""
    dtype = "bfloat16" if vocab == 128256 else "float32"
    logits, _ = logits_of(vocab, 2, vocab, dtype, "normal")
    logits[1, -1] = 30.0  # the largest logit in the last, partial tile
    labels = np.asarray([0, vocab - 1], np.int32)
    case = Case(
        {"logits": logits, "labels": labels, "cotangent": np.ones((2,), np.float32)},
        {"label_smoothing": 0.1, "ignore_index": IGNORE_INDEX, "reduction": "none"},
    )
    config = SPEC.configs(case, backend)[-1]
    tally = runner.check_case(
        SPEC,
        case,
        config,
        backend,
        context=checks.Context("cross_entropy", dtype, str(backend)),
        selected=("values", "gradients"),
    )
    assert all(o.passed for o in tally.outcomes.values())


def test_fused_linear_cross_entropy_never_holds_the_logits(backend) -> None:
    """Compiled peak memory of forward+backward at T=1024, H=512, V=32000 (nothing
    runs): the fused kernel saves at least one f32 [T, V] logits array against the
    naive x @ w then cross-entropy (which holds the logits and their gradient)."""
    tokens, hidden, vocab = 1024, 512, 32000
    memory = linear_memory(tokens, hidden, vocab, "bfloat16", backend)
    logits_mib = tokens * vocab * 4 / 2**20
    assert memory["kernel_peak_MiB"] + logits_mib <= memory["naive_peak_MiB"], memory
