"""Focused rules of the loss kernels that the generic spec checks do not state:
every token ignored, vocabulary-parallel equal to unsharded on 2/4/8 devices, the
traced-label contract, real vocabulary sizes, and the fused kernel's memory."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallascheck.bench.losses import linear_memory
from pallascheck.kernels import cross_entropy as ce
from pallascheck.properties import checks, runner
from pallascheck.properties.cross_entropy_spec import IGNORE_INDEX, SPEC, logits_of
from pallascheck.properties.multidevice import run_with_cpu_devices
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
    grad = np.asarray(jax.jit(jax.grad(lambda z, y: ce.cross_entropy(z, y, reduction="sum", backend=backend)))(logits, labels))
    assert np.isfinite(grad[0]).all() and np.isnan(grad[1]).all() and (grad[2] == 0).all()


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_vocab_parallel_equals_unsharded(devices: int, examples: int) -> None:
    """One child process per device count; both dtypes, a quarter of the profile's
    examples each (every case compiles a sharded and an unsharded kernel)."""
    per_dtype = max(1, examples // 4)
    result = run_with_cpu_devices(
        "pallascheck.properties.cross_entropy_sharded:sharded_matches_unsharded", devices,
        {"examples": per_dtype, "seed": devices}, timeout_s=600,
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
    case = Case({"logits": logits, "labels": labels, "cotangent": np.ones((2,), np.float32)},
                {"label_smoothing": 0.1, "ignore_index": IGNORE_INDEX, "reduction": "none"})
    config = SPEC.configs(case, backend)[-1]
    tally = runner.check_case(SPEC, case, config, backend, context=checks.Context("cross_entropy", dtype, str(backend)),
                              selected=("values", "gradients"))
    assert all(o.passed for o in tally.outcomes.values())


def test_fused_linear_cross_entropy_never_holds_the_logits(backend) -> None:
    """Compiled peak memory of forward+backward at T=1024, H=512, V=32000 (nothing
    runs): the fused kernel saves at least one f32 [T, V] logits array against the
    naive x @ w then cross-entropy (which holds the logits and their gradient)."""
    tokens, hidden, vocab = 1024, 512, 32000
    memory = linear_memory(tokens, hidden, vocab, "bfloat16", backend)
    logits_mib = tokens * vocab * 4 / 2**20
    assert memory["kernel_peak_MiB"] + logits_mib <= memory["naive_peak_MiB"], memory
