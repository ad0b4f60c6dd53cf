"""The candidate: loaded from ``FILE.py:NAME`` or ``MODULE:NAME``, called as the task says.

A fresh copy (the module executed again under a new name) is a candidate with none of
the state that earlier calls left in its module: the hidden-state probe compares it
with the copy that has been called.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_COPIES = itertools.count()


class NotLoadable(Exception):
    """The candidate could not be imported or is not a callable of that name."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A candidate function and where it came from (``source``: what reloads it)."""

    fn: Callable[..., Any]
    source: str  # FILE.py:NAME or MODULE:NAME; "" for a callable handed in directly

    @property
    def name(self) -> str:
        return self.source or getattr(self.fn, "__qualname__", repr(self.fn))

    def call(self, interpret: Any, *inputs: Any, **options: Any) -> Any:
        """``fn(*inputs, **options)``, with ``interpret=interpret`` (the backend's
        ``interpret_arg()``) where ``fn`` takes that keyword (a candidate without it
        picks its backend itself)."""
        if _takes_interpret(self.fn):
            options["interpret"] = interpret
        return self.fn(*inputs, **options)

    def fresh(self) -> Candidate | None:
        """A copy loaded anew from its source (None: nothing to reload it from)."""
        file, name = _file_and_name(self)
        if file is None:
            return None
        module = _exec_file(file, f"pallascheck_gate_fresh_{next(_COPIES)}_{Path(file).stem}")
        return Candidate(_attribute(module, name, file), self.source)


def _takes_interpret(fn: Callable[..., Any]) -> bool:
    try:
        return "interpret" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or an object without a signature
        return False


def _file_and_name(candidate: Candidate) -> tuple[str | None, str]:
    if candidate.source:
        where, _, name = candidate.source.rpartition(":")
        if where.endswith(".py"):
            return where, name
        module = sys.modules.get(where)
        return getattr(module, "__file__", None), name
    fn = candidate.fn
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    qualname = getattr(fn, "__qualname__", "")
    if (
        module is None
        or module.__name__ == "__main__"
        or "." in qualname
        or "<" in qualname
        or getattr(module, qualname, None) is not fn
    ):
        # a closure, a partial, a method or a script's function (running the script again
        # would run its main code): no module-level name to reload
        return None, ""
    return getattr(module, "__file__", None), qualname


def _exec_file(file: str, module_name: str) -> Any:
    module_spec = importlib.util.spec_from_file_location(module_name, file)
    if module_spec is None or module_spec.loader is None:
        raise NotLoadable(f"candidate: {file} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise NotLoadable(f"candidate: importing {file} raised {type(err).__name__}: {err}") from err
    return module


def _attribute(module: Any, name: str, where: str) -> Callable[..., Any]:
    fn = getattr(module, name, None)
    if not callable(fn):
        raise NotLoadable(f"candidate: {where} has no callable {name!r}")
    return fn


def load_candidate(source: str) -> Candidate:
    """The candidate ``FILE.py:NAME`` or ``MODULE:NAME`` names; NotLoadable where it
    cannot be imported or is no callable."""
    where, sep, name = source.rpartition(":")
    if not sep or not where or not name:
        raise NotLoadable(f"candidate: {source!r} must be FILE.py:NAME or MODULE:NAME")
    if where.endswith(".py"):
        if not Path(where).is_file():
            raise NotLoadable(f"candidate: no file {where}")
        module = _exec_file(where, f"pallascheck_gate_candidate_{next(_COPIES)}_{Path(where).stem}")
    else:
        try:
            module = importlib.import_module(where)
        except Exception as err:
            raise NotLoadable(f"candidate: importing {where} raised {type(err).__name__}: {err}") from err
    return Candidate(_attribute(module, name, where), source)
