"""What the spec builders (``attention_like``, ``norm_like``, ``matmul_like``,
``grouped_matmul_like``) share: running a function that is not ours on the session's
backend, and the bad inputs every kernel of a family must refuse.

A builder adapts the user's function to the signature of our kernel of the same
family and hands it to that family's ``make_spec``: the float64 oracle, the bound,
the adversarial strategies, the gradients, the relations are ours, unchanged. What the
user states (layout, scale convention, which options exist, the blocks along the
reductions) selects the part of our input space the function accepts and the
tiling the bound models. An unknown block is the whole reduction, the loosest
blocked bound and the contract: sound for every tiling.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from pallascheck.kernels import compat, matmul
from pallascheck.kernels.backends import Backend, NotOnBackend
from pallascheck.properties.spec import BadInput, Case, KernelSpec, Parameter


@contextlib.contextmanager
def interpreting(backend: Backend, interpret: str | None) -> Iterator[None]:
    """JAX's force-interpret context for ``backend`` where the function takes no
    ``interpret`` keyword (the Mosaic GPU interpreter: always)."""
    if backend.name == "mosaic_gpu_interpret":
        from jax.experimental.pallas import mosaic_gpu as plgpu

        with plgpu.force_gpu_interpret_mode(compat.mosaic_gpu_interpret_params()):
            yield
    elif backend.name == "tpu_interpret" and interpret is None:
        from jax.experimental.pallas import tpu as pltpu

        with pltpu.force_tpu_interpret_mode(compat.tpu_interpret_params(seed=backend.seed)):
            yield
    else:
        yield


def call_on(
    fn: Callable[..., Any],
    backend: Backend,
    backends: Sequence[str],
    interpret: str | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``fn(*args, **kwargs)`` with its Pallas calls on ``backend``: the backend's
    interpret argument passed as keyword ``interpret`` (True, the TPU or Mosaic GPU
    interpreter's params, False on hardware), or inside JAX's force-interpret context
    (``interpreting``). JAX has no context that forces the generic interpreter: there
    the keyword is needed."""
    if backend.name not in backends:
        raise NotOnBackend(f"this function runs on {tuple(backends)}, not on {backend}")
    if interpret is not None:  # False on hardware
        kwargs[interpret] = backend.interpret_arg()
    elif backend.name == "interpret":
        raise ValueError(
            "interpret: name the keyword of your function that turns on Pallas' interpreter "
            "(interpret='interpret' for pl.pallas_call(..., interpret=interpret))"
        )
    with interpreting(backend, interpret):
        return fn(*args, **kwargs)


def backward_on_backend(spec: KernelSpec, interpret: str | None) -> KernelSpec:
    """``spec`` with its kernel VJP inside ``interpreting``: a custom VJP's backward
    kernels are traced when the pullback is called, after ``call_on`` has returned."""
    if spec.gradients is None:
        return spec
    vjp = spec.gradients.kernel_vjp

    def kernel_vjp(case: Case, config: Any, backend: Backend) -> Any:
        with interpreting(backend, interpret):
            try:
                return vjp(case, config, backend)
            except (ValueError, NotImplementedError) as err:
                if not _no_reverse_mode(err):
                    raise
                raise TypeError(
                    f"{spec.name}: this kernel has no VJP: pass differentiable=False to its spec builder "
                    f"(a forward-only kernel): the spec was built with differentiable=True, the family builders' "
                    f"default, which checks its gradients (from_reference's default is False). "
                    f"JAX said: {str(err).splitlines()[0]}"
                ) from err

    return dataclasses.replace(spec, gradients=dataclasses.replace(spec.gradients, kernel_vjp=kernel_vjp))


# How JAX says that a function has no reverse-mode derivative: a pallas_call without
# a custom_vjp cannot be linearised (generic lowering), or its primitive has no
# differentiation rule (the Mosaic GPU and TPU lowerings).
_NO_VJP = ("Linearization failed to produce known values", "Differentiation rule for")


def _no_reverse_mode(err: Exception) -> bool:
    return any(marker in str(err) for marker in _NO_VJP)


