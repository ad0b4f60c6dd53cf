"""``from_reference``: the KernelSpec of any kernel, from the author's jax.numpy reference.

No family of ours needed: the oracle and both bounds come from the reference's jaxpr
(oracles/derive.py) evaluated on each drawn case, in float64 and in the error algebra,
for the facts the author states about the kernel (the dtype it computes in, the order
of its reductions). The contract is the same reference computed in f32 with every
reduction in any order and dots fed in the input dtype; ``xla_reference`` (the reference under ``jax.jit``) is checked
against the derivation with the reference's own dtypes. Gradients: the same
derivation over the jaxpr of the reference's VJP.

A derivation models one order of operations, the reference's. Where correct kernels
of the op compute in other orders (a cross-entropy gradient as ``g (p - onehot)`` or
as ``g p - g onehot``), ``formulations`` and ``gradient_formulations`` name them in
jax.numpy: each is derived like the reference and every bound is the elementwise
largest of theirs, so a kernel that follows any of them is judged at the declared
precision, and one below it still is not.

    spec = from_reference(my_kernel, my_reference, name="swiglu",
                          inputs={"x": (8, 64), "y": (8, 64)}, facts=Facts(compute_dtype="float32"))
    test_swiglu = spec_tests(spec)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pallascheck.kernels.backends import GENERIC, Backend
from pallascheck.oracles import derive
from pallascheck.oracles.derive import Derived, Facts
from pallascheck.oracles.tolerance import SEQUENTIAL, Arithmetic, unit_roundoff
from pallascheck.properties import builders, strategies
from pallascheck.properties.spec import Case, GradientSpec, KernelSpec, config_fields


@dataclasses.dataclass(frozen=True)
class Input:
    """One argument of the kernel and the reference, in call order.

    - ``shape``: its shape (``layouts`` of ``from_reference`` give more);
    - ``dtype``: None: the dtype under test; else fixed (an int32 position table, an
      f32 scale);
    - ``values``: the domain, where the generic element kinds do not fit:
      ``values(rng, shape, dtype) -> array`` (positions, probabilities, a positive
      variance); None: ``strategies.elements`` of the drawn kind;
    - ``reduction``: the length of the sums it enters, so the "large" kind stays 1/8
      below overflow (K for a matmul operand);
    - ``kinds``: the element kinds that suit it (None: every kind drawn); where the
      drawn kind is not among them it is "normal" (a weight matrix whose rows of
      mean 1e4 overflow f16 in any matmul);
    - ``differentiable``: its gradient is checked (float inputs of the tested dtype).
    """

    shape: tuple[int, ...]
    dtype: str | None = None
    values: Callable[[np.random.Generator, tuple[int, ...], Any], np.ndarray] | None = None
    reduction: int = 1
    kinds: Sequence[str] | None = None
    differentiable: bool = True


def _as_input(spec: Input | tuple[int, ...]) -> Input:
    return spec if isinstance(spec, Input) else Input(tuple(spec))


@dataclasses.dataclass
class DerivedOracle:
    """A case's inputs and its derivations, one per (facts, arithmetic), computed once."""

    args: tuple[np.ndarray, ...]
    forward: Callable[..., Any]
    cache: dict[Any, Derived] = dataclasses.field(default_factory=dict)
    formulations: tuple[Callable[..., Any], ...] = ()

    def derivation(
        self, key: Any, facts: Facts, arith: Arithmetic, fn: Callable[..., Any], args: Sequence[Any]
    ) -> Derived:
        if key not in self.cache:
            self.cache[key] = derive.derive(fn, args, facts=facts, arith=arith)
        return self.cache[key]

    def values(self, facts: Facts, arith: Arithmetic) -> Derived:
        return self.derivation(("values", facts, arith), facts, arith, self.forward, self.args)

    @property
    def out(self) -> np.ndarray:
        return self.values(CONTRACT, _EXACT_ARITH).values[0]

    def widest(self, facts: Facts, arith: Arithmetic) -> np.ndarray:
        """The bound of the output for ``facts``: the largest over the reference and its
        formulations (NaN where any finds the element unverifiable)."""
        return widest(
            [self.values(facts, arith)]
            + [
                self.derivation(("values", i, facts, arith), facts, arith, form, self.args)
                for i, form in enumerate(self.formulations)
            ],
            0,
            "formulations",
        )


