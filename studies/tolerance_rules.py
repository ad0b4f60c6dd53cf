"""``python -m studies.tolerance_rules``: what seven ways of judging a kernel's numbers
catch, on the same inputs.

Rules, each applied to the output and (where the kernel is differentiable) every
gradient, against the float64 oracle:
- ``contract``: the spec's accuracy contract (the implementation bound where the
  spec states none);
- ``implementation``: the spec's bound of the kernel's own arithmetic;
- ``torch``: ``torch.testing.assert_close``'s default tolerances for the compared
  array's dtype, |a - b| <= atol + rtol |b|: float16 (1e-3, 1e-5), bfloat16
  (1.6e-2, 1e-5), float32 (1.3e-6, 1e-5), float64 (1e-7, 1e-7) (rtol, atol;
  PyTorch's documentation; top-k's values and indices are compared as one float64
  encoding);
- ``jax``: JAX's test tolerance for the dtype, used as both atol and rtol
  (``JaxTestCase.assertAllClose``; read from JAX, ``compat.jax_test_tolerance``:
  0.1 for both FP8 formats);
- ``tokamax``: the tolerances of Tokamax's own tests for the op (tokamax 0.0.17:
  studies/tokamax_tolerances.py, each value with the file and line it comes from), by
  the input dtype, for the arrays Tokamax's tests compare. Tokamax compares with an
  f32 reference; here the tolerance is applied against our float64 oracle (for bf16
  and f16 the f32 reference's own error is far below these tolerances), rounded to
  the compared array's dtype for the norms, whose reference Tokamax rounds so. Its
  f32 tolerances are of the size of f32 rounding, met in Tokamax's tests because the
  reference rounds as the kernel does: against the exact result they can fail a
  correct f32 kernel (a false alarm of the tolerance, not a kernel bug). Where Tokamax's tests
  hold no tolerance (matmul, cross-entropy, top-k; f16 norms; GLU other than bf16;
  bf16 linear cross-entropy; f32 ragged-dot gradients) the rule does not apply: it
  neither kills nor alarms, and counts are of the variants and rows it applies to;
- ``calc_diff`` (FP8 kernels only): DeepGEMM's test, ``1 - 2 sum(x y) / sum(x^2 + y^2)``
  over the whole output in float64, failing at 1e-3 or more (a global similarity:
  a few wrong elements barely move it);
- ``transformer_engine`` (FP8 kernels only): Transformer Engine's test tolerance for
  the FP8 format, |a - b| <= atol + rtol |b|: e4m3 (rtol 0.125, atol 0.0675), e5m2
  (0.25, 0.125) (``dtype_tols`` of its tests).

Inputs: the broken variants under tests/broken (each with its own dtypes, example
count and input regime, as in the sensitivity suite, on the backend its kernels run
on) and the shipped kernels of the registry (every dtype, ``examples`` cases each),
drawn by Hypothesis with a fixed seed, each with a config of its space (drawn as the
suite draws them). A variant is
killed by a rule when some case fails it; a shipped kernel x dtype that fails a rule
is a false alarm. Only values and gradients are judged here: the suite's other checks
(determinism, configs agreeing, relations, the interpreters' race detectors) catch
variants that no tolerance can, and those count as misses under every rule.

A third group, where Tokamax is installed: Tokamax's own XLA implementations (the
``tokamax:<op>:xla``, ``xla_chunked``, ``chunked_xla`` specs of
properties/outside/tokamax.py, on ``interpret``, which on the CPU is compiled XLA:CPU),
neither broken nor ours, one row per spec x dtype, each judged twice with
``examples`` cases: on the spec's drawn cases ("drawn") and on the same shapes with
the floating inputs redrawn as Tokamax's tests draw them ("tokamax": N(0, 1); norm
scale and offset U(0, 1); ragged-dot operands normal with std 0.1; masks, labels, group
sizes and cotangents as drawn: ``tokamax_tolerances.tokamax_inputs``). Each row
records the worst error / allowed error of every rule over its cases, so it shows
where our bounds find a weakness that Tokamax's tolerance passes, and where
Tokamax's tolerance fails a case our bounds accept.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from pallascheck.kernels import compat
from pallascheck.kernels.backends import GENERIC, Backend
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import checks
from pallascheck.properties.registry import registry
from pallascheck.properties.spec import Case, KernelSpec
from studies import tokamax_tolerances

RULES = ("contract", "implementation", "torch", "jax", "tokamax", "calc_diff", "transformer_engine")
FP8_RULES = ("calc_diff", "transformer_engine")  # they judge FP8 kernels only
TORCH_RTOL_ATOL = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
    # torch's default tolerances have no float8 entry: 0 and 0, exact equality
    "float8_e4m3fn": (0.0, 0.0),
    "float8_e5m2": (0.0, 0.0),
}
CALC_DIFF_LIMIT = 1e-3  # DeepGEMM's tests: assert calc_diff(out, ref) < 0.001
TRANSFORMER_ENGINE_RTOL_ATOL = {"float8_e4m3fn": (0.125, 0.0675), "float8_e5m2": (0.25, 0.125)}
# the Tokamax implementations judged as the third group: XLA, no Pallas call, on the CPU
TOKAMAX_IMPLEMENTATIONS = ("xla", "xla_chunked", "chunked_xla")
INPUTS = ("drawn", "tokamax")


def _table_bound(expected: np.ndarray, dtype: Any, rule: str) -> np.ndarray:
    name = np.dtype(dtype).name
    if rule == "torch":
        rtol, atol = TORCH_RTOL_ATOL[name]
    elif rule == "transformer_engine":
        rtol, atol = TRANSFORMER_ENGINE_RTOL_ATOL[name]
    else:
        rtol = atol = compat.jax_test_tolerance(dtype)
    with np.errstate(invalid="ignore"):
        return atol + rtol * np.abs(np.asarray(expected, np.float64))


def fp8_format(case: Case) -> str | None:
    """The FP8 format of a case: its FP8 operands' dtype (the FP8 matmul) or the
    format it quantises to (the quantiser's ``format``); None for other kernels."""
    if "format" in case.params and str(case.params["format"]).startswith("float8"):
        return str(case.params["format"])
    return next((a.dtype.name for a in case.arrays.values() if np.dtype(a.dtype).name.startswith("float8")), None)


def calc_diff_used(actual: np.ndarray, expected: np.ndarray) -> float:
    """DeepGEMM's ``calc_diff`` (deep_gemm/testing/numeric.py) over the whole array, in
    float64, over its limit: ``1 - 2 sum(x y) / sum(x^2 + y^2)``; two all-zero arrays
    agree (DeepGEMM's 0 / 0 would be NaN), and a NaN or infinity in either fails."""
    x, y = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if x.shape != y.shape or not (np.isfinite(x).all() and np.isfinite(y).all()):
        return float("inf")
    denominator = float(np.sum(x * x + y * y))
    if denominator == 0.0:
        return 0.0
    return (1.0 - 2.0 * float(np.sum(x * y)) / denominator) / CALC_DIFF_LIMIT


class KernelCrashed(RuntimeError):
    """The kernel under judgement raised (every rule sees that)."""


def _kernel_run(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as crash:  # noqa: BLE001 - the kernel's exception is the finding
        raise KernelCrashed(f"{type(crash).__name__}: {crash}"[:300]) from crash


def judge_case(spec: KernelSpec, case: Case, config: Any, backend: Backend) -> dict[str, float | None]:
    """Per rule, the worst error / allowed error over the kernel's output and gradients
    on ``case`` (above 1: the rule fails the case); None where the rule does not apply
    (``tokamax`` where Tokamax's tests hold no tolerance for any of the arrays)."""
    arith = arithmetic_for(backend)
    ref = spec.oracle(case)
    pairs = [
        (
            "out",
            np.asarray(_kernel_run(spec.kernel, case, config, backend)),
            np.asarray(spec.expected(ref)),
            spec.bound(case, ref, config, arith),
            spec.contract(case, ref, arith) if spec.contract else None,
        )
    ]
    g = spec.gradients
    if g is not None:
        exact = g.oracle_vjp(case, ref)
        got = {k: np.asarray(v) for k, v in _kernel_run(g.kernel_vjp, case, config, backend).items()}
        bounds = g.bound(case, ref, exact, config, arith)
        contracts = g.contract(case, ref, exact, arith) if g.contract else {}
        pairs += [(k, got[k], exact[k], bounds[k], contracts.get(k)) for k in sorted(got)]
    op = tokamax_tolerances.op_of(spec.name)
    fmt = fp8_format(case)
    worst: dict[str, float | None] = {}
    for rule in RULES:
        used = []
        for name, actual, expected, impl, contract in pairs:
            if rule in FP8_RULES and fmt is None:
                continue
            if rule == "calc_diff":
                used.append(calc_diff_used(actual, expected))
                continue
            if rule == "transformer_engine":
                bound = _table_bound(expected, ml_dtypes.finfo(fmt).dtype, rule)
            elif rule in ("torch", "jax") and "format" in case.params and fmt is not None:
                # the quantiser's output q is float8 (compared here as q * scale)
                bound = _table_bound(expected, ml_dtypes.finfo(fmt).dtype, rule)
            elif rule == "tokamax":
                tolerance = tokamax_tolerances.tolerance(op, name, case)
                if tolerance is None:
                    continue
                expected, bound = tolerance.judged(actual, expected)
            elif rule == "implementation" or (rule == "contract" and contract is None):
                bound = impl
            elif rule == "contract":
                bound = contract
            else:
                bound = _table_bound(expected, actual.dtype, rule)
            used.append(checks.compare(actual, expected, bound).budget_used)
        worst[rule] = max(used) if used else None
    return worst


def _applies(rule: str, op: str | None, dtype: str) -> bool:
    """Whether ``rule`` can judge a case of input ``dtype`` (``tokamax`` by op and dtype,
    the FP8 rules on FP8 kernels only)."""
    if rule in FP8_RULES:
        return dtype.startswith("float8")
    return rule != "tokamax" or tokamax_tolerances.applies(op, dtype)


class _AllCaught(Exception):
    """Every rule that applies has already failed a case: more cases of this dtype
    cannot change the result."""


GROUPS = ("broken", "shipped", "tokamax")  # a variant of tests/broken, our kernel, Tokamax's implementation


@dataclasses.dataclass
class Result:
    name: str
    group: str  # one of GROUPS
    caught: dict[str, bool]  # rule -> some case failed it
    applies: dict[str, bool]  # rule -> it judged some case
    crashed: str = ""
    worst: dict[str, float | None] = dataclasses.field(default_factory=dict)  # rule -> worst error / allowed
    op: str | None = None  # the Tokamax op whose tolerances the tokamax rule used (None: none)
    dtype: str = ""  # Tokamax group: the row's dtype
    inputs: str = "drawn"  # "drawn" (the spec's strategies) or "tokamax" (Tokamax's distributions)


def judge(
    name: str,
    spec: KernelSpec,
    dtypes: tuple[str, ...],
    backend: Backend,
    examples: int,
    seed: int,
    group: str,
    *,
    inputs: str = "drawn",
) -> Result:
    """Draw ``examples`` cases per dtype and record which rules any case fails (and
    the worst error / allowed error of each rule over the cases judged). A broken or
    shipped row stops drawing a dtype once every rule that applies has failed; a
    Tokamax row draws every case, as its worst errors are what it reports."""
    if group not in GROUPS:
        raise ValueError(f"group must be one of {GROUPS}, got {group!r}")
    stop_early = group != "tokamax"
    op = tokamax_tolerances.op_of(spec.name)
    caught, applies = dict.fromkeys(RULES, False), dict.fromkeys(RULES, False)
    worst: dict[str, float | None] = dict.fromkeys(RULES, None)
    cases = spec.cases
    if inputs == "tokamax":
        redraw = functools.partial(tokamax_tolerances.tokamax_inputs, op)
        cases = lambda dtype, backend: spec.cases(dtype, backend).map(redraw)  # noqa: E731
    for i, dtype in enumerate(dtypes):
        live = [r for r in RULES if _applies(r, op, dtype)]

        @settings(
            max_examples=examples,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
            print_blob=False,
        )
        @hypothesis_seed(seed)
        @given(cases(dtype, backend), st.integers(0, 2**16))
        def run(case: Case, index: int) -> None:
            space = list(spec.configs(case, backend))  # a config of the case's space, as the suite draws it
            for rule, used in judge_case(spec, case, space[index % len(space)], backend).items():
                if used is not None:
                    applies[rule] = True
                    worst[rule] = used if worst[rule] is None else max(worst[rule], used)
                    caught[rule] |= used > 1.0
            if stop_early and all(caught[r] for r in live):
                raise _AllCaught

        try:
            run()
        except _AllCaught:
            rest = dtypes[i + 1 :]
            if all(caught[r] or not any(_applies(r, op, d) for d in rest) for r in RULES):
                break
        except KernelCrashed as crash:
            hit = {r: any(_applies(r, op, d) for d in dtypes) for r in RULES}
            return Result(name, group, hit, hit, str(crash), worst=worst, op=op, dtype=",".join(dtypes), inputs=inputs)
    return Result(name, group, caught, applies, worst=worst, op=op, dtype=",".join(dtypes), inputs=inputs)


def _variants(tests_dir: str) -> list[tuple[str, KernelSpec, tuple[str, ...], int, Backend]]:
    sys.path.insert(0, os.path.abspath(tests_dir))
    broken = importlib.import_module("broken")
    out = []
    for module_name in broken.MODULES:
        module = importlib.import_module(f"broken.{module_name}")
        # the generic interpreter where the module's kernels run there, else the Mosaic GPU one
        backend = Backend(
            "interpret" if "interpret" in getattr(module, "BACKENDS", GENERIC) else "mosaic_gpu_interpret"
        )
        for name, (spec, dtypes, examples) in module.VARIANTS.items():
            if backend.name not in getattr(module, "NOT_ON", {}).get(name, {}):
                out.append((f"{module_name}/{name}", spec, tuple(dtypes), examples, backend))
    return out


def tokamax_specs() -> list[tuple[str, KernelSpec]]:
    """Tokamax's XLA implementations that run on the CPU (backend ``interpret``), where
    Tokamax is installed (else none)."""
    from pallascheck.properties.outside import tokamax as tokamax_client

    if not tokamax_client.installed():
        return []
    out = []
    for name in tokamax_client.names():
        if name.rsplit(":", 1)[1] in TOKAMAX_IMPLEMENTATIONS:
            spec = tokamax_client.spec(name)
            if spec.runs_on(Backend("interpret")):
                out.append((name, spec))
    return out


def run(tests_dir: str, examples: int, seed: int = 0, tokamax: bool = True, only: tuple[str, ...] = ()) -> list[Result]:
    """Every variant, shipped kernel and (``tokamax``) Tokamax implementation, or with
    ``only`` those whose name contains one of its strings (e.g. ``("fp8",)``)."""

    def chosen(name: str) -> bool:
        return not only or any(part in name for part in only)

    results = []
    for name, spec, dtypes, count, backend in _variants(tests_dir):
        if not chosen(name):
            continue
        results.append(judge(name, spec, dtypes, backend, count, seed, "broken"))
        print(f"  {name}: {results[-1].caught}", file=sys.stderr, flush=True)
    for name, spec in registry().items():
        if not chosen(name):
            continue
        for backend in (Backend("interpret"), Backend("mosaic_gpu_interpret")):
            if spec.runs_on(backend):
                dtypes = tuple(spec.dtypes_for(backend))
                results.append(judge(f"{name} ({backend})", spec, dtypes, backend, examples, seed, "shipped"))
                print(f"  {results[-1].name}: {results[-1].caught}", file=sys.stderr, flush=True)
    for name, spec in tokamax_specs() if tokamax else ():
        if not chosen(name):
            continue
        backend = Backend("interpret")
        for dtype in spec.dtypes_for(backend):
            for inputs in INPUTS:
                results.append(judge(name, spec, (dtype,), backend, examples, seed, "tokamax", inputs=inputs))
                print(f"  {name} {dtype} ({inputs} inputs): {results[-1].worst}", file=sys.stderr, flush=True)
    return results


def summary(results: list[Result]) -> dict[str, Mapping[str, int]]:
    """Per rule: kills and misses over the broken variants it applies to, false alarms
    over the shipped kernel x backend rows it applies to (``variants_applied``,
    ``shipped_applied``; the other rules apply to all)."""
    broken = [r for r in results if r.group == "broken"]
    shipped = [r for r in results if r.group == "shipped"]
    return {
        rule: {
            "kills": sum(r.applies[rule] and r.caught[rule] for r in broken),
            "misses": sum(r.applies[rule] and not r.caught[rule] for r in broken),
            "false_alarms": sum(r.applies[rule] and r.caught[rule] for r in shipped),
            "variants": len(broken),
            "variants_applied": sum(r.applies[rule] for r in broken),
            "shipped": len(shipped),
            "shipped_applied": sum(r.applies[rule] for r in shipped),
        }
        for rule in RULES
    }


def tokamax_by_op(results: list[Result]) -> dict[str, Mapping[str, int]]:
    """The tokamax rule per Tokamax op ("n/a": specs with no Tokamax tolerance): broken
    variants, those it applies to, kills and misses; shipped rows, those it applies to,
    false alarms."""
    out: dict[str, dict[str, int]] = {}
    for r in results:
        if r.group not in ("broken", "shipped"):
            continue
        row = out.setdefault(
            r.op or "n/a",
            dict.fromkeys(("variants", "applied", "kills", "misses", "shipped", "shipped_applied", "false_alarms"), 0),
        )
        applied, caught = r.applies["tokamax"], r.caught["tokamax"]
        if r.group == "broken":
            row["variants"] += 1
            row["applied"] += applied
            row["kills"] += applied and caught
            row["misses"] += applied and not caught
        else:
            row["shipped"] += 1
            row["shipped_applied"] += applied
            row["false_alarms"] += applied and caught
    return out


def _cell(used: float | None) -> str:
    if used is None:
        return "n/a"
    return f"{'FAIL' if used > 1.0 else 'pass'} {used:.3g}"


def tokamax_rows(results: list[Result]) -> list[dict[str, Any]]:
    """The Tokamax implementations group, one row per spec x dtype x inputs: each
    rule's worst error / allowed error (None: does not apply) and what disagrees."""
    rows = []
    for r in results:
        if r.group != "tokamax":
            continue
        ours = [r.caught[k] for k in ("contract", "implementation")]
        tk = None if not r.applies["tokamax"] else r.caught["tokamax"]
        rows.append(
            {
                "spec": r.name,
                "dtype": r.dtype,
                "inputs": r.inputs,
                "worst": dict(r.worst),
                "crashed": r.crashed,
                "tokamax_passes_what_we_fail": tk is False and any(ours),
                "tokamax_fails_what_we_pass": tk is True and not any(ours),
            }
        )
    return rows


def print_report(results: list[Result]) -> None:
    table = summary(results)
    print(f"{'rule':16} {'kills':>6} {'misses':>7} {'false alarms':>13}   applies to")
    for rule, row in table.items():
        print(
            f"{rule:16} {row['kills']:>6} {row['misses']:>7} {row['false_alarms']:>13}   "
            f"{row['variants_applied']}/{row['variants']} variants, {row['shipped_applied']}/{row['shipped']} shipped rows"
        )
    first = next(iter(table.values()))
    print(
        f"({first['variants']} broken variants, {first['shipped']} shipped kernel x backend rows; a rule that "
        "does not apply to a variant or row neither kills nor alarms there)"
    )
    for r in results:
        if r.crashed:
            print(f"  crashed (counted as caught by every rule that applies): {r.name}: {r.crashed}")
    for rule in RULES:
        missed = [r.name for r in results if r.group == "broken" and r.applies[rule] and not r.caught[rule]]
        alarms = [r.name for r in results if r.group == "shipped" and r.applies[rule] and r.caught[rule]]
        print(f"\n{rule}: missed {missed}\n{rule}: false alarms {alarms}")
    print("\nWorst error / allowed error per variant and shipped row (FAIL above 1; n/a: does not apply):")
    print(f"{'name':56} {'group':8} " + " ".join(f"{rule:>18}" for rule in RULES))
    for r in results:
        if r.group in ("broken", "shipped"):
            print(f"{r.name:56} {r.group:8} " + " ".join(f"{_cell(r.worst[rule]):>18}" for rule in RULES))
    print(
        "tokamax: does not apply to "
        f"{[r.name for r in results if r.group in ('broken', 'shipped') and not r.applies['tokamax']]}"
    )
    print("\nThe tokamax rule per Tokamax op (variants: applied / all; shipped rows: applied / all):")
    print(f"{'op':36} {'variants':>9} {'kills':>6} {'misses':>7} {'shipped':>8} {'false alarms':>13}")
    for op, row in tokamax_by_op(results).items():
        print(
            f"{op:36} {row['applied']:>4}/{row['variants']:<4} {row['kills']:>6} {row['misses']:>7} "
            f"{row['shipped_applied']:>4}/{row['shipped']:<3} {row['false_alarms']:>13}"
        )
    rows = tokamax_rows(results)
    if not rows:
        return
    print(
        "\nTokamax implementations (interpret: XLA:CPU), worst error / allowed error over the cases "
        "(FAIL above 1; n/a: the rule does not apply):"
    )
    print(f"{'spec':48} {'dtype':9} {'inputs':8} " + " ".join(f"{rule:>14}" for rule in RULES))
    for row in rows:
        print(
            f"{row['spec']:48} {row['dtype']:9} {row['inputs']:8} "
            + " ".join(f"{_cell(row['worst'][rule]):>14}" for rule in RULES)
            + (f"  crashed: {row['crashed']}" if row["crashed"] else "")
        )
    passes = [f"{r['spec']} {r['dtype']} ({r['inputs']})" for r in rows if r["tokamax_passes_what_we_fail"]]
    fails = [f"{r['spec']} {r['dtype']} ({r['inputs']})" for r in rows if r["tokamax_fails_what_we_pass"]]
    print(f"\nTokamax's tolerance passes where our contract or implementation bound fails: {passes}")
    print(f"Tokamax's tolerance fails where our contract and implementation bound pass: {fails}")


def main(argv: list[str] | None = None) -> int:
    """``python -m studies.tolerance_rules [--tests DIR] [--examples N] [--json PATH]``"""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m studies.tolerance_rules", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", default="tests", help="the test directory holding broken/")
    parser.add_argument(
        "--examples", type=int, default=6, help="Hypothesis examples (one case each) per shipped kernel and dtype"
    )
    parser.add_argument("--json", help="also write the results as JSON")
    parser.add_argument(
        "--only", nargs="+", default=(), help="judge only the variants and kernels whose name contains one of these"
    )
    parser.add_argument("--no-tokamax", action="store_true", help="leave Tokamax's implementations out")
    args = parser.parse_args(argv)
    results = run(args.tests, args.examples, tokamax=not args.no_tokamax, only=tuple(args.only))
    print_report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary(results), "results": [vars(r) for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
