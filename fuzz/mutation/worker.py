"""A mutant inside a fuzz worker process (``workers.Worker(..., run=run_task)``).

The worker's setup may carry ``mutant``: a module name, its mutated source and the
original file. Before anything imports that module, an import hook is put first on
``sys.meta_path`` so that every import of it, the spec's included, gets a module
compiled from the mutated source. That happens in the worker process only: one
process per mutant, so no mutant outlives its run or leaks into another.

Each case is reported as it finishes: ``("checked", {"passed", "digest"})``, where
the digest covers the case (arrays, parameters, config) and every output the kernel
and its VJP returned on it, bit for bit. The unmutated baseline also records the
kernel module's executed lines (``coverage``: the module's name; its file is found
where the worker runs, which on a cluster's node may be another path than the
driver's), so that a mutant on a line no case reaches is known without running it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.abc
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

import numpy as np

from pallascheck.fuzz.workers import Task


class _MutantLoader(importlib.abc.Loader):
    def __init__(self, source: str, origin: str):
        self.source, self.origin = source, origin

    def create_module(self, spec: Any) -> None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        exec(compile(self.source, self.origin, "exec"), module.__dict__)  # noqa: S102 - the mutant is the point


class _MutantFinder(importlib.abc.MetaPathFinder):
    def __init__(self, module: str, source: str, origin: str):
        self.module, self.loader, self.origin = module, _MutantLoader(source, origin), origin

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.module:
            return None
        return importlib.util.spec_from_file_location(fullname, self.origin, loader=self.loader)


def install(module: str, source: str, origin: str) -> None:
    """Every later import of ``module`` in this process runs ``source`` instead of its file."""
    if module in sys.modules:
        raise RuntimeError(f"{module} was imported before its mutant could be installed")
    sys.meta_path.insert(0, _MutantFinder(module, source, origin))


@contextlib.contextmanager
def recording_lines(path: str | None, lines: set[int]) -> Iterator[None]:
    """Add to ``lines`` every line of ``path`` that runs inside the block (each line's
    event is switched off after its first hit, so a line costs one call). None: no
    recording."""
    if path is None:
        yield
        return
    monitoring = sys.monitoring
    tool = next(t for t in (monitoring.COVERAGE_ID, *range(6)) if monitoring.get_tool(t) is None)
    monitoring.use_tool_id(tool, "pallascheck mutate")
    target = os.path.realpath(path)
    ours: dict[str, bool] = {}

    def on_line(code: Any, line: int) -> Any:
        name = code.co_filename
        if name not in ours:
            ours[name] = os.path.realpath(name) == target
        if ours[name]:
            lines.add(line)
        return monitoring.DISABLE

    monitoring.register_callback(tool, monitoring.events.LINE, on_line)
    monitoring.set_events(tool, monitoring.events.LINE)
    try:
        yield
    finally:  # off before the process ends: at shutdown the callback's modules are gone
        monitoring.set_events(tool, monitoring.events.NO_EVENTS)
        monitoring.register_callback(tool, monitoring.events.LINE, None)
        monitoring.free_tool_id(tool)


def _digest_update(h: Any, value: Any) -> None:
    import jax

    for leaf in jax.tree.leaves(value):
        a = np.ascontiguousarray(np.asarray(jax.device_get(leaf)))
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())


def _digest(value: Any) -> bytes:
    h = hashlib.sha1()
    _digest_update(h, value)
    return h.digest()


def _recorded(fn: Callable[..., Any], outputs: list[Any]) -> Callable[..., Any]:
    """``fn`` appending every result to ``outputs``. On hardware the checks call the
    kernel inside a compiled layout program, where its result is a tracer: the values
    are then taken as the program runs (``after`` waits for them)."""
    import jax

    def recorded(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(out)):
            jax.debug.callback(outputs.append, out)
        else:
            outputs.append(out)
        return out

    return recorded


def _recording(spec: Any, outputs: list[Any]) -> Any:
    """The spec with its kernel and kernel VJP appending every result to ``outputs``."""
    gradients = spec.gradients
    if gradients is not None:
        gradients = dataclasses.replace(gradients, kernel_vjp=_recorded(gradients.kernel_vjp, outputs))
    return dataclasses.replace(spec, kernel=_recorded(spec.kernel, outputs), gradients=gradients)


_STATE: dict[str, Any] = {"lines": set()}  # this process's lines run (the baseline), and whether its mutant is in


def source_file(module: str | None) -> str | None:
    """The file ``module`` is imported from in this process (None: no module)."""
    found = None if module is None else importlib.util.find_spec(module)
    return None if found is None else found.origin


def run_task(task: Task, conn: Connection, inflight: str, setup: dict[str, Any]) -> dict[str, Any]:
    """One dtype's Hypothesis run of the (mutated) kernel's checks, no shrinking."""
    with recording_lines(source_file(setup.get("coverage")), _STATE["lines"]):
        return _run_task(task, conn, setup)


def _run_task(task: Task, conn: Connection, setup: dict[str, Any]) -> dict[str, Any]:
    import jax

    try:
        mutant = setup.get("mutant")
        if mutant is not None and not _STATE.get("installed"):
            install(mutant["module"], mutant["source"], mutant["origin"])
            _STATE["installed"] = True
        # after the mutant: the registry imports every kernel module
        from pallascheck.fuzz import targets

        spec = targets.resolve(task.target)
    except Exception as err:  # noqa: BLE001 - a mutant that does not even import is killed by it
        return {"failure": f"[crash] importing the kernel: {type(err).__name__}: {err}", "check": "crash", "lines": []}
    from pallascheck.kernels.backends import get_backend
    from pallascheck.properties import runner
    from pallascheck.properties.spec import Case

    outputs: list[Any] = []
    spec = _recording(spec, outputs)
    backend = get_backend(setup["backend"])

    def before(case: Case, config: Any) -> None:
        outputs.clear()
        conn.send(("case", None))

    def after(case: Case, config: Any, tally: runner.Tally) -> None:
        jax.effects_barrier()  # the values a compiled layout program hands to ``outputs``
        h = hashlib.sha1()
        h.update(json.dumps([dict(case.params), runner.config_to_json(config)], sort_keys=True, default=str).encode())
        _digest_update(h, dict(case.arrays))
        # sorted: on hardware the kernel VJP runs on a thread beside the forward, so the
        # order the outputs arrive in is not the kernel's to keep
        for digest in sorted(_digest(out) for out in outputs):
            h.update(digest)
        conn.send(("checked", {"passed": all(o.passed for o in tally.outcomes.values()), "digest": h.hexdigest()}))

    tally = runner.run_property(
        spec,
        task.dtype,
        backend,
        examples=task.examples,
        seed=task.seed,
        selected=task.checks,
        shrink=False,
        search=runner.Search(before_case=before, after_case=after),
    )
    return {
        "failure": tally.failure,
        "check": next((name for name, o in tally.outcomes.items() if not o.passed), None),
        "lines": sorted(_STATE["lines"]),
    }