# The contract: the reference's math in f32, every reduction and dot in any order, the
# dots fed operands in the input dtype (what a bf16 tensor core takes: a backward pass
# cannot keep its f32 dz at the MMA).
CONTRACT = Facts(compute_dtype="float32", order=SEQUENTIAL, dot_operands="inputs")
# xla_reference: the reference under jax.jit, each intermediate in the dtype the
# reference gives it, XLA's reductions in an order it does not promise.
AS_WRITTEN = Facts(compute_dtype=None, order=SEQUENTIAL)
_EXACT_ARITH = Arithmetic("values-only")  # the values do not depend on the arithmetic


def widest(derivations: Sequence[Derived], output: int, what: str) -> np.ndarray:
    """The elementwise largest bound of ``derivations`` of one op (the first is the
    reference's), NaN where any of them finds the element unverifiable (a correct kernel
    following that one may go either way there). A formulation whose exact value
    differs from the reference's by more than its own bound computes another op: a
    ValueError naming it (``what``), not a looser bound."""
    first = derivations[0]
    for i, d in enumerate(derivations[1:]):
        apart = np.abs(d.values[output] - first.values[output]) > d.bounds[output]
        if np.any(apart):
            at = tuple(int(j) for j in np.argwhere(apart)[0])
            raise ValueError(
                f"{what}[{i}] is not the reference's op: at {at} its exact value {d.values[output][at]:.6g} "
                f"differs from the reference's {first.values[output][at]:.6g} by more than its own bound "
                f"{d.bounds[output][at]:.3g}; give only formulations equal to the reference in exact arithmetic"
            )
    bound = np.max(np.stack([d.bounds[output] for d in derivations]), axis=0)
    unverifiable = np.any(np.stack([d.unverifiable[output] for d in derivations]), axis=0)
    return np.where(unverifiable, np.nan, bound)


