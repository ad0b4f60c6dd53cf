"""What a campaign fuzzes, named by a string that a worker process can resolve.

A target is a registered kernel ("matmul"), an outside kernel ("jax:gpu.softmax",
"tokamax:layer_norm:xla") or ``module:NAME`` for a spec defined elsewhere
(``spec.module_spec``). Workers are separate processes, so a spec travels as this
string, with the import paths it needs.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable, Sequence

from pallascheck.properties.registry import bundled_names, get_spec, registry
from pallascheck.properties.spec import KernelSpec


def add_paths(paths: Sequence[str]) -> None:
    """Put ``paths`` first on ``sys.path`` (once each), where ``module:NAME`` targets live."""
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)


def resolve(target: str) -> KernelSpec:
    """The spec ``target`` names (a ``module:NAME`` spec renamed to ``target``:
    spec.module_spec)."""
    return get_spec(target)


def unknown_name(name: str, known: Iterable[str]) -> str:
    """Why ``name`` is not a kernel, with the close matches among ``known`` (or all of
    them when none is close)."""
    known = sorted(set(known))
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else f"known kernels: {', '.join(known)}"
    return f"no kernel named {name!r}: {hint}"


def check_names(targets: Sequence[str]) -> None:
    """Resolve every target once; a ValueError names each that does not resolve (an
    unknown name with its close matches, a module or spec that does not import), so
    that a campaign creates nothing for a typo."""
    problems = []
    for target in targets:
        try:
            resolve(target)
        except KeyError:
            problems.append(unknown_name(target, [*registry(), *bundled_names()]))
        except (ImportError, ValueError) as err:
            problems.append(f"{target!r}: {err}")
    if problems:
        raise ValueError("; ".join(problems))
