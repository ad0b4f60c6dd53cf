"""``pallascheck probe``: the measurements on the session's backends hold the
tolerance model, and the probe tells arithmetics apart (emulated dots with a known rounding,
order and accumulator width must be classified as what they are)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from pallascheck.bench import probe
from pallascheck.kernels.backends import Backend
from pallascheck.oracles.tolerance import CPU, GPU


def _emulated(mode: str, groups: Callable[[int], list[list[int]]], flush: bool = False) -> probe.DotFn:
    """A dot that adds the exact products of each group of K positions, in the order
    ``groups(K)`` gives, into an f32 accumulator rounded by ``mode``; a group of
    several terms is added at once, as tensor cores add theirs (probe.fused_group_sum)."""

    def dot(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        acc = np.zeros((x.shape[0], y.shape[1]))
        for group in groups(x.shape[1]):
            terms = x[:, group, None] * y[None, group, :]  # [M, group, N], exact
            if flush:
                terms = np.where(np.abs(terms) < np.finfo(np.float32).tiny, 0.0, terms)
            acc = probe.round_f32(acc + probe.fused_group_sum(terms, axis=1), mode)
        return acc.astype(np.float32)

    return dot


def _one_by_one(order: Callable[[int], list[int]]) -> Callable[[int], list[list[int]]]:
    return lambda k: [[i] for i in order(k)]


def test_probe_holds_the_model(each_backend: Backend) -> None:
    """On the session's backends (on the CPU: XLA, the Pallas interpreter and the
    Mosaic GPU interpreter's wgmma)."""
    report = probe.run(each_backend)
    assert not any(report.violations.values()), report.violations


@pytest.mark.parametrize("mode", ["nearest-even", "toward-zero"])
@pytest.mark.parametrize("name", ["sequential", "reverse"])
def test_probe_classifies_an_emulated_dot(mode: str, name: str) -> None:
    order = (lambda k: list(range(k))) if name == "sequential" else (lambda k: list(range(k))[::-1])
    measured = probe.probe_path(_emulated(mode, _one_by_one(order)))
    assert measured["rounding"]["mode"] == mode
    assert measured["products"]["exact"] and measured["accumulator"]["bits"] == 24
    assert name in measured["order"]["matches"]
    assert measured["subnormals"] == {"subnormal_input": "kept", "subnormal_product": "kept"}
    # truncation breaks the CPU model (u per addition) and not the GPU one (2u)
    assert bool(probe.assumption_violations(measured, CPU)) == (mode == "toward-zero")
    assert not probe.assumption_violations(measured, GPU)


def test_probe_finds_a_permuted_sequential_order() -> None:
    swapped = lambda k: [i ^ 1 for i in range(k)]  # noqa: E731 - pairs taken high index first
    measured = probe.probe_path(_emulated("nearest-even", _one_by_one(swapped), flush=True))
    assert measured["order"]["matches"][0].startswith("sequential in the order [0, 1, 3, 2, 5, 4, 7, 6]")
    assert measured["subnormals"] == {"subnormal_input": "flushed", "subnormal_product": "flushed"}


def test_probe_finds_fused_groups() -> None:
    """Groups of 16 products added at once, aligned to the largest (what the H200's
    tensor cores do: README), then accumulated in f32 toward zero."""
    sixteens = lambda k: [list(range(g, min(g + 16, k))) for g in range(0, k, 16)]  # noqa: E731
    measured = probe.probe_path(_emulated("toward-zero", sixteens))
    assert "fused-16" in measured["order"]["matches"] and measured["rounding"]["mode"] == "toward-zero"
