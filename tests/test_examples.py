"""The kernels in examples/ (outside our families, each checked by a spec built from
its own jax.numpy reference in at most ten lines): each passes its checks, and each
planted bug fails the values check, with a message naming the facts and the verdict.
One dtype (bf16: what these kernels run in) and one Hypothesis example (two cases) each,
to keep the interpret-mode compiles cheap; seed 0 reaches every planted bug.
"""

from __future__ import annotations

import functools
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pallascheck.kernels.backends import Backend
from pallascheck.properties import runner
from pallascheck.properties.spec import KernelSpec

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


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_has_a_module_level_spec(name: str) -> None:
    """``MODULE:SPEC`` names it from the command line (``--path examples --kernel rope:SPEC``)."""
    module = _example(name)
    assert isinstance(module.SPEC, KernelSpec) and module.SPEC.name == f"example_{name}"


def _pallascheck(command: str, cwd: Path) -> subprocess.CompletedProcess:
    args = [str(Path(sys.executable).with_name("pallascheck")), *shlex.split(command)]
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=900)


def test_verify_checks_an_example_named_on_the_command_line() -> None:
    """The obvious command, from the repository root: one dtype, one example (cheap)."""
    done = _pallascheck("verify --path examples --kernel rope:SPEC --examples 1 --dtype bfloat16 --jobs 1", ROOT)
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "\nPASS: " in out and "rope:SPEC" in out, out[-3000:]


def _worked_example() -> str:
    text = (ROOT / "docs" / "check_any_kernel.md").read_text()
    return re.search(r"<!-- worked-example -->\n```python\n(.*?)```", text, re.S).group(1)


def test_the_docs_worked_example_runs_in_an_empty_folder(tmp_path: Path) -> None:
    """docs/check_any_kernel.md's worked example, copied into an empty folder as the page
    says: it is the whole of it (no ``examples.`` import), ``pallascheck verify`` finds it
    in the current directory without --path, and pytest runs its test."""
    code = _worked_example()
    assert "examples." not in code and "SPEC = " in code and "spec_tests(SPEC)" in code
    (tmp_path / "test_blocked_cumsum.py").write_text(code)
    verified = _pallascheck("verify --kernel test_blocked_cumsum:SPEC --examples 1 --dtype float32 --jobs 1", tmp_path)
    out = verified.stdout + verified.stderr
    assert verified.returncode == 0 and "\nPASS: " in out, out[-3000:]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_blocked_cumsum.py"]
    tested = subprocess.run(
        [*command, "--pallascheck-examples", "1", "-k", "float32"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert tested.returncode == 0 and "1 passed" in tested.stdout, tested.stdout[-3000:] + tested.stderr[-3000:]
