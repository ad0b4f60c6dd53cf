"""KernelSpec: everything the harness needs to check one kernel (data only).

A spec binds a kernel to its float64 oracle, its error bound, its input
strategies, its config space and the checks that apply. The registry of specs
(``verify``, the test suite and fuzz campaigns iterate it) is ``registry.py``,
above the families it lists.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels.backends import GENERIC, MOSAIC_GPU, Backend
from pallascheck.oracles.tolerance import Arithmetic

# What a kernel, xla_reference or their VJPs return: a JAX array (or a numpy one); the
# runner brings it to the host
Output = jax.Array | np.ndarray


# ml_dtypes' formats, which np.load cannot restore by name: saved as unsigned bits
BITS_ONLY_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


@dataclasses.dataclass(frozen=True)
class Case:
    """One drawn input: named arrays plus static parameters (JSON-serialisable)."""

    arrays: Mapping[str, np.ndarray]
    params: Mapping[str, Any]
    # the input element kinds drawn for it ("large", "subnormal", ...), for failure
    # messages: what the values were meant to stress (strategies.with_drawn_kinds)
    kinds: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def describe(self) -> str:
        shapes = ", ".join(f"{k}{tuple(v.shape)}:{v.dtype}" for k, v in self.arrays.items())
        return f"{shapes}; {json.dumps(dict(self.params), sort_keys=True, default=str)}"

    def save(self, path: str) -> None:
        """Write the case as .npz (arrays bit-exact; bf16 and FP8 stored as their bits)."""
        payload: dict[str, Any] = {}  # keywords of np.savez, whose own (allow_pickle) are not arrays
        dtypes = {}
        for key, value in self.arrays.items():
            dtypes[key] = value.dtype.name
            bits = np.dtype(f"uint{8 * value.dtype.itemsize}")
            payload[f"array:{key}"] = value.view(bits) if value.dtype.name in BITS_ONLY_DTYPES else value
        payload["meta"] = np.array(
            json.dumps({"params": dict(self.params), "dtypes": dtypes, "kinds": list(self.kinds)}, default=str)
        )
        np.savez(path, **payload)

    @staticmethod
    def load(path: str) -> Case:
        import ml_dtypes

        with np.load(path) as data:
            meta = json.loads(str(data["meta"]))
            arrays = {}
            for key, dtype in meta["dtypes"].items():
                value = data[f"array:{key}"]
                arrays[key] = value.view(getattr(ml_dtypes, dtype)) if dtype in BITS_ONLY_DTYPES else value
        return Case(arrays, meta["params"], tuple(meta.get("kinds", ())))  # saved before kinds were: none


@dataclasses.dataclass(frozen=True)
class Layout:
    """One production layout: its name (model and shape), the fields of the family's
    Domain it sets (the spec's own domain keeps the rest: a narrowed domain of a
    user's kernel stays narrowed), the device bytes its check needs, and the cases a
    Hypothesis example checks at it (None: the tier's, ``runner.layout_cases``).
    ``on_device``: the device bytes its check needs with its float64 results on the
    device, where ``needs`` counts them held on the host (a process whose share is
    below it holds them there: ``KernelSpec.results_on_device_bytes``); None where
    they are never held."""

    name: str
    fields: dict[str, Any]
    needs: int
    cases: int | None = None
    on_device: int | None = None


class ProductionCases(Protocol):
    """(dtype, backend, layout) -> the production shape tier's cases; ``layout``: only
    the layouts whose name contains it (properties/production.py)."""

    def __call__(self, dtype: str, backend: Backend, layout: str | None = None) -> st.SearchStrategy[Case]: ...


@dataclasses.dataclass(frozen=True)
class CodePath:
    """A code path of the kernel that a run must reach, stated as a rule over what a
    case draws: ``reached(case, config)`` says whether checking ``case`` under
    ``config`` runs it (a warp-specialised CTA's second warpgroup on real rows, a
    ragged-dot group straddling a row tile, several kv blocks). ``backends``: the
    backends whose kernel has the path (None: every one the spec runs on); ``tiers``:
    the shape tiers that must reach it."""

    name: str
    reached: Callable[[Case, Any], bool]
    backends: Sequence[str] | None = None
    tiers: Sequence[str] = ("small",)
    # False for a path a builder inferred from a user's declared tiling: the user's
    # buckets may not reach it, which verify reports as not checked and the suite warns
    # of; a declared (required) one not reached fails the spec's tests
    required: bool = True


@dataclasses.dataclass(frozen=True)
class Parameter:
    """A discrete parameter of the kernel, for pairwise coverage: ``of(case, config)``
    gives the values that checking ``case`` under ``config`` takes, each one of
    ``values`` (one value for most parameters; an input kind takes each element kind
    the case drew). A run counts the pairs of values of two parameters its checked
    cases met (properties/pairs.py); with ``cover_pairs`` (``verify --cover-pairs``)
    ``runner.run_property`` draws for the pairs its budget missed and reports those no
    draw meets. ``element_kind``: the values are
    element kinds, which a draw can pin (``strategies.pinned_element_kind``); a config
    is pinned by its index. ``backends`` and ``tiers``: as CodePath's."""

    name: str
    values: Sequence[Hashable]
    of: Callable[[Case, Any], Collection[Hashable]]
    backends: Sequence[str] | None = None
    tiers: Sequence[str] = ("small",)
    element_kind: bool = False


@dataclasses.dataclass(frozen=True)
class GradientSpec:
    """Backward-pass checks. Cases carry the output cotangent as ``arrays['cotangent']``."""

    kernel_vjp: Callable[[Case, Any, Backend], Mapping[str, Output]]
    oracle_vjp: Callable[[Case, Any], Mapping[str, np.ndarray]]
    # (case, oracle, exact grads, config or None for xla_reference, arithmetic) -> bounds
    bound: Callable[[Case, Any, Mapping[str, np.ndarray], Any, Arithmetic], Mapping[str, np.ndarray]]
    # xla_reference's VJP, where the bound models autodiff's graph of it (else None)
    reference_vjp: Callable[[Case], Mapping[str, Output]] | None = None
    # (case, oracle, exact grads, arithmetic) -> the accuracy contract of each gradient
    contract: Callable[[Case, Any, Mapping[str, np.ndarray], Arithmetic], Mapping[str, np.ndarray]] | None = None
    # False where ``bound`` and ``contract`` never read the exact grads (they are given
    # None): the runner then asks them with the oracle's own calls, so that an oracle
    # computed in parts serves every call in one pass instead of two
    bound_reads_gradients: bool = True


@dataclasses.dataclass(frozen=True)
class Relation:
    """A metamorphic relation: ``run(case, config, backend, out)`` returns (lhs, rhs,
    bound); ``out`` is the kernel's output on ``case`` under that config and backend,
    which the runner has already computed (the relation runs the transformed case)."""

    name: str
    run: Callable[[Case, Any, Backend, np.ndarray], tuple[Any, Any, Any]]


@dataclasses.dataclass(frozen=True)
class BadInput:
    """Bad input and the promised exception (regex on its message)."""

    name: str
    call: Callable[[], Any]
    exception: type[BaseException]
    match: str


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str
    dtypes: Sequence[str]
    cases: Callable[[str, Backend], st.SearchStrategy[Case]]
    kernel: Callable[[Case, Any, Backend], Output]
    reference: Callable[[Case], Output]  # xla_reference, same dtype
    oracle: Callable[[Case], Any]
    expected: Callable[[Any], np.ndarray]  # the oracle's output
    # (case, oracle, config or None for xla_reference, arithmetic) -> bound array:
    # the implementation bound, a model of the kernel's own arithmetic
    bound: Callable[[Case, Any, Any, Arithmetic], np.ndarray]
    configs: Callable[[Case, Backend], Sequence[Any]]
    default_config: Any
    # (case, oracle, arithmetic) -> the accuracy contract: the error a backward-stable
    # algorithm for the op achieves in the output's arithmetic, whatever the kernel's
    # algorithm (None: the spec states none, and only the implementation bound applies)
    contract: Callable[[Case, Any, Arithmetic], np.ndarray] | None = None
    gradients: GradientSpec | None = None
    relations: Sequence[Relation] = ()
    bad_inputs: Callable[[], Sequence[BadInput]] = lambda: ()
    # backend names the kernel has an implementation for
    backends: Sequence[str] = GENERIC
    # where a backend's implementation differs (Mosaic GPU: bf16/f16 only, its own
    # Config type): dtypes and default config per backend name
    dtypes_on: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    default_config_on: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # (dtype, backend) -> the production shape tier's cases (properties/production.py):
    # layouts of real models; None: the spec has no production tier
    production: ProductionCases | None = None
    # the named layouts of real models that ``production`` draws from (the family's own)
    production_layouts: Sequence[Layout] = ()
    # the code paths every run must reach (runner.run_property draws for any the
    # random draws missed, and reports each one's cases)
    paths: Sequence[CodePath] = ()
    # the kernel's discrete parameters (config, causal, input kind, ...): a run counts
    # the pairs of their values its cases met, and with cover_pairs draws for the rest
    # (runner.run_property), reporting those no draw meets
    parameters: Sequence[Parameter] = ()
    # (case) -> the device bytes xla_reference needs for it, where that can outgrow
    # the kernel's own (attention's materialises [b, h, sq, skv] logits): a case whose
    # reference does not fit the memory the process may use leaves the reference check
    # out, saying so. None: it always fits where the kernel does
    reference_bytes: Callable[[Case], int] | None = None
    # (case) -> the check's device bytes when a streamed case's float64 results
    # (oracles/chunks.py) stay on the device: where that is more than the process may
    # use, they are held on the host (slower; the family's production rule counts
    # that). None: they stay on the device
    results_on_device_bytes: Callable[[Case], int] | None = None
    # (case, seed) -> cases with case's shapes and params, values redrawn by each of the
    # spec's adversarial kinds (the autotuner's numerics gate); None: the generic
    # kinds of strategies.elements suit every float array of the spec
    adversarial: Callable[[Case, int], Sequence[Case]] | None = None
    # (case, oracle, config, arithmetic, failed outcome) -> lines appended to a failed
    # values, reference, gradients or contract check's message (a derived bound says
    # which facts it used and whether looser facts would explain the error)
    explain: Callable[[Case, Any, Any, Arithmetic, Any], str] | None = None

    def runs_on(self, backend: Backend) -> bool:
        return backend.name in self.backends

    def dtypes_for(self, backend: Backend) -> Sequence[str]:
        return self.dtypes_on.get(backend.name, self.dtypes)

    def default_config_for(self, backend: Backend) -> Any:
        return self.default_config_on.get(backend.name, self.default_config)

    def paths_for(self, backend: Backend, shapes: str = "small") -> list[CodePath]:
        """The declared paths a run on ``backend`` at the ``shapes`` tier must reach."""
        return _for_run(self.paths, backend, shapes)

    def parameters_for(self, backend: Backend, shapes: str = "small") -> list[Parameter]:
        """The declared parameters whose pairs a run on ``backend`` at the ``shapes`` tier counts."""
        return _for_run(self.parameters, backend, shapes)


def _for_run[T: (CodePath, Parameter)](declared: Sequence[T], backend: Backend, shapes: str) -> list[T]:
    """Those of ``declared`` (paths, parameters) for a run on ``backend`` at the ``shapes`` tier."""
    return [p for p in declared if shapes in p.tiers and (p.backends is None or backend.name in p.backends)]


@dataclasses.dataclass(frozen=True)
class AnyOrderContract:
    """The accuracy contract of an op whose implementation bound, at config None,
    models the canonical backward-stable algorithm: every sum one chain in any order
    (gamma_{n-1}), f32 accumulation, one rounding of the output. That is the
    xla_reference model of the dot-like specs (matmul, GLU, ragged_dot); a tiled
    kernel's blocked order is inside it (gamma_{b-1+n/b-1} <= gamma_{n-1}). It is
    xla_reference's bound itself, so the runner computes and holds it once for both."""

    bound: Callable[..., Any]

    def __call__(self, case: Case, ref: Any, *rest: Any) -> Any:
        """(case, oracle, arithmetic), or for gradients (case, oracle, grads, arithmetic)."""
        return self.bound(case, ref, *rest[:-1], None, rest[-1])


def any_order_contract(bound: Callable[[Case, Any, Any, Arithmetic], np.ndarray]) -> Callable[..., np.ndarray]:
    """``AnyOrderContract`` of a spec's bound."""
    return AnyOrderContract(bound)


def any_order_gradient_contract(
    bound: Callable[..., Mapping[str, np.ndarray]],
) -> Callable[..., Mapping[str, np.ndarray]]:
    """``AnyOrderContract`` of a GradientSpec bound."""
    return AnyOrderContract(bound)


def config_fields(
    blocks: Any,
    configs: Callable[[Case, Backend], Sequence[Any]] | None = None,
    default: Any = None,
    mosaic_gpu_default: Any = None,
) -> dict[str, Any]:
    """A KernelSpec's config fields. For a kernel that is not ours, its fixed tiling
    ``blocks`` is the one config (a family with no kernel of ours passes nothing else).
    For ours (``blocks`` None): its config space and default, and where it has a Mosaic
    GPU version, that version's dtypes (bf16/f16) and default config on the Mosaic GPU
    backends."""
    if blocks is not None:
        return {"configs": lambda case, backend: [blocks], "default_config": blocks}
    fields: dict[str, Any] = {"configs": configs, "default_config": default}
    if mosaic_gpu_default is not None:
        fields["dtypes_on"] = {n: ("bfloat16", "float16") for n in MOSAIC_GPU}
        fields["default_config_on"] = {n: mosaic_gpu_default for n in MOSAIC_GPU}
    return fields
