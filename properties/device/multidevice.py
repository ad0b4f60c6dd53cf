"""Run a check in a fresh Python process that sees N CPU devices (or N GPUs).

JAX fixes the number of CPU devices when its CPU backend starts
(``jax_num_cpu_devices``), so a check that needs a mesh of 2, 4 or 8 devices cannot
run inside a pytest worker that has already used JAX with one. ``run_with_cpu_devices``
starts a child interpreter, sets the device count before anything touches JAX, calls
``"package.module:function"(**kwargs)`` there and returns its JSON result.

The child runs under a wall-clock limit in its own process group: a kernel that
deadlocks (a DMA wait with no matching send) surfaces as ``ChildTimeout`` naming the
target, never as a hung test run. Any exception in the child surfaces as
``ChildFailed`` carrying the child's traceback. A fresh process per call also means the
TPU interpreter's global state never leaks from a failed check into the next one.

``run_with_devices(..., platform="gpu")`` does the same over the first N GPUs of the
host (``CUDA_VISIBLE_DEVICES``): one process drives them all, as the Mosaic GPU
collectives need. Every child runs with NVLink multicast switched off
(``NO_MULTICAST_ENV``), whatever the parent's environment says.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

# NVLink multicast (NVLS) can take a shared host's GPUs out of service: never on.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
PLATFORMS = ("cpu", "gpu")


class ChildFailed(RuntimeError):
    """The target raised (or the child died); the message holds its traceback."""


class ChildTimeout(TimeoutError):
    """The target did not finish within the limit: a deadlock or a hang."""


def resolve(target: str) -> Any:
    """The object named by ``"package.module:name"``."""
    if ":" not in target:
        raise ValueError(f"target must be 'package.module:name', got {target!r}")
    module_name, name = target.split(":")
    return getattr(importlib.import_module(module_name), name)


def run_with_cpu_devices(
    target: str,
    devices: int,
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout_s: float = 300.0,
    import_path: str | None = None,
) -> Any:
    """``target(**kwargs)`` in a child process with ``devices`` CPU devices; its JSON result.

    ``import_path`` is put first on the child's module path, for targets (or kernels
    the target resolves by name) that live outside installed packages, such as the
    deliberately broken kernels under tests/."""
    return run_with_devices(target, devices, kwargs, platform="cpu", timeout_s=timeout_s, import_path=import_path)


def visible_gpus(count: int) -> list[str]:
    """The first ``count`` GPUs this process sees, each as a child's
    CUDA_VISIBLE_DEVICES must name it: from this process's own list where it has one
    (a child given "0" under CUDA_VISIBLE_DEVICES=2,3 would drive GPU 0, not 2)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in visible.split(",") if i.strip()] if visible else [str(i) for i in range(count)]
    if len(ids) < count:
        raise ValueError(f"devices={count} but CUDA_VISIBLE_DEVICES={visible!r} names only {len(ids)} GPUs")
    return ids[:count]


def _child_env(platform: str, devices: int) -> dict[str, str]:
    if platform == "cpu":
        env = dict(os.environ, JAX_PLATFORMS="cpu", PALLASCHECK_CPU_DEVICES=str(devices))
    else:
        env = dict(os.environ, JAX_PLATFORMS="cuda", CUDA_VISIBLE_DEVICES=",".join(visible_gpus(devices)))
        env.pop("PALLASCHECK_CPU_DEVICES", None)
    env.update(NO_MULTICAST_ENV)
    return env


def run_with_devices(
    target: str,
    devices: int,
    kwargs: Mapping[str, Any] | None = None,
    *,
    platform: str = "cpu",
    timeout_s: float = 300.0,
    import_path: str | None = None,
) -> Any:
    """``target(**kwargs)`` in a child process that sees ``devices`` devices of
    ``platform`` ("cpu" or "gpu"); its JSON result."""
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an int >= 1, got {devices!r}")
    if ":" not in target:
        raise ValueError(f"target must be 'package.module:function', got {target!r}")
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    where = f"{devices} {'CPU devices' if platform == 'cpu' else 'GPUs'}"
    env = _child_env(platform, devices)
    if import_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (import_path, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="pallascheck-child-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        request = json.dumps({"target": target, "kwargs": dict(kwargs or {}), "result": result_path})
        proc = subprocess.Popen(
            [sys.executable, "-m", "pallascheck.properties.device.multidevice", request],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group: no orphaned JAX threads
            output, _ = proc.communicate()
            raise ChildTimeout(
                f"{target} on {where} did not finish in {timeout_s:g} s "
                f"(deadlock: a wait with no matching send?)\n--- child output (tail) ---\n{output[-4000:]}"
            ) from None
        if proc.returncode != 0 or not os.path.exists(result_path):
            raise ChildFailed(
                f"{target} on {where} failed (exit {proc.returncode})\n--- child output (tail) ---\n{output[-8000:]}"
            )
        with open(result_path) as f:
            return json.load(f)


def _child_main(request_json: str) -> None:
    import warnings

    request = json.loads(request_json)
    # As in the pytest configuration: a Pallas API the oldest supported JAX deprecates
    # is removed in a newer one, so using it is an error here too.
    warnings.filterwarnings("error", message=r".*is deprecated, use pl\.", category=DeprecationWarning)
    import jax

    # Before any JAX computation: the CPU backend reads this once, when it starts.
    if "PALLASCHECK_CPU_DEVICES" in os.environ:
        jax.config.update("jax_num_cpu_devices", int(os.environ["PALLASCHECK_CPU_DEVICES"]))
    result = resolve(request["target"])(**request["kwargs"])
    with open(request["result"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    _child_main(sys.argv[1])
