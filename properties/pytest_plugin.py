"""The pytest plugin (entry point ``pytest11``): any project that installs
pallascheck gets ``--backend``, the Hypothesis profiles and the fixtures.

Profiles (select with --hypothesis-profile or $PALLASCHECK_PROFILE):
- ci (default): derandomized, few examples, no database: never flaky, fast on 2 cores;
- dev: more examples, random seeds;
- fuzz: many examples, database on (keeps failing examples between runs);
- hardware: for the GPU backends, where examples are cheap.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from pallascheck.kernels.backends import ALIASES, ENV_VAR, NAMES, Backend, NotOnBackend, get_backend
from pallascheck.properties import compilation

_COMMON = dict(deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("ci", max_examples=4, derandomize=True, database=None, print_blob=True, **_COMMON)
settings.register_profile("dev", max_examples=20, **_COMMON)
settings.register_profile("fuzz", max_examples=200, **_COMMON)
settings.register_profile("hardware", max_examples=25, derandomize=True, database=None, print_blob=True, **_COMMON)
settings.load_profile(os.environ.get("PALLASCHECK_PROFILE", "ci"))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pallascheck")
    group.addoption(
        "--backend", default=None,
        help=f"one of {NAMES} (tpu_interpret:SEED; {', '.join(f'{a}={n}' for a, n in ALIASES.items())}); "
        "default $PALLASCHECK_BACKEND or interpret",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Before any test creates a JAX client: the shared on-disk cache, quick CPU compiles.
    compilation.configure(config.getoption("--backend") or os.environ.get(ENV_VAR, "interpret"))
    # A backend that cannot run here stops the session at once, saying what is missing.
    for chosen in backends_under_test(config):
        try:
            chosen.require_available()
        except RuntimeError as missing:
            raise pytest.UsageError(str(missing)) from None


def backends_under_test(config: pytest.Config) -> list[Backend]:
    """The backends a session checks: the one chosen; with the CPU default
    (``interpret``) also ``mosaic_gpu_interpret``, so that the Mosaic GPU kernels are
    checked on every CPU run, in their own interpreter."""
    chosen = get_backend(config.getoption("--backend"))
    return [chosen, Backend("mosaic_gpu_interpret")] if chosen.name == "interpret" else [chosen]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes ``each_backend`` runs once per backend of the session."""
    if "each_backend" in metafunc.fixturenames:
        chosen = backends_under_test(metafunc.config)
        metafunc.parametrize("each_backend", chosen, ids=[str(b) for b in chosen])


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    """A kernel with no version for the session's backend is reported as skipped,
    with the kernel's own message saying which backends it has."""
    try:
        return (yield)
    except NotOnBackend as missing:
        pytest.skip(f"not on this backend: {missing}")


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> Backend:
    """The backend under test (checked at the session's start: it runs here)."""
    return get_backend(request.config.getoption("--backend"))


@pytest.fixture(scope="session")
def examples() -> int:
    """Examples per kernel x dtype property, from the active Hypothesis profile."""
    return settings.default.max_examples
