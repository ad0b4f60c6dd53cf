"""The Mosaic GPU ring collectives (kernels/mosaic_gpu_collectives.py) on 2 and 4 GPUs
of one host: ``pytest tests/test_gpu_collectives.py --backend mosaic_gpu`` on a
machine with two or more Hopper GPUs (skipped elsewhere; on the CPU,
tests/test_collectives.py checks the same algorithms in the TPU interpreter and
tests/test_gpu_collectives_source.py lowers these kernels).

Each device count runs in a child process over the first N GPUs
(properties/device/multidevice.run_with_devices), with NVLink multicast off and a
wall-clock limit, so a deadlocked ring is a reported hang, never a stuck run."""

from __future__ import annotations

import os

import pytest

from pallascheck.fuzz import plan
from pallascheck.kernels.backends import Backend
from pallascheck.properties.device import multidevice

CHECKS = "pallascheck.properties.families.collectives"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
VARIANTS = "broken.gpu_collectives_variants:VARIANTS"
EXAMPLES = 6


def _gpus(backend: Backend) -> int:
    if backend.name != "mosaic_gpu":
        pytest.skip(f"the Mosaic GPU collectives: not on {backend}")
    where = plan.distributed_devices(backend)
    if where is None:
        pytest.skip("needs 2 or more GPUs on one host")
    return where[1]


@pytest.mark.parametrize("devices", [2, 4])
def test_ring_collectives_on_gpus(backend: Backend, devices: int) -> None:
    """Every device's shard within the derived bound (the gather bit-exact), a bitwise
    rerun, xla_reference (NCCL) within the same model, and the GPU rules' errors."""
    if _gpus(backend) < devices:
        pytest.skip(f"needs {devices} GPUs")
    result = multidevice.run_with_devices(
        f"{CHECKS}:run_checks",
        devices,
        {"examples": EXAMPLES, "seed": devices, "backend": "mosaic_gpu"},
        platform="gpu",
        timeout_s=480,
    )
    assert result.pop("errors") == {}
    for kernel, tally in result.items():
        assert not tally["failures"], f"{kernel} on {devices} GPUs:\n" + "\n".join(tally["failures"])
        assert sum(tally["examples"].values()) == EXAMPLES, (kernel, tally)
        assert all(b <= 1.0 for b in tally["budget"].values()), (kernel, tally["budget"])
        if kernel == "all_gather":
            assert set(tally["budget"].values()) == {0.0}  # bit-exact


@pytest.mark.parametrize("devices", [2, 4])
def test_broken_rings_are_caught_on_gpus(backend: Backend, devices: int) -> None:
    """Each broken ring fails a check, or, where its broken protocol leaves a wait
    unsatisfied, comes back as a hang naming its example; on 2 GPUs the variants a
    two-device ring cannot show are left out."""
    if _gpus(backend) < devices:
        pytest.skip(f"needs {devices} GPUs")
    from broken import gpu_collectives_variants as variants

    names = [n for n in variants.VARIANTS if devices > 2 or n not in variants.NEEDS_THREE]
    for name in names:
        try:
            result = multidevice.run_with_devices(
                f"{CHECKS}:run_variants",
                devices,
                {"variants": VARIANTS, "names": [name], "examples": EXAMPLES, "backend": "mosaic_gpu"},
                platform="gpu",
                timeout_s=60 if name in variants.DEADLOCKS else 240,
                import_path=TESTS_DIR,
            )
        except multidevice.ChildTimeout as err:
            assert name in variants.DEADLOCKS or name in variants.MAY_HANG, f"{name} hung: {err}"
            assert f"running variant {name}" in str(err) and "example:" in str(err)
            continue
        assert name not in variants.DEADLOCKS, f"{name} finished: {result}"
        assert result[name]["caught"], f"{name} survived {EXAMPLES} examples on {devices} GPUs"


@pytest.mark.parametrize("devices", [2, 4])
def test_jax_collective_matmul_as_a_client(backend: Backend, devices: int) -> None:
    """JAX's all_gather_lhs_matmul across its tuning space, under our oracle and bound."""
    if _gpus(backend) < devices:
        pytest.skip(f"needs {devices} GPUs")
    result = multidevice.run_with_devices(
        f"{CHECKS}:run_bundled", devices, {"examples": EXAMPLES, "seed": devices}, platform="gpu", timeout_s=480
    )
    assert not result["failures"], "\n".join(result["failures"])
    assert sum(result["examples"].values()) == EXAMPLES
