"""Where a Pallas kernel runs: a small value object chosen per call, by the
environment variable PALLASCHECK_BACKEND, or by the pytest option --pallascheck-backend.

- ``interpret``: Pallas' generic interpreter on the CPU (the default).
- ``tpu_interpret``: the TPU interpreter: race detection, NaN-poisoned
  uninitialised memory, and a seeded shuffle of "parallel" grid dimensions.
  Write ``tpu_interpret:SEED`` to pick the shuffle seed.
- ``triton``: Pallas' Triton lowering on an NVIDIA GPU (deprecated by JAX since
  0.11; kept while JAX ships it).
- ``mosaic_gpu``: Pallas' Mosaic GPU lowering on a Hopper GPU (TMA, wgmma, barriers).
- ``mosaic_gpu_interpret``: the Mosaic GPU interpreter on the CPU: the same kernels
  as ``mosaic_gpu``, run without a GPU.
- ``tpu``: Mosaic lowering on a TPU (the path exists; it is not exercised here).

``gpu`` is accepted as another name for ``mosaic_gpu``: it is the lowering JAX now
maintains for NVIDIA GPUs. A kernel that has no version for a backend raises
``NotOnBackend`` (a ``NotImplementedError``) naming the backends it has; nothing falls
back to another lowering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.experimental import pallas as pl

from pallascheck.kernels import compat, pinning
from pallascheck.kernels.block_bounds import check_block_indices

ENV_VAR = "PALLASCHECK_BACKEND"


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a backend is, read by everyone who asks (the runner, the tolerance model's
    arithmetic, the planner, the pytest plugin): never re-derived from its name."""

    platform: str  # the JAX platform the kernel's arrays live on (and the oracles run on)
    interpreted: bool  # Pallas interprets the kernel on the CPU: IEEE CPU arithmetic, no hardware
    lowering: str  # whose kernels run: "generic" (Pallas' Triton-style ones) or "mosaic_gpu"
    # the interpreter calls back into Python on every ref operation: a case costs about
    # what its compile does, so fewer cases share one compiled layout (runner.layout_cases)
    callback_interpreter: bool = False
    shuffles_grid: bool = False  # "parallel" grid dimensions run in a seeded random order


FACTS: dict[str, Facts] = {
    "interpret": Facts("cpu", True, "generic"),
    "tpu_interpret": Facts("cpu", True, "generic", callback_interpreter=True, shuffles_grid=True),
    "triton": Facts("gpu", False, "generic"),
    "mosaic_gpu": Facts("gpu", False, "mosaic_gpu"),
    "mosaic_gpu_interpret": Facts("cpu", True, "mosaic_gpu", callback_interpreter=True),
    "tpu": Facts("tpu", False, "generic"),
}
NAMES = tuple(FACTS)
ALIASES = {"gpu": "mosaic_gpu"}
DEFAULT = "interpret"
# Backends whose kernels are the Pallas-generic (Triton-style) ones, and the Mosaic GPU ones.
GENERIC = tuple(name for name, facts in FACTS.items() if facts.lowering == "generic")
MOSAIC_GPU = tuple(name for name, facts in FACTS.items() if facts.lowering == "mosaic_gpu")
CALLBACK_INTERPRETERS = tuple(name for name, facts in FACTS.items() if facts.callback_interpreter)


