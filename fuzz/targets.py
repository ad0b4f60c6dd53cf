"""What a campaign fuzzes, named by a string that a worker process can resolve.

A target is a registered kernel ("matmul"), an outside kernel ("jax:gpu.softmax",
"tokamax:layer_norm:xla") or ``module:NAME``
for a spec defined elsewhere: ``NAME`` is a ``KernelSpec`` attribute of the module,
or a key of its ``VARIANTS`` dict (the broken kernels of ``tests/broken``, whose
values are (spec, dtypes, examples)). Workers are separate processes, so a spec
travels as this string, with the import paths it needs.
"""
from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Sequence

from pallascheck.kernels.backends import GENERIC
from pallascheck.properties.spec import KernelSpec, get_spec


def add_paths(paths: Sequence[str]) -> None:
    """Put ``paths`` first on ``sys.path`` (once each), where ``module:NAME`` targets live."""
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)


def resolve(target: str) -> KernelSpec:
    """The spec ``target`` names, renamed to ``target`` so that reports, saved cases
    and replays name it the way the campaign was asked to."""
    if ":" not in target or target.startswith(("jax:", "tokamax:")):
        return get_spec(target)
    module_name, _, name = target.partition(":")
    module = importlib.import_module(module_name)
    if isinstance(getattr(module, name, None), KernelSpec):
        spec = getattr(module, name)
    elif name in getattr(module, "VARIANTS", {}):
        spec = dataclasses.replace(module.VARIANTS[name][0], backends=getattr(module, "BACKENDS", GENERIC))
    else:
        raise ValueError(f"target {target!r}: module {module_name} has no KernelSpec {name!r} and no VARIANTS[{name!r}]")
    return dataclasses.replace(spec, name=target)
