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

import functools
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from hypothesis import settings

    from pallascheck.kernels.backends import Backend
    from pallascheck.properties.spec import KernelSpec

PROFILE_ENV_VAR = "PALLASCHECK_PROFILE"
# What the options' help and checks need, written out here so that loading the plugin
# imports nothing heavy; tests/test_pytest_plugin.py checks each against its home
# (backends.NAMES, ALIASES and ENV_VAR, runner.SHAPE_TIERS, watchdog.CASE_TIMEOUT_S).
BACKEND_NAMES = ("interpret", "tpu_interpret", "triton", "mosaic_gpu", "mosaic_gpu_interpret", "tpu")
BACKEND_ALIASES = {"gpu": "mosaic_gpu"}
BACKEND_ENV_VAR = "PALLASCHECK_BACKEND"
SHAPE_TIERS = ("small", "production")
CASE_TIMEOUT_S = 300.0
PRODUCTION_CASE_TIMEOUT_S = 1800.0
PREFIX = "pallascheck-"
# The options by their short name: each is --pallascheck-NAME here, and --NAME too where
# a project enables properties/pytest_short_options.py; both write one dest (``dest``).
OPTIONS: dict[str, dict[str, Any]] = {
    "backend": dict(
        default=None,
        help=f"one of {BACKEND_NAMES} (tpu_interpret:SEED; "
        f"{', '.join(f'{a}={n}' for a, n in BACKEND_ALIASES.items())}); default ${BACKEND_ENV_VAR} or interpret",
    ),
    "examples": dict(
        type=int,
        default=None,
        help="Hypothesis examples per kernel x dtype property, each a few cases of one compiled layout "
        "(runner.layout_cases); default: the pallascheck profile's ($PALLASCHECK_PROFILE; ci: as many as "
        "pallascheck verify's --examples, runner.EXAMPLES)",
    ),
    "shapes": dict(
        choices=SHAPE_TIERS,
        default=None,
        help="shape tier of the generated tests: small (the default), or production (real model sizes; GPU backends)",
    ),
    "case-timeout": dict(
        type=float,
        default=None,
        help=f"seconds one case of a spec_tests test may take before it is reported as a hang (default "
        f"{CASE_TIMEOUT_S:g}, at --pallascheck-shapes production {PRODUCTION_CASE_TIMEOUT_S:g}; the process ends with the report: under pytest-xdist the test fails and the worker "
        "is replaced)",
    ),
}


def dest(name: str) -> str:
    """Where the option ``name`` (its short name, a key of ``OPTIONS``) is stored."""
    return "pallascheck_" + name.replace("-", "_")


def option(config: pytest.Config, name: str) -> Any:
    """The value given to --pallascheck-NAME (or its short alias), None where not given."""
    return config.getoption(dest(name))


@functools.cache
def profiles() -> dict[str, settings]:
    """pallascheck's Hypothesis settings by profile name. Settings objects, not registered
    profiles: registering would take over a user's own profile of the same name
    (``--hypothesis-profile ci``) in sessions that never use us."""
    from hypothesis import HealthCheck, settings  # Hypothesis loads with the first pallascheck test (~0.2 s)

    from pallascheck.properties.runner import EXAMPLES  # verify's default too: one number for both

    common: dict[str, Any] = dict(deadline=None, suppress_health_check=list(HealthCheck))
    return {
        "ci": settings(max_examples=EXAMPLES, derandomize=True, database=None, print_blob=True, **common),
        "dev": settings(max_examples=20, **common),
        "fuzz": settings(max_examples=200, **common),
        "hardware": settings(max_examples=25, derandomize=True, database=None, print_blob=True, **common),
    }


PROFILE_NAMES = ("ci", "dev", "fuzz", "hardware")  # the keys of profiles(), known without building them


def profile_name(config: pytest.Config) -> str:
    """The pallascheck profile of a session: --hypothesis-profile where it names one of
    ours, else $PALLASCHECK_PROFILE, else ci."""
    chosen = config.getoption("hypothesis_profile", None)
    name = chosen if chosen in PROFILE_NAMES else os.environ.get(PROFILE_ENV_VAR, "ci")
    if name not in PROFILE_NAMES:
        raise pytest.UsageError(f"${PROFILE_ENV_VAR} must be one of {list(PROFILE_NAMES)}, got {name!r}")
    return name


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pallascheck")
    for name, attrs in OPTIONS.items():
        group.addoption(f"--{PREFIX}{name}", dest=dest(name), **attrs)
    group.addoption(
        "--pallascheck-session",
        action="store_true",
        default=False,
        help="apply pallascheck's settings to the whole session, not only to its own tests: its "
        "Hypothesis profile as the default, the on-disk compilation cache (.pallascheck/jax-cache) "
        "and quick XLA:CPU compiles (XLA_FLAGS)",
    )


