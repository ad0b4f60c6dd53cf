"""The one place that knows how Pallas/JAX APIs differ between jax 0.10.2 and 0.12.

Everything else imports these names instead of probing versions itself.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

try:  # jax >= 0.7: Triton compiler params live in pallas.triton
    from jax.experimental.pallas import triton as _pltriton

    _TritonParams = _pltriton.CompilerParams
except (ImportError, AttributeError):  # older layout
    from jax.experimental.pallas import gpu as _plgpu

    _TritonParams = _plgpu.TritonCompilerParams

_TpuParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
_TpuInterpretParams = getattr(pltpu, "InterpretParams", None) or getattr(pltpu, "TPUInterpretParams")

# DeviceIdType moved from pltpu to pl; the pltpu alias is deprecated.
DeviceIdType = getattr(pl, "DeviceIdType", None) or getattr(pltpu, "DeviceIdType")

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # pragma: no cover - only on jax without jax.shard_map
    from jax.experimental.shard_map import shard_map  # type: ignore[no-redef]


def triton_compiler_params(num_warps: int | None, num_stages: int | None) -> Any:
    return _TritonParams(num_warps=num_warps, num_stages=num_stages)


def tpu_compiler_params(dimension_semantics: Sequence[str] | None) -> Any:
    return _TpuParams(dimension_semantics=tuple(dimension_semantics) if dimension_semantics else None)


def tpu_interpret_params(*, seed: int | None, detect_races: bool = True, dma_execution_mode: str = "on_wait") -> Any:
    """TPU interpreter with race detection, NaN-filled uninitialised memory and a
    seeded shuffle of the grid points along "parallel" dimensions. DMAs run when
    their semaphore is waited on ("on_wait") or as soon as they start ("eager")."""
    return _TpuInterpretParams(
        detect_races=detect_races, uninitialized_memory="nan", random_seed=seed, dma_execution_mode=dma_execution_mode
    )


def reset_tpu_interpreter() -> None:
    """Clear the TPU interpreter's global state (semaphores, buffers, race records),
    which otherwise survives a failing kernel and poisons the next one."""
    reset = getattr(pltpu, "reset_tpu_interpret_mode_state", None)
    if reset is not None:
        reset()


@contextlib.contextmanager
def float64_enabled() -> Iterator[None]:
    """Enable float64 in JAX inside the block only (oracle gradients)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # pragma: no cover
        from jax.experimental import enable_x64 as enable
    with enable(True):
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
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as _interp
    except ImportError:  # releases where the interpreter is one module
        from jax._src.pallas.mosaic import interpret as _interp
    races = getattr(_interp, "races", None)
    return bool(races is not None and races.races_found)


# A block dimension of size 1 that the kernel sees squeezed away: pl.Squeezed() on
# newer jax, None (the older spelling, deprecated there) before it.
SQUEEZED = pl.Squeezed() if hasattr(pl, "Squeezed") else None
