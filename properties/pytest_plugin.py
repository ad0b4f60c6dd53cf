"""The pytest plugin (entry point ``pytest11``): any project that installs
pallascheck gets the options ``--pallascheck-backend``, ``--pallascheck-examples``,
``--pallascheck-shapes``, ``--pallascheck-case-timeout`` and ``--pallascheck-session``,
the Hypothesis profiles, the fixtures (``backend``, ``each_backend``, ``examples``) and
``spec_tests``, which turns kernel specs into tests, one per spec x dtype x backend of
the session:

    # test_my_kernel.py in any project: no conftest needed
    from pallascheck.properties.pytest_plugin import spec_tests
    from my_project.specs import MY_SPEC

    test_my_kernel = spec_tests(MY_SPEC)

The options are namespaced so that they never collide with a project's own (a conftest
that adds ``--backend`` keeps working). The short names ``--backend``, ``--examples``,
``--shapes`` and ``--case-timeout`` come from a second plugin, only where a project asks
for them (``properties/pytest_short_options.py``; pallascheck's own suite does). Loading
the plugin imports neither JAX, Hypothesis nor the harness: they load with the first
test that uses pallascheck (or with ``--pallascheck-session``, or a backend named), so
that a session without pallascheck tests starts as fast as without the plugin.

The generated tests draw under pallascheck's own Hypothesis settings (``profiles()``,
chosen with $PALLASCHECK_PROFILE or --hypothesis-profile, or --pallascheck-examples):
- ci (default): derandomized, few examples, no database: never flaky, fast on 2 cores;
- dev: more examples, random seeds;
- fuzz: many examples, database on (keeps failing examples between runs);
- hardware: for the GPU backends, where examples are cheap.

A good citizen: installing pallascheck changes nothing in a session that does not ask
for it. Hypothesis' default settings, XLA's flags, JAX's compilation cache and the
environment stay the user's; the settings above reach only the tests pallascheck
generates (``spec_tests``) and the ``examples`` fixture. ``--pallascheck-session``
opts a whole session in (pallascheck's own suite does, in pyproject.toml): the chosen
profile becomes Hypothesis' default, the on-disk compilation cache is on, and XLA:CPU
compiles quickly (``properties/device/compilation.py``), with XLA:CPU's sequential thunk
order, without which the Mosaic GPU interpreter can deadlock on a machine of few
cores (``compilation.INTERPRETER_FLAGS``; ``--pallascheck-case-timeout`` then reports
the hang).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from pallascheck.kernels import backends
from pallascheck.kernels.backends import (
    ALIASES,
    ENV_VAR,
    NAMES,
    Backend,
    NotOnBackend,
    get_backend,
)
from pallascheck.properties import runner, watchdog
from pallascheck.properties.device import compilation
from pallascheck.properties.spec import KernelSpec

PROFILE_ENV_VAR = "PALLASCHECK_PROFILE"
_COMMON: dict[str, Any] = dict(deadline=None, suppress_health_check=list(HealthCheck))
# Settings objects, not registered profiles: registering would take over a user's own
# profile of the same name (``--hypothesis-profile ci``) in sessions that never use us.
PROFILES = {
    "ci": settings(max_examples=4, derandomize=True, database=None, print_blob=True, **_COMMON),
    "dev": settings(max_examples=20, **_COMMON),
    "fuzz": settings(max_examples=200, **_COMMON),
    "hardware": settings(max_examples=25, derandomize=True, database=None, print_blob=True, **_COMMON),
}


def profile_name(config: pytest.Config) -> str:
    """The pallascheck profile of a session: --hypothesis-profile where it names one of
    ours, else $PALLASCHECK_PROFILE, else ci."""
    chosen = config.getoption("hypothesis_profile", None)
    name = chosen if chosen in PROFILES else os.environ.get(PROFILE_ENV_VAR, "ci")
    if name not in PROFILES:
        raise pytest.UsageError(f"${PROFILE_ENV_VAR} must be one of {sorted(PROFILES)}, got {name!r}")
    return name


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pallascheck")
    group.addoption(
        "--backend",
        default=None,
        help=f"one of {NAMES} (tpu_interpret:SEED; {', '.join(f'{a}={n}' for a, n in ALIASES.items())}); "
        "default $PALLASCHECK_BACKEND or interpret",
    )
    group.addoption(
        "--examples",
        type=int,
        default=None,
        help="Hypothesis examples per kernel x dtype property (each checks "
        f"{runner.CASES_PER_LAYOUT} cases in the interpreters, {runner.CALLBACK_CASES_PER_LAYOUT} in "
        f"{' and '.join(backends.CALLBACK_INTERPRETERS)}, more on hardware: runner.layout_cases); default: "
        "the pallascheck profile's ($PALLASCHECK_PROFILE, ci: 4)",
    )
    group.addoption(
        "--shapes",
        choices=runner.SHAPE_TIERS,
        default="small",
        help="shape tier of the generated tests: small, or production (real model sizes; GPU backends)",
    )
    group.addoption(
        "--pallascheck-session",
        action="store_true",
        default=False,
        help="apply pallascheck's settings to the whole session, not only to its own tests: its "
        "Hypothesis profile as the default, the on-disk compilation cache (.pallascheck/jax-cache) "
        "and quick XLA:CPU compiles (XLA_FLAGS)",
    )
    group.addoption(
        "--case-timeout",
        type=float,
        default=watchdog.CASE_TIMEOUT_S,
        help="seconds one case of a spec_tests test may take before it is reported as a hang (the process ends "
        "with the report: under pytest-xdist the test fails and the worker is replaced)",
    )


@pytest.hookimpl(tryfirst=True)  # before Hypothesis' plugin loads --hypothesis-profile
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pallascheck_specs(specs): the kernel specs a spec_tests test checks")
    examples = config.getoption("--examples")
    if examples is not None and examples < 1:
        raise pytest.UsageError(f"--examples must be >= 1, got {examples}")
    if not config.getoption("--case-timeout") > 0:
        raise pytest.UsageError(f"--case-timeout must be > 0 seconds, got {config.getoption('--case-timeout')}")
    if config.getoption("--pallascheck-session"):
        for name, profile in PROFILES.items():
            settings.register_profile(name, profile)
        settings.load_profile(profile_name(config))
        # Before any test creates a JAX client: the shared on-disk cache, quick CPU compiles.
        compilation.configure(get_backend(config.getoption("--backend") or os.environ.get(ENV_VAR, "interpret")))
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
    """A test that takes ``each_backend`` runs once per backend of the session; a
    ``spec_tests`` test once per spec x dtype x backend the spec runs on."""
    if "each_backend" in metafunc.fixturenames:
        chosen = backends_under_test(metafunc.config)
        metafunc.parametrize("each_backend", chosen, ids=[str(b) for b in chosen])
    if "pallascheck_spec_case" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("pallascheck_specs")
        if marker is None:
            raise pytest.UsageError(
                f"{metafunc.definition.nodeid}: the pallascheck_spec_case fixture is for spec_tests' tests only"
            )
        specs = marker.args[0]
        cases = [
            (spec, dtype, b)
            for b in backends_under_test(metafunc.config)
            for spec in specs
            if spec.runs_on(b)
            for dtype in spec.dtypes_for(b)
        ]
        metafunc.parametrize("pallascheck_spec_case", cases, ids=[f"{s.name}-{d}-{b}" for s, d, b in cases])


class NotCheckedWarning(UserWarning):
    """A check a spec test left out of some cases (its reason in the message)."""


def spec_tests(*specs: KernelSpec):
    """A pytest test function running every check of each spec (values, contract,
    reference, configs, gradients, determinism, relations) on every dtype and backend
    of the session: assign it to a ``test_...`` name in a test module."""

    @pytest.mark.pallascheck_specs(specs)
    def test(pallascheck_spec_case: tuple[KernelSpec, str, Backend], examples: int, request: pytest.FixtureRequest):
        spec, dtype, backend = pallascheck_spec_case
        shapes = request.config.getoption("--shapes")
        if shapes == "production" and spec.production is None:
            pytest.skip(f"{spec.name} has no production shape tier")
        replay = (
            f"pytest '{request.node.nodeid}' --backend {request.config.getoption('--backend') or 'interpret'}"
            f" --shapes {shapes}"
        )
        capture = request.config.pluginmanager.getplugin("capturemanager")
        dog = watchdog.CaseWatchdog(
            request.config.getoption("--case-timeout"),
            kernel=spec.name,
            dtype=dtype,
            backend=str(backend),
            replay=replay,
            before_report=capture and (lambda: capture.suspend_global_capture(in_=False)),
        )
        with watchdog.watching(dog):
            tally = runner.run_property(
                spec, dtype, backend, examples=examples, seed=0, replay_hint=replay, search=dog.search(), shapes=shapes
            )
        assert not tally.failure, tally.failure
        # every check ran on every case (a relation once per case, none at the production
        # tier; configs_agree only where the drawn config is not the default): the
        # examples reaching the declared paths first, then random ones, at least
        # ``examples`` of them
        cases = tally.outcomes["values"].examples
        assert cases >= examples * runner.layout_cases(backend, shapes), tally.outcomes["values"]
        per_case = {"metamorphic": len(spec.relations) if shapes == "small" else 0}
        short = {
            k: o.examples
            for k, o in tally.outcomes.items()
            if k != "configs_agree" and k not in tally.left_out and o.examples != cases * per_case.get(k, 1)
        }
        assert not short, f"checks that did not run on every case: {short}"
        for check, why in tally.left_out.items():  # said in the warnings summary, never folded into the pass
            warnings.warn(
                NotCheckedWarning(f"{spec.name} {dtype} on {backend}: {check} not checked in some cases: {why}")
            )
        missed = [p for p in tally.paths_declared if not tally.paths.get(p)]
        assert not missed, (
            f"declared code paths no draw reached on {backend}: {missed}; widen the spec's shape buckets or "
            "configs so that a case reaches each (or leave the path out: dataclasses.replace(spec, paths=...))"
        )

    return test


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
def examples(request: pytest.FixtureRequest) -> int:
    """Hypothesis examples per kernel x dtype property: --examples, else the
    pallascheck profile's (``profile_name``)."""
    chosen = request.config.getoption("--examples")
    return PROFILES[profile_name(request.config)].max_examples if chosen is None else chosen