@pytest.hookimpl(tryfirst=True)  # before Hypothesis' plugin loads --hypothesis-profile
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pallascheck_specs(specs): the kernel specs a spec_tests test checks")
    examples = option(config, "examples")
    if examples is not None and examples < 1:
        raise pytest.UsageError(f"--{PREFIX}examples must be >= 1, got {examples}")
    timeout = option(config, "case-timeout")
    if timeout is not None and not timeout > 0:
        raise pytest.UsageError(f"--{PREFIX}case-timeout must be > 0 seconds, got {timeout}")
    if config.getoption("pallascheck_session"):
        from hypothesis import settings  # the session opted in: Hypothesis' default becomes our profile

        # the session opted in: its compile settings, before any test creates a JAX client
        from pallascheck.properties.device import compilation

        for name, profile in profiles().items():
            settings.register_profile(name, profile)
        settings.load_profile(profile_name(config))
        # Before any test creates a JAX client: the shared on-disk cache, quick CPU compiles.
        compilation.configure(backends_under_test(config)[0])
    # A backend that cannot run here stops the session at once, saying what is missing:
    # one that was named, or any in a session that opted in (a session that did neither
    # runs on the CPU interpreters, which every supported JAX has: nothing loads here).
    named = option(config, "backend") is not None or os.environ.get(BACKEND_ENV_VAR)
    if named or config.getoption("pallascheck_session"):
        for chosen in backends_under_test(config):
            try:
                chosen.require_available()
            except RuntimeError as missing:
                raise pytest.UsageError(str(missing)) from None


