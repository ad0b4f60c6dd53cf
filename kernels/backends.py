"""Where a Pallas kernel runs: a small value object chosen per call, by the
environment variable PALLASCHECK_BACKEND, or by the pytest option --backend.

- ``interpret``: Pallas' generic interpreter on the CPU (the default).
- ``tpu_interpret``: the TPU interpreter: race detection, NaN-poisoned
  uninitialised memory, and a seeded shuffle of "parallel" grid dimensions.
  Write ``tpu_interpret:SEED`` to pick the shuffle seed.
- ``gpu``: Triton lowering on an NVIDIA GPU.
- ``tpu``: Mosaic lowering on a TPU (the path exists; it is not exercised here).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Sequence

from jax.experimental import pallas as pl

from . import compat

ENV_VAR = "PALLASCHECK_BACKEND"
NAMES = ("interpret", "tpu_interpret", "gpu", "tpu")
DEFAULT = "interpret"


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    seed: int = 0  # grid-shuffle seed; only tpu_interpret uses it

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"backend must be one of {NAMES}, got {self.name!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"backend seed must be a non-negative int, got {self.seed!r}")

    def __str__(self) -> str:
        return f"tpu_interpret:{self.seed}" if self.name == "tpu_interpret" else self.name

    @property
    def is_interpreted(self) -> bool:
        return self.name in ("interpret", "tpu_interpret")

    @property
    def platform(self) -> str:
        """The JAX platform the kernel's arrays live on."""
        return {"gpu": "gpu", "tpu": "tpu"}.get(self.name, "cpu")

    def interpret_arg(self) -> Any:
        if self.name == "interpret":
            return True
        if self.name == "tpu_interpret":
            return compat.tpu_interpret_params(seed=self.seed)
        return False

    def compiler_params(
        self,
        *,
        num_warps: int | None = None,
        num_stages: int | None = None,
        dimension_semantics: Sequence[str] | None = None,
    ) -> Any:
        if self.name == "gpu":
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
        """``pl.pallas_call`` with this backend's interpret flag and compiler params."""
        return pl.pallas_call(
            kernel,
            interpret=self.interpret_arg(),
            compiler_params=self.compiler_params(
                num_warps=num_warps, num_stages=num_stages, dimension_semantics=dimension_semantics
            ),
            **kwargs,
        )


def parse(text: str) -> Backend:
    name, _, seed = text.strip().partition(":")
    if seed and name != "tpu_interpret":
        raise ValueError(f"only tpu_interpret takes a seed (name:SEED), got {text!r}")
    try:
        return Backend(name, int(seed) if seed else 0)
    except ValueError as err:
        raise ValueError(f"bad backend {text!r}: {err}") from None


def get_backend(backend: "str | Backend | None" = None) -> Backend:
    """Resolve a backend: an explicit value wins, then $PALLASCHECK_BACKEND, then interpret."""
    if isinstance(backend, Backend):
        return backend
    if backend is None:
        backend = os.environ.get(ENV_VAR, DEFAULT)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, Backend or None, got {type(backend).__name__}")
    return parse(backend)
