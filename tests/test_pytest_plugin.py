"""The pytest plugin reaches any project that installs pallascheck, and changes nothing
there that the project did not ask for: a test module in a fresh directory, with no
conftest, gets --pallascheck-backend, --pallascheck-examples and ``spec_tests``, while an
unrelated Hypothesis test in the same session keeps Hypothesis' defaults, XLA's flags,
JAX's compilation cache and the environment. A project's own --backend and --examples
keep working beside it, and loading the plugin imports neither JAX nor Hypothesis."""

from __future__ import annotations

import json
import os
import re
import shlex
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
        "--pallascheck-backend",
        "interpret",
        "--pallascheck-examples",
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
    """--pallascheck-case-timeout: the case that hangs is named, with its replay command, and the
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
        "--pallascheck-backend",
        "interpret",
        "--pallascheck-examples",
        "1",
        "--pallascheck-case-timeout",
        "3",
        str(tmp_path),
    ]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 124, done.stdout[-3000:] + done.stderr[-3000:]
    assert "[hang] kernel=relu_that_hangs dtype=float32 backend=interpret" in done.stderr, done.stderr[-3000:]
    assert "replay: pytest 'test_user.py::test_hangs[relu_that_hangs-float32-interpret]'" in done.stderr
    # the replay runs as printed, in a project without the short option names: it names
    # the same test (collected, not run again: it hangs)
    printed = re.search(r"replay: (pytest .*)", done.stderr).group(1)
    assert "--pallascheck-backend interpret" in printed and "--pallascheck-examples 1" in printed, printed
    again = [sys.executable, "-m", *shlex.split(printed), "-p", "no:cacheprovider", "--collect-only", "-q"]
    collected = subprocess.run(again, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    assert collected.stdout.splitlines()[0] == "test_user.py::test_hangs[relu_that_hangs-float32-interpret]"


def test_at_the_production_tier_each_layout_is_a_test_of_its_own(tmp_path: Path) -> None:
    """--pallascheck-shapes production: one test per spec x dtype x backend x named
    layout, so that every layout is checked (a run of few examples drew few of them)."""
    (tmp_path / "test_prod.py").write_text(
        "from pallascheck.properties.registry import get_spec\n"
        "from pallascheck.properties.pytest_plugin import spec_tests\n\n"
        "test_matmul = spec_tests(get_spec('matmul'))\n"
    )
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q"]
    command += ["--pallascheck-backend", "interpret", "--pallascheck-shapes", "production", str(tmp_path)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    from pallascheck.kernels.backends import Backend
    from pallascheck.properties.registry import get_spec

    spec = get_spec("matmul")
    expected = {  # the interpret session's backends: the generic and the Mosaic GPU interpreters
        f"test_prod.py::test_matmul[matmul-{d}-{b}-{layout.name.split(':')[0]}]"
        for b in ("interpret", "mosaic_gpu_interpret")
        for d in spec.dtypes_for(Backend(b))
        for layout in spec.production_layouts
    }
    assert {line for line in done.stdout.splitlines() if line.startswith("test_prod.py::")} == expected, done.stdout


WRONG_TEST = textwrap.dedent("""
    from fuzz_targets import WRONG_FIRST_ELEMENT
    from pallascheck.properties.pytest_plugin import spec_tests

    test_wrong = spec_tests(WRONG_FIRST_ELEMENT)
""")


def test_a_failing_spec_test_shows_its_message_not_the_generated_tests_source(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(WRONG_TEST)
    env = dict(
        os.environ,
        PALLASCHECK_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    )
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pallascheck-backend", "interpret"]
    done = subprocess.run(
        [*command, "--pallascheck-examples", "1", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    failures = done.stdout[done.stdout.index("= FAILURES =") : done.stdout.index("short test summary")]
    assert "[values] kernel=relu_wrong_at_first_element" in failures and "inputs at out[0" in failures, failures
    # none of the generated test's lines, nor numpy's scalar reprs
    for noise in ("def test(", "tally = runner.run_property", "np.float64(", "AssertionError"):
        assert noise not in failures, failures
    assert len(failures.splitlines()) < 20, failures


CONFLICTING_CONFTEST = textwrap.dedent("""
    def pytest_addoption(parser):
        parser.addoption("--backend", default="cpu", help="the project's own")
        parser.addoption("--examples", default="none", help="the project's own")
