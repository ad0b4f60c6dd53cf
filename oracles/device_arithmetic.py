"""Which arithmetic a device kind has: one answer for a campaign whose workers run on
several kinds of device (a cluster of H100, A100 and CPU-only nodes).

The tolerance model's arithmetic belongs to a platform (``tolerance.arithmetic_for``:
the GPU's tensor cores, the CPU's IEEE arithmetic). Whether a given device kind of that
platform computes the way that arithmetic assumes is measured, not assumed: ``pallascheck
probe`` (bench/probe.py, and bench/probe_fp8.py where the backend has an FP8 matrix path)
runs crafted dots there and lists the assumptions the measurement contradicts. A device
kind whose probe contradicts none has its platform's arithmetic; one whose probe
contradicts any has none: a bound derived there would not bound what the device does,
so its checks against a bound are not run there (a failure would say more about the
model than about the kernel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pallascheck.kernels.backends import Backend
from pallascheck.oracles.tolerance import Arithmetic, arithmetic_for


@dataclasses.dataclass(frozen=True)
class DeviceArithmetic:
    """The arithmetic of ``device_kind`` (JAX's ``device_kind``, "cpu" on the
    interpreters) for a backend: ``arithmetic`` where the probe found the model's
    assumptions hold there, None where it found ``violations`` ("path: assumption")."""

    device_kind: str
    arithmetic: Arithmetic | None
    violations: tuple[str, ...] = ()

    @property
    def modelled(self) -> bool:
        return self.arithmetic is not None

    def line(self) -> str:
        """One line saying what the probe found on this device kind."""
        if self.modelled:
            return f"{self.device_kind}: the tolerance model's arithmetic holds (probe)"
        return (
            f"{self.device_kind}: the tolerance model does not hold ({'; '.join(self.violations)}): "
            "its checks against a bound are not run there"
        )


def from_probe(backend: Backend, device_kind: str, probe: Mapping[str, Any]) -> DeviceArithmetic:
    """The arithmetic of ``device_kind`` from its probe (the JSON of ``pallascheck
    probe``: ``violations`` per dot path, and the FP8 paths' under ``fp8``; a probe that
    could not finish carries its reason under ``failed``)."""
    found = violations(probe)
    return DeviceArithmetic(device_kind, None if found else arithmetic_for(backend), found)


def violations(probe: Mapping[str, Any]) -> tuple[str, ...]:
    """The assumptions a probe (``from_probe``) found do not hold, each "path: what"."""
    if probe.get("failed"):
        return (f"the probe did not finish: {probe['failed']}",)
    found = [f"{path}: {v}" for path, listed in probe.get("violations", {}).items() for v in listed]
    fp8 = probe.get("fp8") or {}
    found += [f"FP8 {path}: {v}" for path, listed in fp8.get("violations", {}).items() for v in listed]
    return tuple(found)
