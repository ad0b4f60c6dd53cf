"""``pallascheck bench --tolerance-rules``: what four ways of judging a kernel's numbers
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
  (``JaxTestCase.assertAllClose``; read from JAX, ``compat.jax_test_tolerance``).

Inputs: the broken variants under tests/broken (each with its own dtypes, example
count and input regime, as in the sensitivity suite, on the backend its kernels run
on) and the shipped kernels of the registry (every dtype, ``examples`` cases each),
drawn by Hypothesis with a fixed seed, each with a config of its space (drawn as the
suite draws them). A variant is
killed by a rule when some case fails it; a shipped kernel x dtype that fails a rule
is a false alarm. Only values and gradients are judged here: the suite's other checks
(determinism, configs agreeing, relations, the interpreters' race detectors) catch
variants that no tolerance can, and those count as misses under all four rules.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any, Mapping

import numpy as np
from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
from hypothesis import strategies as st

from pallascheck.kernels import compat
from pallascheck.kernels.backends import GENERIC, Backend
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import checks
from pallascheck.properties.spec import Case, KernelSpec, registry

RULES = ("contract", "implementation", "torch", "jax")
TORCH_RTOL_ATOL = {"float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5), "float32": (1.3e-6, 1e-5),
                   "float64": (1e-7, 1e-7)}


def _table_bound(expected: np.ndarray, dtype: Any, rule: str) -> np.ndarray:
    name = np.dtype(dtype).name
    if rule == "torch":
        rtol, atol = TORCH_RTOL_ATOL[name]
    else:
        rtol = atol = compat.jax_test_tolerance(dtype)
    with np.errstate(invalid="ignore"):
        return atol + rtol * np.abs(np.asarray(expected, np.float64))


class KernelCrashed(RuntimeError):
    """The kernel under judgement raised (every rule sees that)."""


def _kernel_run(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as crash:  # noqa: BLE001 - the kernel's exception is the finding
        raise KernelCrashed(f"{type(crash).__name__}: {crash}"[:300]) from crash


def judge_case(spec: KernelSpec, case: Case, config: Any, backend: Backend) -> dict[str, bool]:
    """Whether each rule passes the kernel's output and gradients on ``case``."""
    arith = arithmetic_for(backend.name)
    ref = spec.oracle(case)
    pairs = [(np.asarray(_kernel_run(spec.kernel, case, config, backend)), np.asarray(spec.expected(ref)),
              spec.bound(case, ref, config, arith),
              spec.contract(case, ref, arith) if spec.contract else None)]
    g = spec.gradients
    if g is not None:
        exact = g.oracle_vjp(case, ref)
        got = {k: np.asarray(v) for k, v in _kernel_run(g.kernel_vjp, case, config, backend).items()}
        bounds = g.bound(case, ref, exact, config, arith)
        contracts = g.contract(case, ref, exact, arith) if g.contract else {}
        pairs += [(got[k], exact[k], bounds[k], contracts.get(k)) for k in sorted(got)]
    verdict = {}
    for rule in RULES:
        verdict[rule] = True
        for actual, expected, impl, contract in pairs:
            if rule == "implementation" or (rule == "contract" and contract is None):
                bound = impl
            elif rule == "contract":
                bound = contract
            else:
                bound = _table_bound(expected, actual.dtype, rule)
            verdict[rule] &= checks.compare(actual, expected, bound).passed
    return verdict


class _AllCaught(Exception):
    """Every rule has already failed a case: more cases cannot change the result."""


@dataclasses.dataclass
class Result:
    name: str
    broken: bool
    caught: dict[str, bool]  # rule -> some case failed it
    crashed: str = ""


def judge(name: str, spec: KernelSpec, dtypes: tuple[str, ...], backend: Backend, examples: int, seed: int,
          broken: bool) -> Result:
    """Draw ``examples`` cases per dtype and record which rules any case fails."""
    caught = dict.fromkeys(RULES, False)
    for dtype in dtypes:
        @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), print_blob=False)
        @hypothesis_seed(seed)
        @given(spec.cases(dtype, backend), st.integers(0, 2**16))
        def run(case: Case, index: int) -> None:
            space = list(spec.configs(case, backend))  # a config of the case's space, as the suite draws it
            for rule, passed in judge_case(spec, case, space[index % len(space)], backend).items():
                caught[rule] |= not passed
            if all(caught.values()):
                raise _AllCaught

        try:
            run()
        except _AllCaught:
            break
        except KernelCrashed as crash:
            return Result(name, broken, dict.fromkeys(RULES, True), str(crash))
    return Result(name, broken, caught)


def _variants(tests_dir: str) -> list[tuple[str, KernelSpec, tuple[str, ...], int, Backend]]:
    sys.path.insert(0, os.path.abspath(tests_dir))
    broken = importlib.import_module("broken")
    out = []
    for module_name in broken.MODULES:
        module = importlib.import_module(f"broken.{module_name}")
        backend = Backend("mosaic_gpu_interpret" if getattr(module, "BACKENDS", GENERIC) != GENERIC else "interpret")
        for name, (spec, dtypes, examples) in module.VARIANTS.items():
            if backend.name not in getattr(module, "NOT_ON", {}).get(name, {}):
                out.append((f"{module_name}/{name}", spec, tuple(dtypes), examples, backend))
    return out


def run(tests_dir: str, examples: int, seed: int = 0) -> list[Result]:
    results = []
    for name, spec, dtypes, count, backend in _variants(tests_dir):
        results.append(judge(name, spec, dtypes, backend, count, seed, broken=True))
        print(f"  {name}: {results[-1].caught}", file=sys.stderr, flush=True)
    for name, spec in registry().items():
        for backend in (Backend("interpret"), Backend("mosaic_gpu_interpret")):
            if spec.runs_on(backend):
                dtypes = tuple(spec.dtypes_for(backend))
                results.append(judge(f"{name} ({backend})", spec, dtypes, backend, examples, seed, broken=False))
                print(f"  {results[-1].name}: {results[-1].caught}", file=sys.stderr, flush=True)
    return results


def summary(results: list[Result]) -> dict[str, Mapping[str, int]]:
    """Per rule: kills and misses over the broken variants, false alarms over the
    shipped kernels."""
    broken = [r for r in results if r.broken]
    shipped = [r for r in results if not r.broken]
    return {rule: {"kills": sum(r.caught[rule] for r in broken), "misses": sum(not r.caught[rule] for r in broken),
                   "false_alarms": sum(r.caught[rule] for r in shipped), "variants": len(broken),
                   "shipped": len(shipped)} for rule in RULES}


def print_report(results: list[Result]) -> None:
    table = summary(results)
    print(f"{'rule':16} {'kills':>6} {'misses':>7} {'false alarms':>13}")
    for rule, row in table.items():
        print(f"{rule:16} {row['kills']:>6} {row['misses']:>7} {row['false_alarms']:>13}")
    first = next(iter(table.values()))
    print(f"({first['variants']} broken variants, {first['shipped']} shipped kernel x backend rows)")
    for r in results:
        if r.crashed:
            print(f"  crashed (counted as caught by every rule): {r.name}: {r.crashed}")
    for rule in RULES:
        missed = [r.name for r in results if r.broken and not r.caught[rule]]
        alarms = [r.name for r in results if not r.broken and r.caught[rule]]
        print(f"\n{rule}: missed {missed}\n{rule}: false alarms {alarms}")