""")

TRIVIAL_TEST = textwrap.dedent("""
    import sys

    def test_the_projects_options_are_its_own(request):
        assert request.config.getoption("--backend") == "torch"
        assert request.config.getoption("--examples") == "all"
        assert request.config.getoption("--pallascheck-backend") is None
        # nothing heavy was loaded by the plugin for a session with no pallascheck test
        assert [m for m in ("jax", "hypothesis", "pallascheck.kernels.backends") if m in sys.modules] == []
""")


def test_a_project_with_its_own_backend_and_examples_options_starts(tmp_path: Path) -> None:
    """A conftest adding --backend and --examples beside the installed plugin: pytest
    starts, the options are the project's, and the plugin loaded neither JAX nor
    Hypothesis."""
    (tmp_path / "conftest.py").write_text(CONFLICTING_CONFTEST)
    (tmp_path / "test_trivial.py").write_text(TRIVIAL_TEST)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--backend", "torch"]
    done = subprocess.run(
        [*command, "--examples", "all", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def test_the_short_names_are_the_same_options_where_a_project_enables_them(tmp_path: Path) -> None:
    """``pytest_plugins = [...pytest_short_options]``: --examples is --pallascheck-examples
    (the plugin refuses 0 by its namespaced name); without it, --examples is unknown."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["pallascheck.properties.pytest_short_options"]\n')
    (tmp_path / "test_trivial.py").write_text("def test_nothing():\n    pass\n")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    refused = subprocess.run([*command, "--examples", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 4 and "--pallascheck-examples must be >= 1, got 0" in refused.stderr, refused.stderr
    ran = subprocess.run(
        [*command, "--examples", "2", "--shapes", "small"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    (tmp_path / "conftest.py").unlink()
    unknown = subprocess.run([*command, "--examples", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert unknown.returncode == 4 and "unrecognized arguments: --examples" in unknown.stderr, unknown.stderr


def test_the_plugin_loads_without_jax_or_hypothesis() -> None:
    script = (
        "import sys, pallascheck.properties.pytest_plugin, pallascheck.properties.pytest_short_options\n"
        "print([m for m in ('jax', 'hypothesis', 'numpy', 'pallascheck.kernels.backends') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-3000:]


def test_the_plugins_own_copies_of_names_match_their_homes() -> None:
    """The plugin writes out what its options' help needs (so that it loads nothing
    heavy): each copy is the value in its home."""
    from pallascheck.kernels import backends
    from pallascheck.properties import pytest_plugin, runner, watchdog

    assert pytest_plugin.BACKEND_NAMES == backends.NAMES
    assert pytest_plugin.BACKEND_ALIASES == backends.ALIASES
    assert pytest_plugin.BACKEND_ENV_VAR == backends.ENV_VAR
    assert pytest_plugin.SHAPE_TIERS == runner.SHAPE_TIERS
    assert pytest_plugin.CASE_TIMEOUT_S == watchdog.CASE_TIMEOUT_S
    assert pytest_plugin.PRODUCTION_CASE_TIMEOUT_S == watchdog.PRODUCTION_CASE_TIMEOUT_S
    assert pytest_plugin.PROFILE_NAMES == tuple(pytest_plugin.profiles())


def test_pytest_and_verify_draw_the_same_examples_by_default() -> None:
    """One number (runner.EXAMPLES): a kernel checked by its spec_tests under the ci
    profile and by `pallascheck verify` gets the same Hypothesis examples."""
    import argparse

    from pallascheck.cli import verify
    from pallascheck.properties import pytest_plugin, runner

    parser = argparse.ArgumentParser()
    verify.add_parser(parser.add_subparsers())
    assert parser.parse_args(["verify"]).examples is None  # the tier's default
    assert runner.default_examples("small") == runner.EXAMPLES
    assert pytest_plugin.profiles()["ci"].max_examples == runner.EXAMPLES
