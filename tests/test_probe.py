"""``pallascheck probe``: the measurements on the session's backends hold the
tolerance model, and the probe tells arithmetics apart (emulated dots with a known rounding,
order and accumulator width must be classified as what they are)."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from pallascheck.bench import probe
from pallascheck.kernels.backends import Backend
from pallascheck.oracles.tolerance import CPU, GPU


def _emulated(mode: str, order: Callable[[int], list[int]], flush: bool) -> probe.DotFn:
    """A dot that adds exact products one at a time in ``order`` into an f32
    accumulator rounded by ``mode``."""
    def dot(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out = np.zeros((x.shape[0], y.shape[1]), np.float32)
        for i in range(x.shape[0]):
            for j in range(y.shape[1]):
                acc = 0.0
                for k in order(x.shape[1]):
                    term = x[i, k] * y[k, j]
                    if flush and abs(term) < np.finfo(np.float32).tiny:
                        term = 0.0
                    acc = probe.round_f32(acc + term, mode)
                out[i, j] = acc
        return out
    return dot


def test_probe_holds_the_model(each_backend: Backend) -> None:
    """On the session's backends (on the CPU: XLA, the Pallas interpreter and the
    Mosaic GPU interpreter's wgmma)."""
    report = probe.run(each_backend)
    assert not any(report.violations.values()), report.violations


@pytest.mark.parametrize("mode", ["nearest-even", "toward-zero"])
@pytest.mark.parametrize("name", ["sequential", "reverse"])
def test_probe_classifies_an_emulated_dot(mode: str, name: str) -> None:
    order = (lambda k: list(range(k))) if name == "sequential" else (lambda k: list(range(k))[::-1])
    measured = probe.probe_path(_emulated(mode, order, flush=False))
    assert measured["rounding"]["mode"] == mode
    assert measured["products"]["exact"] and measured["accumulator"]["bits"] == 24
    assert name in measured["order"]["matches"]
    assert measured["subnormals"] == {"subnormal_input": "kept", "subnormal_product": "kept"}
    # truncation breaks the CPU model (u per addition) and not the GPU one (2u)
    assert bool(probe.assumption_violations(measured, CPU)) == (mode == "toward-zero")
    assert not probe.assumption_violations(measured, GPU)


def test_probe_finds_a_permuted_sequential_order() -> None:
    swapped = lambda k: [i ^ 1 for i in range(k)]  # noqa: E731 - pairs taken high index first
    measured = probe.probe_path(_emulated("nearest-even", swapped, flush=True))
    assert measured["order"]["matches"][0].startswith("sequential in the order [0, 1, 3, 2, 5, 4, 7, 6]")
    assert measured["subnormals"] == {"subnormal_input": "flushed", "subnormal_product": "flushed"}


def test_probe_finds_fused_groups() -> None:
    """Groups of 16 products added at once, aligned to the largest (what the H200's
    tensor cores do: README), then accumulated in f32 toward zero."""
    def dot(x, y):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        out = np.zeros((x.shape[0], y.shape[1]), np.float32)
        for i in range(x.shape[0]):
            for j in range(y.shape[1]):
                acc = 0.0
                for g in range(0, x.shape[1], 16):
                    acc = probe.round_f32(acc + probe.fused_group_sum(x[i, g:g + 16] * y[g:g + 16, j]), "toward-zero")
                out[i, j] = acc
        return out

    measured = probe.probe_path(dot)
    assert "fused-16" in measured["order"]["matches"] and measured["rounding"]["mode"] == "toward-zero"
