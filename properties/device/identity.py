"""Which kind of device a process checks on (``device_kind``: what a campaign's results
are split by), and which physical GPU a check ran on, for the reports of failures that no rounding
explains.

A failure whose output changes between runs on the same inputs (runner.py reruns
every failing hardware check) may be the kernel's race or the device's fault. The two
part ways across runs: a race may fail on any GPU, a faulty device only on itself. On
an H100, one production soak failed twice (an attention output NaN in a quarter of its
elements on the first run and right on the two reruns; a GLU output 202 times its
bound), and the same campaign, replayed with the same draws on two fresh machines (two
GPUs), passed every case (docs/results.md). So the report names the GPU: its model,
UUID and PCI bus, as nvidia-smi prints them, read from the CUDA driver by the device's
ordinal (JAX's ``local_hardware_id``, under the process's CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import jax

from pallascheck.kernels.backends import Backend


def device_kind(backend: Backend) -> str:
    """The kind of the device ``backend``'s kernels run on here: JAX's ``device_kind``
    of the platform's first device ("NVIDIA H100 80GB HBM3"; "cpu" on the interpreters)."""
    return jax.devices(backend.platform)[0].device_kind or backend.platform


def describe(device: Any) -> str | None:
    """``device``'s model, UUID and PCI bus (``NVIDIA H100 80GB HBM3 GPU-5ca491d2-... at
    PCI 0000:00:06.0``), or None where it is not a CUDA GPU or the driver cannot say."""
    ordinal = getattr(device, "local_hardware_id", None)
    if device.platform != "gpu" or ordinal is None:
        return None
    found = _cuda_identity(ordinal)
    return None if found is None else f"{device.device_kind} {found[0]} at PCI {found[1]}"


@functools.cache
def _cuda_identity(ordinal: int) -> tuple[str, str] | None:
    """(UUID, PCI bus id) of CUDA device ``ordinal`` from libcuda; None on any failure
    (no CUDA driver here, a ROCm GPU)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device = ctypes.c_int()
    uuid = (ctypes.c_ubyte * 16)()
    bus = ctypes.create_string_buffer(32)
    get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
    calls = (
        lambda: cuda.cuInit(0),
        lambda: cuda.cuDeviceGet(ctypes.byref(device), ordinal),
        lambda: get_uuid(uuid, device),
        lambda: cuda.cuDeviceGetPCIBusId(bus, len(bus), device),
    )
    if any(call() != 0 for call in calls):  # CUDA_SUCCESS is 0; they run in order and stop at a failure
        return None
    h = bytes(uuid).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}", bus.value.decode()