def from_reference(
    kernel: Callable[..., jax.Array],
    reference: Callable[..., jax.Array],
    *,
    name: str,
    inputs: Mapping[str, Input | tuple[int, ...]],
    facts: Facts = Facts(),
    layouts: Sequence[Mapping[str, tuple[int, ...]]] = (),
    dtypes: Sequence[str] = strategies.DTYPES,
    kinds: Sequence[str] = strategies.ELEMENT_KINDS,
    differentiable: bool = False,
    backends: Sequence[str] = GENERIC,
    interpret: str | None = "interpret",
    bad_inputs: Mapping[str, Callable[[], Any]] | None = None,
    formulations: Sequence[Callable[..., jax.Array]] = (),
    gradient_formulations: Sequence[Callable[..., tuple[jax.Array, ...]]] = (),
) -> KernelSpec:
    """The spec of ``kernel(*inputs)``, which computes what ``reference(*inputs)``
    (plain jax.numpy, one output array) states, in the way ``facts`` describe.

    - ``inputs``: name -> shape or ``Input``, in call order; ``layouts``: more shape
      sets (name -> shape), drawn like our families' shape buckets;
    - ``facts``: what the kernel computes in and in which order (oracles/derive.Facts);
      the implementation bound models exactly that, the contract f32 in any order;
    - ``kinds``: the adversarial element kinds drawn (strategies.ELEMENT_KINDS);
    - ``differentiable``: the kernel's VJP (a ``jax.custom_vjp``) is checked against
      the derivation over the reference's VJP, for each ``Input.differentiable``;
    - ``backends`` / ``interpret``: see ``builders.call_on``;
    - ``bad_inputs``: name -> a call the kernel must refuse (``builders.must_refuse``);
    - ``formulations``: the same op in other orders of operations, called like the
      reference; each bound is the largest of theirs and the reference's (their VJPs
      join the gradients'); ``gradient_formulations``: the VJP in other orders,
      ``f(*inputs, cotangent) -> (gradient of each differentiable input, ...)``.

    A failed check names the facts, the primitive that dominates the bound at the
    worst element, and whether looser facts (compute in the input dtype, any order)
    would explain the error: then suspect the facts, else the kernel.
    """
    names = list(inputs)
    specs = {n: _as_input(s) for n, s in inputs.items()}
    all_layouts = [{n: specs[n].shape for n in names}] + [{**{n: specs[n].shape for n in names}, **l} for l in layouts]
    wrt = tuple(i for i, n in enumerate(names) if specs[n].differentiable and specs[n].dtype is None)
    if differentiable and not wrt:
        raise ValueError("differentiable: no input of the tested dtype is marked differentiable")
    grad_names = [f"d{names[i]}" for i in wrt]

    def dtype_of(n: str, dtype: str) -> np.dtype:
        return strategies.np_dtype(specs[n].dtype or dtype)

    def out_struct(case: Case) -> jax.ShapeDtypeStruct:
        return jax.eval_shape(
            reference, *[jax.ShapeDtypeStruct(case.arrays[n].shape, case.arrays[n].dtype) for n in names]
        )

    def cases(dtype: str, backend: Backend) -> st.SearchStrategy[Case]:
        @st.composite
        def draw(draw_) -> Case:
            layout = all_layouts[draw_(strategies.layout(f"{name}.layout", st.sampled_from(range(len(all_layouts)))))]
            kind = draw_(strategies.element_kinds(kinds))
            seed = draw_(strategies.seeds())
            arrays = {}
            for i, n in enumerate(names):
                shape, dt, input_spec = layout[n], dtype_of(n, dtype), specs[n]
                if input_spec.values is not None:
                    arrays[n] = np.asarray(input_spec.values(np.random.default_rng(seed + i), shape, dt)).astype(dt)
                else:
                    own = kind if input_spec.kinds is None or kind in input_spec.kinds else "normal"
                    arrays[n] = strategies.elements(seed + i, shape, dt.name, own, reduction=input_spec.reduction)
            case = Case(arrays, {})
            if differentiable:
                out = out_struct(case)
                arrays["cotangent"] = strategies.elements(
                    seed + len(names), out.shape, np.dtype(out.dtype).name, "normal"
                )
            return Case(arrays, {})

        return draw()

    def args_of(case: Case) -> tuple[np.ndarray, ...]:
        return tuple(case.arrays[n] for n in names)

    def run(case: Case, config: Any, backend: Backend) -> jax.Array:
        out = builders.call_on(kernel, backend, backends, interpret, *[jnp.asarray(a) for a in args_of(case)])
        want = out_struct(case)
        want_dtype = strategies.np_dtype(facts.out_dtype) if facts.out_dtype else np.dtype(want.dtype)
        if not isinstance(out, jax.Array) or out.shape != want.shape or out.dtype != want_dtype:
            raise TypeError(
                f"{name} must return one array of shape {want.shape} and dtype {want_dtype} "
                f"(the reference's), got {getattr(out, 'shape', type(out))} {getattr(out, 'dtype', '')}"
            )
        return out

    def oracle(case: Case) -> DerivedOracle:
        return DerivedOracle(args_of(case), reference, formulations=tuple(formulations))

    def bound(case: Case, ref: DerivedOracle, config: Facts | None, arith: Arithmetic) -> np.ndarray:
        return ref.widest(config or AS_WRITTEN, arith)

    def contract(case: Case, ref: DerivedOracle, arith: Arithmetic) -> np.ndarray:
        return ref.widest(dataclasses.replace(CONTRACT, out_dtype=facts.out_dtype), arith)

    # ---------------------------------------------------------------- gradients
    pulled = derive.vjp_function(reference, wrt)
    # the VJP's other orders: each formulation's autodiff VJP, then those stated
    other_pulls = [derive.vjp_function(f, wrt) for f in formulations] + list(gradient_formulations)

    def grad_derivation(case: Case, ref: DerivedOracle, facts_: Facts, arith: Arithmetic, form: int = -1) -> Derived:
        return ref.derivation(
            ("grads", form, facts_, arith),
            dataclasses.replace(facts_, out_dtype=None),
            arith,
            pulled if form < 0 else other_pulls[form],
            ref.args + (case.arrays["cotangent"],),
        )

    def kernel_vjp(case: Case, config: Any, backend: Backend) -> dict[str, jax.Array]:
        args = [jnp.asarray(a) for a in args_of(case)]

        def partial(*diff: jax.Array) -> jax.Array:
            full = list(args)
            for i, d in zip(wrt, diff):
                full[i] = d
            return run(Case(cast(dict[str, np.ndarray], dict(zip(names, full))), {}), config, backend)  # traced arrays

        _, pullback = jax.vjp(partial, *[args[i] for i in wrt])
        return dict(zip(grad_names, pullback(jnp.asarray(case.arrays["cotangent"]))))

    def reference_vjp(case: Case) -> dict[str, jax.Array]:
        return dict(zip(grad_names, jax.jit(pulled)(*args_of(case), case.arrays["cotangent"])))

    def oracle_vjp(case: Case, ref: DerivedOracle) -> dict[str, np.ndarray]:
        return dict(zip(grad_names, grad_derivation(case, ref, CONTRACT, _EXACT_ARITH).values))

    def gradient_bound(
        case: Case, ref: DerivedOracle, grads: Any, config: Facts | None, arith: Arithmetic
    ) -> dict[str, np.ndarray]:
        stated = config or AS_WRITTEN
        ds = [grad_derivation(case, ref, stated, arith, form) for form in range(-1, len(other_pulls))]
        return {g: widest(ds, i, "gradient formulations") for i, g in enumerate(grad_names)}

    def gradient_contract(case: Case, ref: DerivedOracle, grads: Any, arith: Arithmetic) -> dict[str, np.ndarray]:
        return gradient_bound(case, ref, grads, CONTRACT, arith)

    gradients = (
        GradientSpec(kernel_vjp, oracle_vjp, gradient_bound, reference_vjp=reference_vjp, contract=gradient_contract)
        if differentiable
        else None
    )

    # ---------------------------------------------------------------- explanations
    def explain(case: Case, ref: DerivedOracle, config: Facts | None, arith: Arithmetic, outcome: Any) -> str:
        worst = outcome.worst
        stated = {"contract": CONTRACT}.get(outcome.check.split(":")[0], config or AS_WRITTEN)
        gradient = worst.name in grad_names
        output = grad_names.index(worst.name) if gradient else 0

        def derivation(f: Facts) -> Derived:
            return grad_derivation(case, ref, f, arith) if gradient else ref.values(f, arith)

        d = derivation(stated)
        at = worst.index
        lines = [
            f"derived bound: facts {stated.describe()} on {arith.name} arithmetic; "
            f"at {at} it is dominated by {d.explain(output, at)}"
        ]
        if d.unverifiable[output][at]:
            count = int(d.unverifiable[output].sum())
            lines.append(
                f"the element is unverifiable ({count} of {d.unverifiable[output].size} in this case): "
                f"{d.explain(output, at)} decides it with operands closer than their error bounds, so the "
                "kernel may legitimately go either way; draw inputs away from that tie (Input.values)"
            )
            return "\n  ".join(lines)
        floats = [a.dtype for a in ref.args if jnp.issubdtype(a.dtype, jnp.floating)]
        narrowest = max((np.dtype(f).name for f in floats), key=unit_roundoff, default="float32")
        loose = Facts(
            compute_dtype=narrowest,
            order=SEQUENTIAL,
            transcendental_ulps=stated.transcendental_ulps,
            out_dtype=stated.out_dtype,
            dot_operands="inputs",
        )
        loose_bound = float(derivation(loose).bounds[output][at])
        if worst.kernel is not None and not np.isfinite(worst.kernel) and np.isfinite(worst.oracle or 0.0):
            # an overflow (or a NaN from one) is told by checks.infinity_story: no
            # precision or order of the facts makes a finite result infinite
            lines.append(
                f"the kernel's {worst.kernel} against a finite exact result: not a matter of precision or "
                "order; see where an intermediate leaves the compute dtype's range"
            )
        elif worst.error is not None and worst.error <= loose_bound:
            lines.append(
                f"error {worst.error:.3e} is within the bound for looser facts ({loose.describe()}: "
                f"{loose_bound:.3e}): either the kernel computes in a lower precision or another order than "
                "the facts state, or it is wrong by less than those facts would allow. Loosen the facts only "
                "if the kernel is written to compute that way: loosened to make the check pass, they could "
                "hide a real bug of this size"
            )
        else:
            lines.append(
                f"error {worst.error:.3e} exceeds even the bound for the loosest facts ({loose.describe()}: "
                f"{loose_bound:.3e}): the kernel computes something else than the reference here"
            )
        return "\n  ".join(lines)

    jitted = jax.jit(reference)
    spec = KernelSpec(
        name=name,
        dtypes=dtypes,
        cases=cases,
        kernel=run,
        reference=lambda case: jitted(*args_of(case)),
        oracle=oracle,
        expected=lambda ref: ref.out,
        bound=bound,
        contract=contract,
        **config_fields(facts),
        gradients=gradients,
        bad_inputs=lambda: [builders.must_refuse(n, call) for n, call in (bad_inputs or {}).items()],
        backends=backends,
        explain=explain,
    )
    return builders.backward_on_backend(spec, interpret)
