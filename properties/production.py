"""The production shape tier: the sizes models run at, per kernel family.

The small tier (each spec's ``cases``) is fast and reaches every code path of a
kernel, but some bugs only show at scale: a pipeline slot reused after thousands of
steps, a group of 1024 rows, a reduction of 16384 terms. ``--shapes production``
draws each family's named layouts instead (its spec's ``production_layouts``, beside
the family in properties/families/<op>.py), each taken from a real model (the values
drawn in them, adversarial kinds included, are the family's own, as in the small
tier). A layout whose check would not fit the device is skipped by rule and said so
(``plan``): its footprint, bytes per element of the check's largest array (the
oracle's, or the kernel's or xla_reference's where that is larger), set from the peak
device memory of one production check per family on an H100 (docs/results.md) with
about 20% to spare, against what JAX may allocate on the device.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from hypothesis import strategies as st

from pallascheck.kernels.backends import Backend
from pallascheck.properties import strategies
from pallascheck.properties.device import compilation
from pallascheck.properties.spec import Case, KernelSpec, Layout, ProductionCases

# How many worker processes share each device: each plans with its share of the
# device's memory. Two verify workers that each planned with the whole H100 ran out of
# memory on a ragged_dot layout.
SHARING_ENV_VAR = compilation.SHARING_ENV_VAR


def share_devices(processes_per_device: int) -> None:
    """Declare that this process's workers share each device ``processes_per_device``
    ways (the workers inherit it through the environment)."""
    os.environ[SHARING_ENV_VAR] = str(max(1, processes_per_device))


def device_memory(backend: Backend) -> int:
    """Bytes JAX may allocate where the backend's oracles run: the device's allocator
    limit on a GPU; the host's physical memory on the CPU."""
    if backend.platform != "cpu":
        stats = jax.devices(backend.platform)[0].memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit(backend: Backend) -> int:
    """This process's share of ``device_memory``: on a GPU, divided among the processes
    that share the device (a worker whose allocator is held to its share: JAX's limit)."""
    total = device_memory(backend)
    if backend.platform == "cpu" or compilation.allocator_capped():
        return total
    return total // compilation.processes_per_device()


@dataclasses.dataclass(frozen=True)
class Plan:
    fitting: tuple[Layout, ...]
    skipped: tuple[str, ...]  # one line per layout that does not fit, saying why


def plan(layouts: Sequence[Layout], backend: Backend) -> Plan:
    """The production layouts that fit ``backend``'s memory, and the rest."""
    limit = memory_limit(backend)
    sharing = compilation.processes_per_device()
    shared = f" to each of the {sharing} processes sharing it" if sharing > 1 else ""
    fitting, skipped = [], []
    for layout in layouts:
        if layout.needs <= limit:
            fitting.append(layout)
        else:
            skipped.append(
                f"{layout.name}: its check needs ~{layout.needs / 2**30:.0f} GiB, the device allows "
                f"{limit / 2**30:.0f} GiB{shared}"
            )
    return Plan(tuple(fitting), tuple(skipped))


def production_cases(
    family: str, layouts: Sequence[Layout], family_cases: Callable[..., st.SearchStrategy[Case]], domain: Any
) -> ProductionCases:
    """A spec's ``production`` strategy: one of the family's fitting ``layouts`` per
    Hypothesis example (shared by its cases), set in the spec's ``domain``, values
    drawn by ``family_cases(dtype, backend, domain=...)``."""

    def production(dtype: str, backend: Backend, layout: str | None = None) -> st.SearchStrategy[Case]:
        """``layout``: only the layouts whose name contains it."""
        planned = plan(layouts, backend)
        fitting = [l for l in planned.fitting if layout is None or layout in l.name]
        if not fitting:
            raise ValueError(
                f"no production layout of {family}{f' named {layout!r}' if layout else ''} fits "
                f"{backend}'s memory; skipped: " + "; ".join(planned.skipped)
            )
        chosen = strategies.layout(f"{family}.production", st.sampled_from(fitting))
        return chosen.flatmap(
            lambda layout: family_cases(dtype, backend, domain=dataclasses.replace(domain, **layout.fields))
        )

    return production


def planned(specs: Mapping[str, KernelSpec], backend: Backend) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """The names of ``specs`` without the production families none of whose layouts fit
    ``backend``'s memory (this process's share of it); lines for the output: per family
    the layouts drawn and those skipped by the memory rule, then the families left out
    and what to do; and (family, why) for each layout or family not checked. A family
    left in would fail every task of a run, a crash booked against a kernel that is not
    at fault."""
    lines, unfit, skipped = [], [], []
    fewer = " (fewer --jobs give each process a larger share)" if compilation.processes_per_device() > 1 else ""
    for family in [n for n, s in specs.items() if s.production_layouts]:
        p = plan(specs[family].production_layouts, backend)
        lines.append(f"{family}: {len(p.fitting)} production layouts: " + ", ".join(l.name for l in p.fitting))
        lines += [f"  skipped by the memory rule: {line}" for line in p.skipped]
        skipped += [(family, f"layout {line}{fewer}") for line in p.skipped]
        if not p.fitting:
            unfit.append(family)
    if unfit:
        lines.append(f"not checked: {', '.join(unfit)}: no production layout fits{fewer}")
    return [n for n in specs if n not in unfit], lines, skipped