class NotOnBackend(NotImplementedError):
    """The kernel has no implementation for the requested backend."""


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    seed: int = 0  # grid-shuffle seed; only tpu_interpret uses it

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"backend must be one of {NAMES} (or 'gpu' = 'mosaic_gpu'), got {self.name!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"backend seed must be a non-negative int, got {self.seed!r}")

    def __str__(self) -> str:
        return f"tpu_interpret:{self.seed}" if self.name == "tpu_interpret" else self.name

    @property
    def facts(self) -> Facts:
        return FACTS[self.name]

    @property
    def is_interpreted(self) -> bool:
        return self.facts.interpreted

    @property
    def is_triton(self) -> bool:
        return self.name == "triton"

    @property
    def is_mosaic_gpu(self) -> bool:
        """Mosaic GPU kernels: on the hardware or in the Mosaic GPU interpreter."""
        return self.facts.lowering == "mosaic_gpu"

    @property
    def platform(self) -> str:
        """The JAX platform the kernel's arrays live on."""
        return self.facts.platform

    def placement(self) -> contextlib.AbstractContextManager[Any]:
        """Where and how a check runs its kernels. Its arrays: the interpreters run on the
        CPU device even on a GPU host. There the GPU would run an interpreted kernel's f32
        dots in TF32 and its exp in the GPU's math library, not the IEEE CPU arithmetic the
        interpreted backends' bounds model (an H200 run put our f32 matmul 211x over its
        bound). On a TPU, scratch buffers NaN-poisoned at allocation
        (``compat.poisoned_scratch``), as the interpreters fill uninitialised memory: JAX
        has no such flag for its GPU lowerings."""
        stack = contextlib.ExitStack()
        if self.platform == "cpu" and jax.default_backend() != "cpu":
            stack.enter_context(jax.default_device(jax.devices("cpu")[0]))
        stack.enter_context(compat.poisoned_scratch(self.name == "tpu"))
        return stack

    def require_available(self) -> None:
        """Fail at once, saying what is missing, where this backend cannot run."""
        compat.require_backend_available(self.name)

    def interpret_arg(self) -> Any:
        if self.name == "interpret":
            return True
        if self.name == "tpu_interpret":
            return compat.tpu_interpret_params(seed=self.seed)
        if self.name == "mosaic_gpu_interpret":
            return compat.mosaic_gpu_interpret_params()
        return False

    def compiler_params(
        self,
        *,
        num_warps: int | None = None,
        num_stages: int | None = None,
        dimension_semantics: Sequence[str] | None = None,
    ) -> Any:
        if self.name == "triton":
            return compat.triton_compiler_params(num_warps, num_stages)
        if self.name in ("tpu", "tpu_interpret"):
            return compat.tpu_compiler_params(dimension_semantics)
        return None

    def pallas_call(
        self,
        kernel: Callable[..., None],
        *,
        num_warps: int | None = None,
        num_stages: int | None = None,
        dimension_semantics: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> Callable[..., Any]:
        """``pl.pallas_call`` with this backend's interpret flag and compiler params,
        for the Pallas-generic kernels."""
        if self.is_mosaic_gpu:
            raise NotOnBackend(
                f"{kwargs.get('name', 'this kernel')} has no Mosaic GPU version; run it on "
                f"one of {GENERIC} (see docs/backends.md)"
            )
        call = pl.pallas_call(
            kernel,
            interpret=self.interpret_arg(),
            compiler_params=self.compiler_params(
                num_warps=num_warps, num_stages=num_stages, dimension_semantics=dimension_semantics
            ),
            **kwargs,
        )
        if not self.is_interpreted:
            return call

        def checked(*operands: Any) -> Any:
            # the interpreters clamp an out-of-range block index: check what hardware would not forgive
            check_block_indices(
                kwargs.get("name", getattr(kernel, "__name__", "kernel")),
                kwargs.get("grid", ()),
                kwargs.get("in_specs"),
                kwargs.get("out_specs"),
                operands,
                kwargs["out_shape"],
            )
            return call(*operands)

        return checked


def _qualified(kind: type) -> str:
    return f"{kind.__module__.rsplit('.', 1)[-1]}.{kind.__name__}"


def resolve_config(
    config: Any,
    backend: Backend,
    generic: type,
    mosaic_gpu: type,
    *,
    kernel: str,
    arrays: Mapping[str, Any],
    options: Mapping[str, Any],
) -> Any:
    """The config a kernel runs with on ``backend``: when None, the one pinned for this
    call (``pinning.choose``: kernel name, ``arrays``' shapes and dtypes, ``options``)
    or the backend's default; else it must be the backend's type (``mosaic_gpu`` on the
    Mosaic GPU backends, ``generic`` on the others), or ``TypeError`` names both."""
    expected = mosaic_gpu if backend.is_mosaic_gpu else generic
    config = pinning.choose(
        kernel, config, expected() if config is None else None, arrays=arrays, options=options, backend=backend.name
    )
    if not isinstance(config, expected):
        raise TypeError(
            f"config must be of type {_qualified(expected)} on backend {backend} ({_qualified(mosaic_gpu)} on "
            f"the Mosaic GPU backends, {_qualified(generic)} on the others), got {type(config).__name__}"
        )
    return config


def parse(text: str) -> Backend:
    name, _, seed = text.strip().partition(":")
    name = ALIASES.get(name, name)
    if seed and name != "tpu_interpret":
        raise ValueError(f"only tpu_interpret takes a seed (name:SEED), got {text!r}")
    try:
        return Backend(name, int(seed) if seed else 0)
    except ValueError as err:
        raise ValueError(f"bad backend {text!r}: {err}") from None


def get_backend(backend: str | Backend | None = None) -> Backend:
    """Resolve a backend: an explicit value wins, then $PALLASCHECK_BACKEND, then interpret."""
    if isinstance(backend, Backend):
        return backend
    if backend is None:
        backend = os.environ.get(ENV_VAR, DEFAULT)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, Backend or None, got {type(backend).__name__}")
    return parse(backend)
