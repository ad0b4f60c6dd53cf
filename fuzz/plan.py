"""Run planning: what runs where. One home for how many worker processes a command
starts (on this machine, or as slots of a Ray cluster), how they share a device's
memory, and which production kernels fit it.

verify, fuzz and mutate ask here; the memory rule itself (a production layout's
footprint against the device's allocator limit) is ``properties/production.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Literal, cast

from pallascheck.fuzz.scope import NotChecked
from pallascheck.kernels.backends import Backend
from pallascheck.properties import production, registry
from pallascheck.properties.device import multidevice
from pallascheck.properties.spec import Layout

Command = Literal["verify", "fuzz", "mutate"]


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def gpu_devices(backend: Backend) -> int:
    """How many GPUs the workers spread over (0 for a CPU backend)."""
    if backend.platform != "gpu":
        return 0
    import jax

    try:
        return len(jax.devices("gpu"))
    except RuntimeError:  # no GPU visible: the backend's own check says so
        return 0


def worker_gpus(backend: Backend) -> list[str]:
    """The GPUs a command's workers on this machine take in turn (worker i the i-th,
    modulo their number), as each worker's CUDA_VISIBLE_DEVICES names it; none on a
    CPU backend."""
    gpus = gpu_devices(backend)
    return multidevice.visible_gpus(gpus) if gpus else []


# CPU devices of the child that checks the distributed kernels in the TPU interpreter
DISTRIBUTED_CPU_DEVICES = 4


def distributed_devices(backend: Backend) -> tuple[str, int] | None:
    """Where a run on ``backend`` checks the distributed kernels (the ring
    collectives), as (platform, devices) of the child that runs them: a CPU backend,
    in the TPU interpreter on DISTRIBUTED_CPU_DEVICES CPU devices; ``mosaic_gpu``, the
    Mosaic GPU rings over every GPU of the host when it has two or more; None where
    this run cannot (another GPU backend, or a single GPU)."""
    if backend.platform == "cpu":
        return "cpu", DISTRIBUTED_CPU_DEVICES
    if backend.name != "mosaic_gpu":
        return None
    gpus = gpu_devices(backend)
    return ("gpu", gpus) if gpus >= 2 else None


def default_jobs(command: Command, backend: Backend, shapes: str = "small") -> int:
    """Worker processes when ``--jobs`` is not given.

    - verify and mutate: every core on the CPU; on a GPU three quarters of the cores,
      processes that share the device, each allocating memory as needed. Their work is
      compiling (a small-tier case is milliseconds on the GPU): on an H100 host of 16
      cores, with one BLAS thread per worker, `verify --examples 15` took 108.6 s at 8
      jobs and 88.8 s at 12, cold (docs/results.md).
    - fuzz: every core, on the CPU and at a GPU's small tier; one worker per GPU at the
      production tier (16 workers on one H100 checked 76 small cases/s, warm cache).
    - verify at the production tier on a GPU: one; verify sets them per layout by
      memory instead (``jobs_by_layout``), where it knows the layouts it checks.
      verify's and fuzz's workers take the host's GPUs in turn (``worker_gpus``), those
      of one GPU sharing it (``share_devices``), each allocator
      held to its share (``compilation.configure``): uncapped, two workers that each
      planned with half an H100 ran out of memory together in ragged_dot's layouts
      (docs/results.md, 2026-11-28); capped, four checked matmul's and fp8_matmul's
      layouts on an H200 in 125 s where one took 338 s.
    """
    if command == "verify" and shapes == "production" and backend.platform != "cpu":
        return 1
    if command == "fuzz":
        gpus = gpu_devices(backend)
        if gpus and shapes == "production":
            return gpus
        return max(cores(), gpus)
    return cores() if backend.platform == "cpu" else max(1, cores() * 3 // 4)


# Host bytes a production worker takes beside the results it holds there: Python, JAX
# and the CUDA libraries mapped, the compiler's memory, the cases' numpy inputs and
# their draws' float64 temporaries. Four workers at GLU's and ragged_dot's largest
# layouts, holding nothing there, took 50 GiB of an H200 host together (12.5 each;
# 2026-11-28, docs/results.md): 16 allows about a quarter more.
WORKER_HOST_BYTES = 16 * 2**30


def host_bytes(layout: Layout, share: int) -> int:
    """Host bytes a worker whose share of the device is ``share`` takes at ``layout``:
    where its results do not fit the share they are held on the host, and joined
    there (``chunks.joined``: the spans beside their whole, twice the results)."""
    held = layout.on_device is not None and layout.on_device > share
    return WORKER_HOST_BYTES + (2 * (cast(int, layout.on_device) - layout.needs) if held else 0)


def host_budget() -> int:
    """Host bytes the workers may take together: three quarters of the machine's."""
    return int(0.75 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def jobs_by_layout(backend: Backend, layouts: Sequence[Layout]) -> dict[str, int]:
    """Per layout name, the workers by memory that may check it at once on each GPU
    (``jobs_by_memory``; as many on every GPU of the host, ``worker_gpus``): verify at
    the production tier runs the units of one count together, each group in a pool of
    its own, so that the layouts that need the device whole (attention's 128k) do not
    hold every other one to one worker, nor a smaller share hold their results on the
    host."""
    gpus = max(1, len(worker_gpus(backend)))
    device, host = production.device_memory(backend), host_budget()
    most = max(1, cores() * 3 // 4 // gpus)
    return {l.name: jobs_by_memory(device, host, l, most, gpus) for l in layouts}


def jobs_line(backend: Backend, jobs_of_layout: Mapping[str, int], unit_jobs: Sequence[int]) -> str:
    """The line that says how many workers check which layouts (``jobs_by_layout``) and
    why: per count, its units, and the layouts of the counts below the largest."""
    gpus = max(1, len(worker_gpus(backend)))
    counts = sorted(set(unit_jobs), reverse=True)
    parts = []
    for count in counts:
        units = sum(1 for j in unit_jobs if j == count)
        named = "" if count == counts[0] else f" ({'; '.join(l for l, j in jobs_of_layout.items() if j == count)})"
        parts.append(f"{count} worker{'s' * (count != 1)} for {units} unit{'s' * (units != 1)}{named}")
    device, host = production.device_memory(backend), host_budget()
    each = f" on each of {gpus} GPUs" if gpus > 1 else ""
    return (
        f"jobs by memory{each}: {', then '.join(parts)}: the most whose shares of the device ({device / 2**30:.0f} "
        f"GiB) and of the host ({host / 2**30:.0f} GiB for the workers) each hold the layout, its results on the "
        "device where they fit the share"
    )


def jobs_by_memory(device_bytes: int, host_bytes_total: int, layout: Layout, most: int, gpus: int = 1) -> int:
    """The most workers a GPU, up to ``most`` and at least 1, whose equal shares of
    its ``device_bytes`` each hold ``layout`` (its ``needs``), and whose host bytes there
    (``host_bytes``: results a share too small holds on the host), all of them on all
    ``gpus`` at once, fit ``host_bytes_total``. Ten workers on one H200 were each given
    13 GiB: GLU's and ragged_dot's largest layouts held their results on the host and
    took 121 GiB of its 128 before the kernel's out-of-memory killer stopped one, and
    the run with it (docs/results.md)."""
    if most < 1 or gpus < 1:
        raise ValueError(f"most and gpus must be positive, got most={most}, gpus={gpus}")
    for jobs in range(most, 1, -1):
        share = device_bytes // jobs
        if layout.needs <= share and gpus * jobs * host_bytes(layout, share) <= host_bytes_total:
            return jobs
    return 1


def cluster_slots(backend: Backend, total: Mapping[str, float]) -> tuple[int, dict[str, float]]:
    """Worker slots of a campaign on a Ray cluster holding ``total`` resources
    (``ray.cluster_resources()``), and the Ray actor options each asks for: one per GPU
    on a GPU backend (Ray shows each only its GPU, so none shares one), one per CPU core
    on the CPU backends (each worker is one interpreter process on one core, as
    ``default_jobs`` plans on one machine). Ray places each on any node with the
    resource free."""
    if backend.platform == "gpu":
        gpus = int(total.get("GPU", 0))
        if gpus < 1:
            raise ValueError(f"--cluster: the cluster has no GPU for {backend} (start its nodes with their GPUs)")
        return gpus, {"num_gpus": 1, "num_cpus": 1}
    cpus = int(total.get("CPU", 0))
    if cpus < 1:
        raise ValueError("--cluster: the cluster has no CPU to run workers on (ray start --num-cpus N)")
    return cpus, {"num_cpus": 1}


def default_memory_bytes(jobs: int) -> int:
    """Resident memory per worker before it counts as out of memory: three quarters
    of the machine's, shared among the workers."""
    return host_budget() // jobs


def share_devices(backend: Backend, jobs: int, on_cluster: bool = False) -> None:
    """Tell ``jobs`` workers how many of them share each device, so that each plans its
    production layouts with its share of the memory: on this machine they take the
    GPUs in turn (``worker_gpus``), on a Ray cluster one each (``cluster_slots``)."""
    production.share_devices(1 if on_cluster else -(-jobs // max(gpu_devices(backend), 1)))


def fitting(names: Sequence[str], backend: Backend) -> tuple[list[str], list[str], list[NotChecked]]:
    """``names`` whose production layouts fit the memory each process may use, the
    lines saying per family what was drawn and what was skipped by the memory rule, and
    each layout so skipped as not checked."""
    kept, lines, skipped = production.planned(registry.selected(list(names)), backend)
    return kept, lines, [NotChecked(family, "-", why) for family, why in skipped]
