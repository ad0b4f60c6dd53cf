"""What a campaign fuzzes, named by a string that a worker process can resolve.

A target is a registered kernel ("matmul"), an outside kernel ("jax:gpu.softmax",
"tokamax:layer_norm:xla") or ``module:NAME`` for a spec defined elsewhere
(``spec.module_spec``). Workers are separate processes, so a spec travels as this
string, with the import paths it needs.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Sequence

from pallascheck.properties.registry import bundled_names, get_spec, is_module_target, registry
from pallascheck.properties.spec import KernelSpec


def import_problem(target: str, err: ModuleNotFoundError) -> str:
    """What to do about ``MODULE:NAME`` whose import raised ``err`` (one line): add the
    directory that holds the module, or install what the module imports."""
    module = target.partition(":")[0]
    if err.name and (module == err.name or module.startswith(err.name + ".")):
        return (
            f"no module {module!r} on the import path (searched: the current directory {os.getcwd()} and "
            f"each --path): add --path DIR, the directory that holds {module.replace('.', '/')}.py"
        )
    return f"module {module} imports {err.name!r}, which is not installed here ({err})"


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


def check_names(targets: Sequence[str], option: str = "--kernel") -> None:
    """Resolve every target once; a ValueError names each that does not resolve (an
    unknown name with its close matches, a module that does not import with what to
    add, a module without that spec with its close matches), so that a campaign creates
    nothing for a typo."""
    problems = []
    for target in targets:
        try:
            resolve(target)
        except KeyError:
            problems.append(f"{option}: {unknown_name(target, [*registry(), *bundled_names()])}")
        except (ImportError, ValueError) as err:
            # a user's MODULE:NAME that does not import: what to add (Tokamax's own says what to install)
            user_module = isinstance(err, ModuleNotFoundError) and is_module_target(target)
            why = import_problem(target, err) if isinstance(err, ModuleNotFoundError) and user_module else str(err)
            problems.append(f"{option} {target}: {why}")
    if problems:
        raise ValueError("; ".join(problems))
