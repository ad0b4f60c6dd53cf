"""The kernels in examples/ (outside our families, each checked by a spec built from
its own jax.numpy reference in at most ten lines): each passes its checks, and each
planted bug fails the values check, with a message naming the facts and the verdict.
One dtype (bf16: what these kernels run in) and one Hypothesis example (two cases) each,
to keep the interpret-mode compiles cheap; seed 0 reaches every planted bug.
"""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path

import pytest

from pallascheck.kernels.backends import Backend
from pallascheck.properties import runner

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {  # module -> its kernel function
    "rope": "rope",
    "linear_attention": "linear_attention",
    "softcap_attention": "softcap_attention",
    "rmsnorm_matmul": "rmsnorm_matmul",
    "blocked_cumsum": "blocked_cumsum",
}
CHECK_MARKER = "# ---- check (the whole of it) ----"


def _example(name: str):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"examples.{name}")


def _run(spec, examples: int = 1) -> runner.Tally:
    return runner.run_property(spec, "bfloat16", Backend("interpret"), examples=examples, seed=0)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_check_code_is_ten_lines_or_fewer(name: str) -> None:
    text = (ROOT / "examples" / f"{name}.py").read_text()
    check = text.split(CHECK_MARKER)[1]
    code = [line for line in check.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(code) <= 10, code


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_passes_and_its_planted_bug_is_caught(name: str) -> None:
    module = _example(name)
    kernel = getattr(module, EXAMPLES[name])
    good = _run(module.spec(kernel))
    assert not good.failure, good.failure
    assert {"values", "reference", "contract"} <= set(good.outcomes)
    broken = _run(module.spec(functools.partial(kernel, bug=True)))
    assert broken.failure.startswith("[values]"), broken.failure
    assert "derived bound: facts compute_dtype=float32" in broken.failure
    assert "dominated by" in broken.failure
