"""The pytest plugin reaches any project that installs pallascheck, and changes nothing
there that the project did not ask for: a test module in a fresh directory, with no
conftest, gets --backend, --examples and ``spec_tests``, while an unrelated Hypothesis
test in the same session keeps Hypothesis' defaults, XLA's flags, JAX's compilation
cache and the environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

USER_TEST = textwrap.dedent("""
    from pallascheck.properties.families.norms import RMS_NORM
    from pallascheck.specs import spec_tests

    test_rms_norm = spec_tests(RMS_NORM)
""")

# Runs after the generated test in the same process (pytest orders modules by name)
# and writes what the session's Hypothesis, XLA, JAX and environment look like, for a
# comparison with the same test in a session without pallascheck (Hypothesis' own
# defaults differ between a CI machine and others: compare, do not hard-code them).
UNRELATED_TEST = textwrap.dedent("""
    import json
    import os

    import jax
    from hypothesis import given, settings, strategies as st

    RUNS = []


    @given(st.integers())
    def test_draws_under_the_sessions_defaults(n):
        RUNS.append(n)


    def test_unrelated_session_state():
        default = settings.default
        seen = {"runs": len(RUNS), "max_examples": default.max_examples, "derandomize": default.derandomize,
                "database": repr(default.database), "health": repr(default.suppress_health_check),
                "deadline": repr(default.deadline), "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
                "env": sorted(k for k in os.environ if k.startswith(("JAX_", "PALLASCHECK_", "XLA_"))),
                "cache": jax.config.jax_compilation_cache_dir, "dot_pallascheck": os.path.exists(".pallascheck")}
        with open(os.environ["SEEN"], "w") as f:
            json.dump(seen, f)
""")


def test_a_project_without_conftest_gets_the_plugin_and_keeps_its_settings(tmp_path: Path) -> None:
    (tmp_path / "test_a_kernel.py").write_text(USER_TEST)
    (tmp_path / "test_b_unrelated.py").write_text(UNRELATED_TEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "PALLASCHECK_"))}
    env["XLA_FLAGS"] = "--xla_cpu_enable_fast_math=false"  # the user's own flags
    # -v: the run's own output names the test it generated (one child process, not a
    # second one to --collect-only the same ids)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-v",
        "-p",
        "no:cacheprovider",
        "--backend",
        "interpret",
        "--examples",
        "1",
        "-k",
        "float32 or unrelated",
        str(tmp_path),
    ]
    done = subprocess.run(
        command,
        cwd=tmp_path,
        env=dict(env, SEEN=str(tmp_path / "with.json")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "3 passed" in done.stdout, done.stdout[-3000:]
    assert "test_a_kernel.py::test_rms_norm[rms_norm-float32-interpret] PASSED" in done.stdout, done.stdout[-3000:]
    # the unrelated test alone, in a session without the plugin
    without = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:pallascheck",
        str(tmp_path / "test_b_unrelated.py"),
    ]
    alone = subprocess.run(
        without,
        cwd=tmp_path,
        env=dict(env, SEEN=str(tmp_path / "without.json")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert alone.returncode == 0, alone.stdout[-3000:] + alone.stderr[-3000:]
    with_plugin = json.loads((tmp_path / "with.json").read_text())
    assert with_plugin == json.loads((tmp_path / "without.json").read_text())
    assert with_plugin["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false" and with_plugin["cache"] is None


def test_specs_import_without_pytest() -> None:
    """Set-up command 1 installs no pytest: building specs must not need it."""
    script = "import sys; sys.modules['pytest'] = None; import pallascheck.specs; pallascheck.specs.matmul_like"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


HANGING_TEST = textwrap.dedent("""
    from fuzz_targets import HANGS
    from pallascheck.properties.pytest_plugin import spec_tests

    test_hangs = spec_tests(HANGS)
""")


def test_a_hung_case_is_reported_not_waited_for(tmp_path: Path) -> None:
    """--case-timeout: the case that hangs is named, with its replay command, and the
    run ends (under pytest-xdist the test fails and the worker is replaced)."""
    (tmp_path / "test_user.py").write_text(HANGING_TEST)
    env = dict(
        os.environ,
        PALLASCHECK_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--backend",
        "interpret",
        "--examples",
        "1",
        "--case-timeout",
        "3",
        str(tmp_path),
    ]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 124, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[hang] kernel=relu_that_hangs dtype=float32 backend=interpret" in done.stderr, done.stderr[-3000:]
    assert "replay: pytest 'test_user.py::test_hangs[relu_that_hangs-float32-interpret]'" in done.stderr