def backends_under_test(config: pytest.Config) -> list[Backend]:
    """The backends a session checks: the one chosen; with the CPU default
    (``interpret``) also ``mosaic_gpu_interpret``, so that the Mosaic GPU kernels are
    checked on every CPU run, in their own interpreter."""
    # JAX loads with the first test (or option) that needs a backend, not with the plugin
    from pallascheck.kernels.backends import Backend, get_backend

    try:
        chosen = get_backend(option(config, "backend"))
    except ValueError as err:
        raise pytest.UsageError(f"--{PREFIX}backend: {err}") from None
    return [chosen, Backend("mosaic_gpu_interpret")] if chosen.name == "interpret" else [chosen]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes ``each_backend`` runs once per backend of the session; a
    ``spec_tests`` test once per spec x dtype x backend the spec runs on, and at the
    production tier once per production layout too (each named layout is checked, as
    ``pallascheck verify --shapes production`` checks it)."""
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
        production = option(metafunc.config, "shapes") == "production"
        cases = [
            (spec, dtype, b, layout)
            for b in backends_under_test(metafunc.config)
            for spec in specs
            if spec.runs_on(b)
            for dtype in spec.dtypes_for(b)
            for layout in ([l.name for l in spec.production_layouts] if production else []) or [None]
        ]
        metafunc.parametrize(
            "pallascheck_spec_case",
            cases,
            ids=[f"{s.name}-{d}-{b}" + (f"-{layout.split(':')[0]}" if layout else "") for s, d, b, layout in cases],
        )


class NotCheckedWarning(UserWarning):
    """A check a spec test left out of some cases (its reason in the message)."""


def spec_tests(*specs: KernelSpec):
    """A pytest test function running every check of each spec (values, contract,
    reference, configs, gradients, determinism, relations) on every dtype and backend
    of the session: assign it to a ``test_...`` name in a test module."""

    @pytest.mark.pallascheck_specs(specs)
    def test(
        pallascheck_spec_case: tuple[KernelSpec, str, Backend, str | None],
        examples: int,
        request: pytest.FixtureRequest,
    ):
        # the harness loads with the first spec test, not with the plugin
        from pallascheck.properties import production, runner, watchdog

        spec, dtype, backend, layout = pallascheck_spec_case
        shapes = option(request.config, "shapes") or "small"
        if shapes == "production" and spec.production is None:
            pytest.skip(f"{spec.name} has no production shape tier")
        if layout is not None:
            planned = production.plan([l for l in spec.production_layouts if l.name == layout], backend)
            if planned.skipped:  # the memory rule's line: what it needs, what the device allows
                pytest.skip(f"not checked: {planned.skipped[0]}")
        per_layout = runner.example_cases(spec, backend, shapes, layout)
        replay = replay_command(request.config, request.node.nodeid)
        capture = request.config.pluginmanager.getplugin("capturemanager")
        dog = watchdog.CaseWatchdog(
            option(request.config, "case-timeout") or watchdog.case_timeout(shapes),
            kernel=spec.name,
            dtype=dtype,
            backend=str(backend),
            replay=replay,
            before_report=capture and (lambda: capture.suspend_global_capture(in_=False)),
        )
        with watchdog.watching(dog):
            tally = runner.run_property(
                spec,
                dtype,
                backend,
                examples=examples,
                seed=0,
                replay_hint=replay,
                search=dog.search(),
                shapes=shapes,
                layout=layout,
            )
        # pytest.fail without its traceback: the message says what failed, where and how
        # to replay it; this generated test's source above it would only bury that
        if tally.failure:
            pytest.fail(tally.failure, pytrace=False)
        if tally.stopped:  # no finding, and the cases left were not checked
            pytest.skip(f"not checked: {tally.stopped}")
        # every check ran on every case (a relation once per case, none at the production
        # tier; configs_agree only where the drawn config is not the default): the
        # examples reaching the declared paths first, then random ones, at least
        # ``examples`` of them
        cases = tally.outcomes["values"].examples
        assert cases >= examples * per_layout, tally.outcomes["values"]
        per_case = {"metamorphic": len(spec.relations) if shapes == "small" else 0}
        short = {
            k: o.examples
            for k, o in tally.outcomes.items()
            if k != "configs_agree" and k not in tally.left_out and o.examples != cases * per_case.get(k, 1)
        }
        if short:
            pytest.fail(f"checks that did not run on every case: {short}", pytrace=False)
        for check, why in tally.left_out.items():  # said in the warnings summary, never folded into the pass
            warnings.warn(
                NotCheckedWarning(f"{spec.name} {dtype} on {backend}: {check} not checked in some cases: {why}")
            )
        inferred = [p for p in tally.paths_declared if p not in tally.paths_required and not tally.paths.get(p)]
        if inferred:  # the user's buckets never reach what their tiling suggests: said, not failed
            warnings.warn(NotCheckedWarning(f"{spec.name} {dtype} on {backend}: code paths not reached: {inferred}"))
        missed = [p for p in tally.paths_required if not tally.paths.get(p)]
        if missed:
            pytest.fail(
                f"declared code paths no draw reached on {backend}: {missed}; widen the spec's shape buckets or "
                "configs so that a case reaches each (or leave the path out: dataclasses.replace(spec, paths=...))",
                pytrace=False,
            )

    return test


def replay_command(config: pytest.Config, nodeid: str) -> str:
    """The command that runs the test ``nodeid`` again as this session ran it, with the
    namespaced options, which every project that installs pallascheck has."""
    return (
        f"pytest '{nodeid}' --{PREFIX}backend {backends_under_test(config)[0]}"
        f" --{PREFIX}shapes {option(config, 'shapes') or 'small'}"
        f" --{PREFIX}examples {examples_of(config)}"
    )


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    """A kernel with no version for the session's backend is reported as skipped,
    with the kernel's own message saying which backends it has."""
    try:
        return (yield)
    except NotImplementedError as missing:
        # NotOnBackend is one; a kernel that raised it has loaded its module (nothing to import here)
        backends = sys.modules.get("pallascheck.kernels.backends")
        if backends is not None and isinstance(missing, backends.NotOnBackend):
            pytest.skip(f"not on this backend: {missing}")
        raise


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> Backend:
    """The backend under test (checked at the session's start: it runs here)."""
    return backends_under_test(request.config)[0]


def examples_of(config: pytest.Config) -> int:
    """Hypothesis examples per kernel x dtype property: --pallascheck-examples, else the
    pallascheck profile's (``profile_name``)."""
    chosen = option(config, "examples")
    return profiles()[profile_name(config)].max_examples if chosen is None else chosen


@pytest.fixture(scope="session")
def examples(request: pytest.FixtureRequest) -> int:
    """Hypothesis examples per kernel x dtype property: --pallascheck-examples, else the
    pallascheck profile's (``profile_name``)."""
    return examples_of(request.config)
