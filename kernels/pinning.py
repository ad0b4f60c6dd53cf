"""Pinned configs: which config a kernel runs with when its caller passes none.

A kernel resolves ``config=None`` through ``choose``: the config pinned for this call's
key (kernel, input shapes and dtypes, options, backend) if one is pinned, else the
default. Configs are pinned by an autotuning result (``pallascheck.autotune``: ``with
result:``, ``pallascheck.use_configs(path)`` or ``$PALLASCHECK_CONFIGS``). While an
autotuner traces a function, ``recording`` collects every kernel call it makes, which
is how the autotuner finds the kernels inside a user's function.

Configs travel as JSON: ``{"type": "matmul.Config", "fields": {...}}``. A result file
(``parse_result``) is valid only where it was tuned: the same device kind, jax and
jaxlib versions; elsewhere it warns once and pins nothing (the defaults run; nothing
is re-tuned behind the caller's back).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import json
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

ENV_VAR = "PALLASCHECK_CONFIGS"  # a result file whose configs every kernel uses
FORMAT, VERSION = "pallascheck.autotune", 1

_PINNED: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar("pallascheck_pinned", default=None)
_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("pallascheck_recording", default=None)


@dataclasses.dataclass(frozen=True)
class Call:
    """One kernel call seen while recording: its key, its array arguments (concrete
    where the caller ran eagerly, else ``jax.ShapeDtypeStruct``s) and its options."""

    kernel: str
    key: str
    arrays: Mapping[str, Any]
    options: Mapping[str, Any]
    backend: str
    explicit_config: bool  # the caller chose the config: nothing to tune


def _aval(x: Any) -> str:
    return f"{np.dtype(x.dtype).name}{list(x.shape)}"


def call_key(kernel: str, arrays: Mapping[str, Any], options: Mapping[str, Any], backend: str) -> str:
    """``kernel|name=dtype[shape],...|option=value,...|backend``: what makes two calls
    run the same compiled kernel (arrays that are None are left out)."""
    shapes = ",".join(f"{n}={_aval(a)}" for n, a in arrays.items() if a is not None)
    opts = ",".join(f"{k}={v!r}" for k, v in sorted(options.items()))
    return f"{kernel}|{shapes}|{opts}|{backend}"


def choose(
    kernel: str, config: Any, default: Any, *, arrays: Mapping[str, Any], options: Mapping[str, Any], backend: str
) -> Any:
    """``config`` if given; else the config pinned for this call, if it has the type of
    ``default`` (a Mosaic GPU config is never given to the generic kernel); else
    ``default``. Records the call while ``recording``. The call key is formed only when
    a result is pinned or calls are recorded: every kernel call comes through here."""
    calls = _RECORDING.get()
    pinned = _PINNED.get()
    if pinned is None and os.environ.get(ENV_VAR):
        pinned = _pins_from_file(os.environ[ENV_VAR])
    if calls is None and (config is not None or not pinned):
        return default if config is None else config
    key = call_key(kernel, arrays, options, backend)
    if calls is not None:
        concrete = {
            n: (a if not isinstance(a, jax.core.Tracer) else jax.ShapeDtypeStruct(a.shape, a.dtype))
            for n, a in arrays.items()
            if a is not None
        }
        calls.append(Call(kernel, key, concrete, dict(options), backend, config is not None))
    if config is not None:
        return config
    chosen = pinned.get(key) if pinned else None
    return chosen if isinstance(chosen, type(default)) else default


@contextlib.contextmanager
def recording() -> Iterator[list[Call]]:
    """Collect the kernel calls made inside the block."""
    calls: list[Call] = []
    token = _RECORDING.set(calls)
    try:
        yield calls
    finally:
        _RECORDING.reset(token)


@contextlib.contextmanager
def pinned(configs: Mapping[str, Any]) -> Iterator[None]:
    """Run the block with ``configs`` (call key -> config) pinned; nested pins replace."""
    token = _PINNED.set(dict(configs))
    try:
        yield
    finally:
        _PINNED.reset(token)


def config_to_json(config: Any) -> dict[str, Any]:
    kind = type(config)
    return {"type": f"{kind.__module__.rsplit('.', 1)[-1]}.{kind.__name__}", "fields": dataclasses.asdict(config)}


def config_from_json(data: Any, where: str) -> Any:
    """The Config ``data`` describes; ``where`` names the file and field in errors."""
    if not isinstance(data, dict) or not isinstance(data.get("type"), str) or not isinstance(data.get("fields"), dict):
        raise ValueError(f"{where}: a config must be {{'type': 'module.Config', 'fields': {{...}}}}, got {data!r}")
    module_name, _, class_name = data["type"].partition(".")
    try:
        kind = getattr(importlib.import_module(f"pallascheck.kernels.{module_name}"), class_name)
    except (ImportError, AttributeError):
        raise ValueError(f"{where}.type: no pallascheck config type {data['type']!r}") from None
    if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
        raise ValueError(f"{where}.type: {data['type']!r} is not a config type")
    try:
        return kind(**data["fields"])
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}.fields: {err}") from None


def environment() -> dict[str, str]:
    """What a tuned config is valid for: the device kind and the jax/jaxlib versions."""
    import jaxlib

    return {"device_kind": jax.devices()[0].device_kind, "jax": jax.__version__, "jaxlib": jaxlib.__version__}


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in data:
        raise ValueError(f"{where}: missing field {name!r}")
    if not isinstance(data[name], kind):
        raise ValueError(f"{where}.{name}: expected {getattr(kind, '__name__', kind)}, got {data[name]!r}")
    return data[name]


def parse_result(text: str, source: str) -> dict[str, Any]:
    """The autotuning result in ``text`` (read from ``source``), checked field by
    field; ``ValueError`` names the source and the field that is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{source}: not a pallascheck autotuning result (invalid JSON: {err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{source}: not a pallascheck autotuning result (field 'format' must be {FORMAT!r})")
    if _field(data, "version", int, source) != VERSION:
        raise ValueError(f"{source}.version: {data['version']} is not supported (this pallascheck reads {VERSION})")
    env = _field(data, "environment", dict, source)
    for name in ("device_kind", "jax", "jaxlib"):
        _field(env, name, str, f"{source}.environment")
    for i, entry in enumerate(_field(data, "entries", list, source)):
        where = f"{source}.entries[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object, got {entry!r}")
        _field(entry, "kernel", str, where)
        _field(entry, "key", str, where)
        if entry.get("chosen") is not None:
            config_from_json(entry["chosen"], f"{where}.chosen")
        _field(entry, "candidates", list, where)
        _field(entry, "rejected", list, where)
    return data


def pins_of(data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Call key -> config of a parsed result, or {} with a warning where the result was
    tuned on another device or jax (once per source and environment)."""
    here = environment()
    if data["environment"] != here:
        _warn_stale(source, json.dumps(data["environment"], sort_keys=True), json.dumps(here, sort_keys=True))
        return {}
    return {
        e["key"]: config_from_json(e["chosen"], f"{source}.{e['key']}.chosen")
        for e in data["entries"]
        if e.get("chosen") is not None
    }


@functools.cache
def _warn_stale(source: str, tuned: str, here: str) -> None:
    warnings.warn(
        f"{source} was tuned for {tuned}, this is {here}: its configs are not used, every kernel runs "
        "its default config (re-run pallascheck autotune here)",
        stacklevel=4,
    )


@functools.cache
def _pins_from_file(path: str) -> dict[str, Any]:  # read once per process
    with open(path) as f:
        return pins_of(parse_result(f.read(), path), path)
