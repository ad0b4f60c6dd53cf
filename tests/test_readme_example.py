"""The README's "check your own kernel" example, run as written in a fresh project
directory with no conftest, DeprecationWarnings as errors: it must be ten lines or
fewer and pass."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    return re.search(r"<!-- check-your-own-kernel -->\n```python\n(.*?)```", text, re.S).group(1)


def test_readme_example_is_ten_lines_or_fewer() -> None:
    code = [line for line in readme_example().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(code) <= 10, code


def test_readme_example_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "test_my_attention.py").write_text(readme_example())
    env = dict(os.environ, PALLASCHECK_CACHE_DIR=str(tmp_path / "cache"))
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        # a deprecated import (JAX's bundled GPU ops now warn) fails the example
        "-W",
        "error::DeprecationWarning",
        "--pallascheck-backend",
        "interpret",
        "--pallascheck-examples",
        "1",
        str(tmp_path),
    ]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # one test per dtype on interpret (mosaic_gpu_interpret is not among its backends)
    assert re.search(r"\b3 passed\b", done.stdout), done.stdout[-3000:]


def test_set_up_step_1_installs_what_the_readme_uses_next() -> None:
    """Step 1's command installs pytest (the example above, the plugin) and matplotlib
    (``pallascheck report``, which fuzz tells the user to run), not the test extra."""
    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for page in (README, README.parent / "docs" / "index.md"):
        step_1 = re.search(r"^1\. .*?```\n\s*(.*?)\n\s*```", page.read_text(), re.S | re.M).group(1)
        extra = re.fullmatch(r"pip install -e '\.\[(\w+)\]' && pallascheck verify", step_1.strip()).group(1)
        assert extra != "test" and {"pytest", "matplotlib"} <= set(extras[extra]), (page, step_1)
