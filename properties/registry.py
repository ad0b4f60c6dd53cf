"""The registry of kernel specs: the shipped kernels' (registered on import), those of
installed packages (the ``pallascheck.specs`` entry-point group), a user's module's
(``MODULE:NAME``) and the outside kernels' (JAX's bundled ones, Tokamax's), built on
request. It sits above the families it lists."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Sequence

from pallascheck.kernels.backends import GENERIC
from pallascheck.properties.families.attention import SPEC as ATTENTION
from pallascheck.properties.families.cross_entropy import SPEC as CROSS_ENTROPY
from pallascheck.properties.families.fp8_matmul import QUANTIZE_SPEC as FP8_QUANTIZE
from pallascheck.properties.families.fp8_matmul import SPEC as FP8_MATMUL
from pallascheck.properties.families.gated_linear_unit import SPEC as GATED_LINEAR_UNIT
from pallascheck.properties.families.linear_cross_entropy import (
    SPEC as LINEAR_CROSS_ENTROPY,
)
from pallascheck.properties.families.matmul import SPEC as MATMUL
from pallascheck.properties.families.norms import LAYER_NORM, RMS_NORM
from pallascheck.properties.families.ragged_dot import SPEC as RAGGED_DOT
from pallascheck.properties.families.top_k import SPEC as TOP_K
from pallascheck.properties.outside import jax_bundled
from pallascheck.properties.outside import tokamax as tokamax_client
from pallascheck.properties.spec import KernelSpec

_REGISTRY: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
    """Add (or replace) a spec; returns it so it can be used as a decorator result."""
    _REGISTRY[spec.name] = spec
    return spec


ENTRY_POINTS = "pallascheck.specs"
_entry_points_loaded = False


def registry() -> dict[str, KernelSpec]:
    """All registered specs: the built-in kernels first, then those of installed packages
    that declare an entry point in the group ``pallascheck.specs`` (a KernelSpec, or a
    module that registers its specs on import), e.g. in pyproject.toml::

        [project.entry-points."pallascheck.specs"]
        my_kernels = "my_package.specs"
    """
    global _entry_points_loaded
    if not _entry_points_loaded:
        _entry_points_loaded = True
        from importlib.metadata import entry_points

        for entry in entry_points(group=ENTRY_POINTS):
            loaded = entry.load()
            if isinstance(loaded, KernelSpec):
                register(loaded)
    return dict(_REGISTRY)


def bundled_names() -> list[str]:
    """The specs of kernels that are not ours, built on request, never part of the
    default registry: JAX's bundled Pallas kernels ("jax:gpu.attention", ...) and,
    where Tokamax is installed, Tokamax's ops ("tokamax:layer_norm:xla", ...)."""
    return sorted(jax_bundled.BUNDLED) + tokamax_client.names()


def is_module_target(name: str) -> bool:
    """``MODULE:NAME``: a spec defined in a user's module (not "jax:..." or "tokamax:...")."""
    return ":" in name and not name.startswith(("jax:", "tokamax:"))


def module_spec(target: str) -> KernelSpec:
    """The spec ``MODULE:NAME`` names: ``NAME`` is a ``KernelSpec`` attribute of the
    importable module, or a key of its ``VARIANTS`` dict (the broken kernels of
    ``tests/broken``, whose values are (spec, dtypes, examples), on the module's
    ``BACKENDS``). Renamed to ``target``, so that reports, saved cases and replay
    commands name it the way it was asked for."""
    module_name, _, name = target.partition(":")
    module = importlib.import_module(module_name)
    if isinstance(getattr(module, name, None), KernelSpec):
        spec = getattr(module, name)
    elif name in getattr(module, "VARIANTS", {}):
        spec = dataclasses.replace(module.VARIANTS[name][0], backends=getattr(module, "BACKENDS", GENERIC))
    else:
        raise ValueError(_no_spec_named(module, name))
    return dataclasses.replace(spec, name=target)


def _no_spec_named(module: object, name: str) -> str:
    """Why ``module`` has no spec ``name``, and what it has instead (one line)."""
    where = f"module {getattr(module, '__name__', module)} ({getattr(module, '__file__', '?')})"
    found = getattr(module, name, None)
    if callable(found) and not isinstance(found, type):
        return (
            f"{where}: {name!r} is a function, not a KernelSpec: give the module a spec at its top level "
            f"(SPEC = {name}()) and name that"
        )
    specs = sorted(k for k, v in vars(module).items() if isinstance(v, KernelSpec))
    specs += sorted(getattr(module, "VARIANTS", {}))
    if not specs:
        return f"{where} defines no KernelSpec at its top level (assign one to a name, e.g. SPEC = from_reference(...))"
    close = difflib.get_close_matches(name, specs, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"its specs: {', '.join(specs)}"
    return f"{where} has no KernelSpec {name!r}: {hint}"


def get_spec(name: str) -> KernelSpec:
    if is_module_target(name):
        return module_spec(name)
    specs = registry()
    if name in specs:
        return specs[name]
    if name in jax_bundled.BUNDLED:
        return jax_bundled.spec(name)
    if name in tokamax_client.TOKAMAX:
        return tokamax_client.spec(name)  # without Tokamax: ModuleNotFoundError saying how to install it
    raise KeyError(f"no kernel spec named {name!r}; registered: {sorted(specs)}; outside kernels: {bundled_names()}")


def selected(names: Sequence[str] | None) -> dict[str, KernelSpec]:
    """The specs named (every registered one for None), bundled ones included."""
    return (
        dict(registry())
        if not names
        else {n: get_spec(n) for n in names if n in registry() or n in bundled_names() or is_module_target(n)}
    )


for _spec in (
    MATMUL,
    LAYER_NORM,
    RMS_NORM,
    ATTENTION,
    CROSS_ENTROPY,
    LINEAR_CROSS_ENTROPY,
    RAGGED_DOT,
    GATED_LINEAR_UNIT,
    TOP_K,
    FP8_MATMUL,
    FP8_QUANTIZE,
):
    register(_spec)