# What refusing bad input looks like: an AttributeError or a KeyError is a crash.
REFUSALS = (ValueError, TypeError, NotImplementedError, AssertionError)


class Refused(Exception):
    """The function refused a bad input with one of ``REFUSALS``."""


def must_refuse(name: str, call: Callable[[], Any]) -> BadInput:
    """A bad input the function must refuse. Its messages are the author's, so any
    of ``REFUSALS`` counts; returning a value, or crashing otherwise, does not."""

    def refused() -> Any:
        try:
            return call()
        except REFUSALS as err:
            raise Refused(f"{type(err).__name__}: {err}") from err

    return BadInput(name, refused, Refused, "")


def checking_backend(backends: Sequence[str]) -> Backend:
    """Where bad inputs are tried: the first interpreter the function runs on (a
    function that runs only on hardware is tried there)."""
    return Backend(next((b for b in backends if Backend(b).is_interpreted), backends[0]))


# Tiles along one axis, for the code-path rules of the families (KernelSpec.paths).


def ragged_tiles(n: int, block: int | None) -> bool:
    """Several tiles along an axis of ``n`` and a partial last one (False for an unknown block)."""
    return bool(block and n > block and n % block != 0)


def tiles_reachable(lengths: Iterable[int], block: int) -> bool:
    """Whether one of ``lengths`` (the sizes a user's domain draws along an axis) makes
    several tiles of ``block`` and a partial last one: a builder infers that path of a
    user's kernel only where its declared sizes reach it (a kernel that takes multiples
    of its block has no partial tile: declared, the path could never be reached)."""
    return any(ragged_tiles(n, block) for n in lengths)


def reduction_block(config: Any) -> int | None:
    """The step along a dot's reduction: ours (generic ``block_k``, Mosaic GPU
    ``tile_k``) or a user kernel's ``Blocks.block_k`` (None: unknown)."""
    return getattr(config, "tile_k", getattr(config, "block_k", None))


def row_block(config: Any) -> int | None:
    """The rows of one output tile: ours (generic ``block_m``, Mosaic GPU ``tile_m``)."""
    return getattr(config, "tile_m", getattr(config, "block_m", None))


def column_block(config: Any) -> int | None:
    """The columns of one output tile: ours (generic ``block_n``, Mosaic GPU ``tile_n``)."""
    return getattr(config, "tile_n", getattr(config, "block_n", None))


# Parameters of the families, for pairwise coverage (KernelSpec.parameters).

# The backends whose generic kernels draw from the interpreters' config spaces (blocks
# of 16 and 32): their config names are declared; Triton's hardware space is larger
GENERIC_INTERPRETED = ("interpret", "tpu_interpret")
WARPGROUPS = ("one warpgroup", "warp-specialised")


def warpgroups(config: Any) -> str:
    """A Mosaic GPU config's form (``WARPGROUPS``): one consumer warpgroup, or two."""
    return WARPGROUPS[config.consumers - 1]


def config_parameter(name_of: Callable[[Any], str], values: Sequence[str], backends: Sequence[str]) -> Parameter:
    """The "config" parameter on ``backends``: ``name_of(config)``, one of ``values``."""
    return Parameter("config", tuple(values), lambda case, config: (name_of(config),), backends=tuple(backends))


def input_kind(kinds: Sequence[str]) -> Parameter:
    """The "input kind" parameter: the element kinds a case drew (``Case.kinds``), of ``kinds``."""
    return Parameter("input kind", tuple(kinds), lambda case, config: case.kinds, element_kind=True)


# the element kinds the dot-like families (matmul, ragged_dot, GLU) draw
DOT_KINDS = ("normal", "large", "subnormal", "few_distinct", "positive")


def reduction_name(config: Any) -> str:
    """A dot-like config's name by its step along the reduction (``reduction_block``)."""
    return f"K block {reduction_block(config)}"


def activation_parameters(backends: Sequence[str]) -> tuple[Parameter, ...]:
    """The "activation" parameter on each of ``backends``: the activations its kernel offers."""
    return tuple(
        Parameter(
            "activation",
            matmul.supported_activations(b),
            lambda case, config: (case.params["activation"],),
            backends=(b,),
        )
        for b in backends
    )
