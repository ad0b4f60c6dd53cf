"""Suite-wide options: --backend and the Hypothesis profiles.

Profiles (select with --hypothesis-profile or $PALLASCHECK_PROFILE):
- ci (default): derandomized, few examples, no database: never flaky, fast on 2 cores;
- dev: more examples, random seeds;
- fuzz: many examples, database on (keeps failing examples between runs);
- hardware: for --backend gpu, where examples are cheap.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from pallascheck.kernels.backends import Backend, get_backend

_COMMON = dict(deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("ci", max_examples=4, derandomize=True, database=None, print_blob=True, **_COMMON)
settings.register_profile("dev", max_examples=20, **_COMMON)
settings.register_profile("fuzz", max_examples=200, **_COMMON)
settings.register_profile("hardware", max_examples=25, derandomize=True, database=None, print_blob=True, **_COMMON)
settings.load_profile(os.environ.get("PALLASCHECK_PROFILE", "ci"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend", default=None,
        help="interpret (default), tpu_interpret[:SEED], gpu or tpu; else $PALLASCHECK_BACKEND",
    )


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> Backend:
    return get_backend(request.config.getoption("--backend"))


@pytest.fixture(scope="session")
def examples() -> int:
    """Examples per kernel x dtype property, from the active Hypothesis profile."""
    return settings.default.max_examples
