"""The pytest plugin reaches any project that installs pallascheck: a test module in a
fresh directory, with no conftest, gets --backend, --examples and ``spec_tests``."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

USER_TEST = textwrap.dedent('''
    from pallascheck.properties.norms_spec import RMS_NORM
    from pallascheck.properties.pytest_plugin import spec_tests

    test_rms_norm = spec_tests(RMS_NORM)
''')


def test_a_project_without_conftest_gets_the_plugin(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(USER_TEST)
    env = dict(os.environ, PALLASCHECK_CACHE_DIR=str(tmp_path / "cache"))
    # -v: the run's own output names the test it generated (one child process, not a
    # second one to --collect-only the same ids)
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--backend", "interpret",
               "--examples", "1", "-k", "float32", str(tmp_path)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout, done.stdout[-3000:]
    assert "test_user.py::test_rms_norm[rms_norm-float32-interpret] PASSED" in done.stdout, done.stdout[-3000:]


HANGING_TEST = textwrap.dedent('''
    from fuzz_targets import HANGS
    from pallascheck.properties.pytest_plugin import spec_tests

    test_hangs = spec_tests(HANGS)
''')


def test_a_hung_case_is_reported_not_waited_for(tmp_path: Path) -> None:
    """--case-timeout: the case that hangs is named, with its replay command, and the
    run ends (under pytest-xdist the test fails and the worker is replaced)."""
    (tmp_path / "test_user.py").write_text(HANGING_TEST)
    env = dict(os.environ, PALLASCHECK_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--backend", "interpret", "--examples", "1",
               "--case-timeout", "3", str(tmp_path)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 124, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[hang] kernel=relu_that_hangs dtype=float32 backend=interpret" in done.stderr, done.stderr[-3000:]
    assert "replay: pytest 'test_user.py::test_hangs[relu_that_hangs-float32-interpret]'" in done.stderr
