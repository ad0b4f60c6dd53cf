"""The one place that knows how Pallas/JAX APIs differ between jax 0.11.2 and 0.12.

Everything else imports these names instead of probing versions itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import jax
import numpy as np
from jax._src import config as jax_config
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_TritonParams: Any  # the class of one of two layouts
try:  # jax >= 0.7: Triton compiler params live in pallas.triton
    from jax.experimental.pallas import triton as _pltriton

    _TritonParams = _pltriton.CompilerParams
except (ImportError, AttributeError):  # older layout
    from jax.experimental.pallas import gpu as _plgpu  # type: ignore[attr-defined]  # absent from jax >= 0.7

    _TritonParams = _plgpu.TritonCompilerParams

_TpuParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
_TpuInterpretParams = getattr(pltpu, "InterpretParams", None) or getattr(pltpu, "TPUInterpretParams")


# Out-of-bounds reads raise in the TPU and Mosaic GPU interpreters (the default of
# SharedInterpretParams in jax 0.11.2 and 0.12; said here so that a new default does
# not turn them into reads of uninitialised memory unnoticed). The TMA copies of the
# Mosaic GPU interpreter fill out-of-bounds source elements with zeros, as the
# hardware's TMA does: not an error there. Pallas' generic interpreter
# (interpret=True) pads blocks with uninitialised values and has no such check.
OUT_OF_BOUNDS_READS_RAISE: dict[str, Any] = {"out_of_bounds_reads": "raise"}


@contextlib.contextmanager
def poisoned_scratch(enabled: bool = True) -> Iterator[None]:
    """Within the block, kernels compiled for Mosaic TPU fill their scratch buffers
    (run_scoped, scratch_shapes) with NaN at allocation (``jax_pallas_poison_buffers``,
    jax 0.11.2 and 0.12), so a read before a write shows on the hardware too. JAX's
    Mosaic GPU lowering refuses the flag ("Buffer poisoning is not supported on GPU
    yet", NotImplementedError, both versions) and its Triton lowering ignores it: no
    poisoning on GPUs. The flag is not part of jit's cache key: a kernel compiled
    before the block keeps its unpoisoned scratch."""
    state = getattr(jax_config, "jax_pallas_poison_buffers", None)
    if not enabled or state is None:
        yield
        return
    with state(True):
        yield


shard_map: Any = getattr(jax, "shard_map", None)
if shard_map is None:  # pragma: no cover - only on jax without jax.shard_map
    from jax.experimental.shard_map import shard_map


def triton_compiler_params(num_warps: int | None, num_stages: int | None) -> Any:
    return _TritonParams(num_warps=num_warps, num_stages=num_stages)


def tpu_compiler_params(dimension_semantics: Sequence[str] | None) -> Any:
    return _TpuParams(dimension_semantics=tuple(dimension_semantics) if dimension_semantics else None)


def tpu_interpret_params(*, seed: int | None, detect_races: bool = True, dma_execution_mode: str = "on_wait") -> Any:
    """TPU interpreter with race detection, NaN-filled uninitialised memory, an
    exception on any out-of-bounds read and a seeded shuffle of the grid points along
    "parallel" dimensions. DMAs run when their semaphore is waited on ("on_wait") or as
    soon as they start ("eager")."""
    return _TpuInterpretParams(
        detect_races=detect_races,
        uninitialized_memory="nan",
        random_seed=seed,
        dma_execution_mode=dma_execution_mode,
        **OUT_OF_BOUNDS_READS_RAISE,
    )


def reset_tpu_interpreter() -> None:
    """Clear the TPU interpreter's global state (semaphores, buffers, race records),
    which otherwise survives a failing kernel and poisons the next one."""
    reset = getattr(pltpu, "reset_tpu_interpret_mode_state", None)
    if reset is not None:
        reset()


@contextlib.contextmanager
def float64_enabled(enabled: bool = True) -> Iterator[None]:
    """Enable float64 in JAX inside the block only (oracles); ``enabled=False``
    disables it again inside such a block (kernels run from an oracle scope)."""
    enable: Any = getattr(jax, "enable_x64", None)
    if enable is None:  # pragma: no cover
        from jax.experimental import enable_x64 as enable  # type: ignore[attr-defined, no-redef]  # jax before jax.enable_x64
    with enable(enabled):
        yield


def shard_map_unchecked(f: Any, *, mesh: Any, in_specs: Any, out_specs: Any) -> Any:
    """``shard_map`` without replication/varying-axes type checks (``check_vma=False``;
    ``check_rep=False`` on the experimental one): a ``pallas_call``'s outputs carry no
    varying-axes type, which the checked mode requires."""
    try:
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    except TypeError:  # pragma: no cover - jax.experimental.shard_map spells it check_rep
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def tpu_compiler_params_collective(collective_id: int) -> Any:
    """Mosaic params for a kernel that talks to other devices: ``collective_id``
    picks its barrier semaphore; side effects keep XLA from dropping or merging it."""
    return _TpuParams(collective_id=collective_id, has_side_effects=True)


def tpu_interpret_races_found() -> bool:
    """Whether the TPU interpreter's race detector flagged a data race in the kernels
    interpreted since its state was last created (with ``detect_races=True``).

    jax 0.10.2 through 0.12 keep the detector in the module-level ``races``
    (a RaceDetectionState with ``races_found``) of
    ``jax._src.pallas.mosaic.interpret.interpret_pallas_call``; it is replaced when a
    kernel starts after the previous one's memory was released, and cleared by
    :func:`reset_tpu_interpreter`. Read it after ``block_until_ready``.
    """
    _interp: ModuleType  # the module of one of two layouts
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _interp
    except ImportError:  # releases where the interpreter is one module
        from jax._src.pallas.mosaic import interpret as _interp
    races = getattr(_interp, "races", None)
    return bool(races is not None and races.races_found)


# A block dimension of size 1 that the kernel sees squeezed away: pl.Squeezed() on
# newer jax, None (the older spelling, deprecated there) before it.
SQUEEZED = pl.Squeezed() if hasattr(pl, "Squeezed") else None


def mosaic_gpu_interpret_params() -> Any:
    """The Mosaic GPU interpreter with its race detector on (vector clocks over shared
    memory, TMA copies and barriers: a barrier waited on too late is a race even where
    the interpreter's eager copies leave the values right) and NaN-filled
    uninitialised memory. jax >= 0.12 raises on the first race; 0.11.2 can only print
    it, so there a race alone fails no check."""
    require_backend_available("mosaic_gpu_interpret")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    raise_on_race: dict[str, Any] = (
        {"on_race": "raise"} if "on_race" in plgpu.InterpretGPUParams.__dataclass_fields__ else {}
    )
    return plgpu.InterpretGPUParams(
        detect_races=True, uninitialized_memory="nan", **OUT_OF_BOUNDS_READS_RAISE, **raise_on_race
    )


# Hopper (sm_90) is the oldest GPU the Mosaic GPU kernels' wgmma and TMA exist on.
MOSAIC_GPU_MIN_COMPUTE_CAPABILITY = (9, 0)


def _gpu_devices() -> list[Any]:
    try:
        return list(jax.devices("gpu"))
    except RuntimeError:  # no GPU platform in this jaxlib / on this machine
        return []


def _compute_capability(device: Any) -> tuple[int, int]:
    major, _, minor = str(getattr(device, "compute_capability", "0.0")).partition(".")
    return int(major), int(minor or 0)


@functools.cache
def require_backend_available(name: str) -> None:
    """Raise ``RuntimeError`` at once, saying what is needed, where backend ``name``
    cannot run on this machine and jax; cached, so kernels may call it per call."""
    if name == "mosaic_gpu_interpret":
        try:
            from jax.experimental.pallas import mosaic_gpu as plgpu
        except ImportError as err:  # pragma: no cover - jaxlib without Mosaic GPU
            raise RuntimeError(
                f"backend mosaic_gpu_interpret needs jax.experimental.pallas.mosaic_gpu: {err}"
            ) from None
        if not hasattr(plgpu, "InterpretGPUParams"):
            raise RuntimeError(
                f"backend mosaic_gpu_interpret needs the Mosaic GPU interpreter (plgpu.InterpretGPUParams, "
                f"jax >= 0.11 on Python >= 3.11); this is jax {jax.__version__}"
            )
    elif name in ("triton", "mosaic_gpu"):
        gpus = _gpu_devices()
        if not gpus:
            raise RuntimeError(
                f"backend {name} needs an NVIDIA GPU visible to jax (jax[cuda] and a CUDA driver); "
                f"jax sees only {[d.platform for d in jax.devices()]}. On a CPU use "
                + ("mosaic_gpu_interpret" if name == "mosaic_gpu" else "interpret")
            )
        if name == "mosaic_gpu":
            capability = _compute_capability(gpus[0])
            if capability < MOSAIC_GPU_MIN_COMPUTE_CAPABILITY:
                raise RuntimeError(
                    f"backend mosaic_gpu needs a Hopper GPU (compute capability >= 9.0, wgmma and TMA); "
                    f"{gpus[0].device_kind} has {capability[0]}.{capability[1]}. Use triton there"
                )
    elif name == "tpu":
        try:
            jax.devices("tpu")
        except RuntimeError:
            raise RuntimeError("backend tpu needs a TPU visible to jax; on a CPU use tpu_interpret") from None


@contextlib.contextmanager
def abstract_gpu(device_kind: str = "NVIDIA H100 80GB HBM3") -> Iterator[None]:
    """Lower GPU kernels on a machine without a GPU: Pallas' Triton lowering asks the
    device for its compute capability (jax >= 0.11), and an abstract mesh over an
    abstract device of ``device_kind`` answers for it."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("_",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def jax_test_tolerance(dtype: Any) -> float:
    """JAX's default test tolerance for ``dtype`` (``JaxTestCase.assertAllClose`` uses it
    as both atol and rtol): the table lives in a private module of JAX's."""
    from jax._src import public_test_util

    return float(public_test_util.default_tolerance()[np.dtype(dtype)])


def transposed_smem(ref: Any) -> Any:
    """An SMEM ref read transposed (a wgmma operand stored K-major): jax 0.12 deprecates
    ``plgpu.transpose_ref`` for the ref's own ``transpose``; jax 0.11.2 has the former."""
    if jax.__version_info__ >= (0, 12):
        return ref.transpose((1, 0))
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.transpose_ref(ref, (1, 0))
