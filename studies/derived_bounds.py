"""Derived bounds against the hand-derived ones, on our own kernels.

For each kernel x dtype, cases of every element kind (strategies.elements) are drawn at
one shape; the bound derived from a jax.numpy reference of the kernel's math
(studies/derived_references.py: f32 compute, the kernel's tiles as blocked loops or
orders, its backward as a custom_vjp where it is its own algorithm) is compared
element by element with the spec's hand-derived implementation bound at the default
config, on the CPU interpreter's arithmetic. Reported: the median ratio derived / hand
over elements and cases (with the 10th and 90th percentiles and the largest), and the
elements where the kernel's own error exceeds the derived bound (false alarms).

    python -m studies.derived_bounds [--seeds N] [--json PATH]
    python -m studies.derived_bounds --families [NAME ...] [--cases N]
    python -m studies.derived_bounds --soundness [NAME ...] [--examples N]
    python -m studies.derived_bounds --kill-rates [MODULE ...] [--examples N]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from pallascheck.kernels.backends import Backend
from pallascheck.oracles import derive
from pallascheck.oracles.tolerance import CPU
from pallascheck.properties import strategies
from pallascheck.properties.registry import get_spec
from pallascheck.properties.spec import Case

EPS = 1e-5


def _glu_case(seed: int, dtype: str, kind: str) -> Case:
    from pallascheck.properties.families.gated_linear_unit import _reduction

    t, d, f = 16, 64, 32
    r = _reduction(kind, d, dtype)
    return Case(
        {
            "x": strategies.elements(seed, (t, d), dtype, kind, reduction=r),
            "weights": strategies.elements(seed + 1, (d, 2, f), dtype, kind, reduction=r),
            "cotangent": strategies.elements(seed + 2, (t, f), dtype, "normal"),
        },
        {"activation": "silu"},
    )


def _ragged_case(seed: int, dtype: str, kind: str) -> Case:
    from pallascheck.properties.families.ragged_dot import group_sizes

    m, k, n, g = 40, 64, 32, 3
    return Case(
        {
            "lhs": strategies.elements(seed, (m, k), dtype, kind, reduction=k),
            "rhs": strategies.elements(seed + 1, (g, k, n), dtype, kind, reduction=k),
            "group_sizes": group_sizes(seed + 2, m, g, "random"),
            "cotangent": strategies.elements(seed + 3, (m, n), dtype, "normal"),
        },
        {},
    )


def _matmul_case(seed: int, dtype: str, kind: str, activation: str) -> Case:
    m, k, n = 16, 64, 32
    return Case(
        {
            "x": strategies.elements(seed, (m, k), dtype, kind, reduction=k),
            "y": strategies.elements(seed + 1, (k, n), dtype, kind, reduction=k),
        },
        {"activation": activation, "out_dtype": dtype},
    )


def _norm_case(seed: int, dtype: str, kind: str, layer: bool) -> Case:
    rows, d = 8, 64
    arrays = {
        "x": strategies.elements(seed, (rows, d), dtype, kind, reduction=d),
        "scale": strategies.elements(seed + 2, (d,), dtype, "normal"),
    }
    if layer:
        arrays["offset"] = strategies.elements(seed + 3, (d,), dtype, "normal")
    return Case(arrays, {"eps": EPS})


# kernel -> (spec name, case maker); the reference and its facts: bench/derived_references
KERNELS: dict[str, tuple[str, Callable[..., Case]]] = {
    "matmul": ("matmul", lambda s, d, k: _matmul_case(s, d, k, "none")),
    "matmul+relu": ("matmul", lambda s, d, k: _matmul_case(s, d, k, "relu")),
    "gated_linear_unit (silu)": ("gated_linear_unit", _glu_case),
    "ragged_dot": ("ragged_dot", _ragged_case),
    "rms_norm": ("rms_norm", lambda s, d, k: _norm_case(s, d, k, False)),
    "layer_norm": ("layer_norm", lambda s, d, k: _norm_case(s, d, k, True)),
}
KINDS = ("normal", "large", "offset_rows", "subnormal", "few_distinct", "positive")


def measure(name: str, dtype: str, seeds: int) -> dict[str, Any]:
    from studies.derived_references import REFERENCES

    spec_name, make_case = KERNELS[name]
    spec = get_spec(spec_name)
    backend = Backend("interpret")
    config = spec.default_config_for(backend)
    ratios, false_alarms, unverifiable, elements = [], 0, 0, 0
    for kind in KINDS:
        for seed in range(seeds):
            case = make_case(seed, dtype, kind)
            ref = spec.oracle(case)
            hand = np.asarray(spec.bound(case, ref, config, CPU), np.float64)
            stated = REFERENCES[spec_name](case, config)
            facts = stated.facts
            d = derive.derive(stated.fn, stated.args, facts=facts, arith=CPU)
            expected = np.asarray(spec.expected(ref), np.float64)
            out = np.asarray(spec.kernel(case, config, backend)).astype(np.float64)
            finite = np.isfinite(expected) & np.isfinite(hand) & np.isfinite(d.bounds[0]) & ~d.unverifiable[0]
            ok = finite & (hand > 0)
            ratios.append((d.bounds[0][ok] / hand[ok]).ravel())
            false_alarms += int(np.sum(finite & (np.abs(out - expected) > d.bounds[0])))
            unverifiable += int(d.unverifiable[0].sum())
            elements += expected.size
    r = np.concatenate(ratios)
    return {
        "kernel": name,
        "dtype": dtype,
        "facts": facts.describe(),
        "elements": elements,
        "median": float(np.median(r)),
        "p10": float(np.percentile(r, 10)),
        "p90": float(np.percentile(r, 90)),
        "max": float(r.max()),
        "false_alarms": false_alarms,
        "unverifiable": unverifiable,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=2, help="cases per element kind")
    parser.add_argument("--json", help="also write the rows as JSON")
    parser.add_argument(
        "--kill-rates",
        nargs="*",
        help="instead: our kernels and the variants of tests/broken (these modules of it; "
        "default all), hand against derived",
    )
    parser.add_argument("--tests", default="tests", help="with --kill-rates: the directory holding broken/")
    parser.add_argument("--examples", type=int, default=8, help="with --kill-rates: Hypothesis examples per dtype")
    parser.add_argument(
        "--families",
        nargs="*",
        help="instead: values and gradients rows of these specs "
        "(bench/derived_references.REFERENCES), --cases drawn cases per dtype",
    )
    parser.add_argument("--cases", type=int, default=6, help="with --families: cases per kernel x dtype")
    parser.add_argument(
        "--soundness",
        nargs="*",
        help="instead: these specs' values, gradients and contract "
        "checks over --examples Hypothesis examples per dtype, judged by derived bounds",
    )
    args = parser.parse_args(argv)
    if args.soundness is not None:
        from studies.derived_references import REFERENCES

        rows = soundness(args.soundness or list(REFERENCES), args.examples)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)
        return 0
    if args.families is not None:
        from studies.derived_references import REFERENCES

        print(
            "| kernel | dtype | part | median derived/hand | p10 | p90 | max | false alarms | unverifiable | elements |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        rows = []
        for name in args.families or list(REFERENCES):
            for dtype in get_spec(name).dtypes:
                for r in measure_family(name, dtype, args.cases):
                    rows.append(r)
                    print(
                        f"| {r['kernel']} | {r['dtype']} | {r['part']} | {r['median']:.2f} | {r['p10']:.2f} | "
                        f"{r['p90']:.2f} | {r['max']:.2f} | {r['false_alarms']} | {r['unverifiable']} | "
                        f"{r['elements']} |",
                        flush=True,
                    )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)
        return 0
    if args.kill_rates is not None:
        rows = kill_rates(args.tests, args.examples, args.kill_rates or VARIANT_MODULES)
        print("| kernel | hand-derived bounds | derived bounds |\n|---|---|---|")
        for r in rows:
            print(f"| {r['variant']} | {r['hand'] or 'pass'} | {r['derived'] or 'pass'} |")
        return 0
    rows = [measure(k, d, args.seeds) for k in KERNELS for d in strategies.DTYPES]
    print(f"jax {jax.__version__}; {len(KINDS)} kinds x {args.seeds} seeds per row\n")
    print("| kernel | dtype | median derived/hand | p10 | p90 | max | false alarms | unverifiable | elements |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kernel']} | {r['dtype']} | {r['median']:.2f} | {r['p10']:.2f} | {r['p90']:.2f} | {r['max']:.2f} | "
            f"{r['false_alarms']} | {r['unverifiable']} | {r['elements']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)
    return 0


# ------------------------------------------------------------ kill rates on tests/broken


VARIANT_MODULES = (
    "matmul_variants",
    "attention_variants",
    "loss_variants",
    "norms_variants",
    "moe_variants",
    "top_k_variants",
)
BOUND_CHECKS = ("values", "gradients", "contract")


def family_of(spec_name: str) -> str:
    """The REFERENCES entry of a variant spec of tests/broken, from its name."""
    base = spec_name.split("[")[0]
    if base.startswith("lce_"):
        return "linear_softmax_cross_entropy"
    if base.startswith("ce_"):
        return "cross_entropy"
    return {"glu": "gated_linear_unit"}.get(base, base)


def kill_rates(tests_dir: str, examples: int, modules: Sequence[str] = VARIANT_MODULES) -> list[dict[str, Any]]:
    """Our kernels and every variant of tests/broken judged by the hand-derived spec
    and by the derived one (bench/derived_references.judged), on the same draws (seed
    0, the variant's dtypes, at most ``examples`` Hypothesis examples each), through
    the checks that use a bound (values, gradients, contract): a failure of a shipped
    kernel is a false alarm, of a variant a kill. The metamorphic relations and the
    determinism checks are left out: they judge by the hand bounds either way."""
    import importlib
    import os
    import sys

    from pallascheck.properties import runner
    from studies.derived_references import REFERENCES, judged

    sys.path.insert(0, os.path.abspath(tests_dir))
    rows = []
    entries = []
    for module in modules:
        variants = importlib.import_module(f"broken.{module}").VARIANTS
        families = sorted({family_of(spec.name) for spec, _, _ in variants.values()})
        entries += [(f"{f} (ours)", get_spec(f), get_spec(f).dtypes, examples) for f in families]
        entries += [(name, spec, dtypes, min(n, examples)) for name, (spec, dtypes, n) in variants.items()]
    for name, spec, dtypes, n in entries:
        row = {"variant": name, "family": family_of(spec.name)}
        for label, judge in (("hand", spec), ("derived", judged(spec, REFERENCES[family_of(spec.name)]))):
            failures = [
                runner.run_property(judge, d, Backend("interpret"), examples=n, seed=0, selected=BOUND_CHECKS).failure
                for d in dtypes
            ]
            failed = next((f for f in failures if f), "")
            if failed.startswith("[crash]"):  # the judge broke, not the kernel caught
                raise RuntimeError(f"{name} ({label}): {failed}")
            row[label] = failed.splitlines()[0][:120] if failed else ""
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    return rows


# ------------------------------------------------------------ every family: values and gradients


def drawn_cases(spec: Any, dtype: str, count: int) -> list[Case]:
    """``count`` cases of the spec's own strategy, derandomized (the same every run)."""
    from hypothesis import HealthCheck, given, settings

    cases: list[Case] = []

    @settings(
        max_examples=count, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(spec.cases(dtype, Backend("interpret")))
    def collect(case: Case) -> None:
        cases.append(case)

    collect()
    return cases[:count]


def _compare(out: Any, expected: Any, hand: Any, derived: Any) -> dict[str, Any]:
    out, expected, hand, derived = (
        np.asarray(a, np.float64).reshape(np.shape(expected)) for a in (out, expected, hand, derived)
    )
    finite = np.isfinite(expected)
    checked = finite & ~np.isnan(derived)
    both = checked & np.isfinite(hand) & np.isfinite(derived) & (hand > 0)
    with np.errstate(invalid="ignore"):
        alarm = checked & (np.abs(out - expected) > derived)
    return {
        "ratios": (derived[both] / hand[both]).ravel(),
        "false_alarms": int(alarm.sum()),
        "unverifiable": int((finite & np.isnan(derived)).sum()),
        "elements": int(expected.size),
    }


def measure_family(name: str, dtype: str, count: int) -> list[dict[str, Any]]:
    """Rows "values" and "gradients" of one kernel x dtype over ``count`` drawn cases,
    at the default config: derived (bench/derived_references) / hand-derived bound."""
    from studies.derived_references import REFERENCES, judged

    spec = get_spec(name)
    derived_spec = judged(spec, REFERENCES[name])
    backend = Backend("interpret")
    rows = {
        part: {"ratios": [], "false_alarms": 0, "unverifiable": 0, "elements": 0, "gap": 0.0}
        for part in ("values", "gradients")
    }

    def add(part: str, stats: dict[str, Any]) -> None:
        row = rows[part]
        row["ratios"].append(stats["ratios"])
        for key in ("false_alarms", "unverifiable", "elements"):
            row[key] += stats[key]

    for case in drawn_cases(spec, dtype, count):
        config = spec.default_config_for(backend)
        ref = spec.oracle(case)
        expected = spec.expected(ref)
        out = spec.kernel(case, config, backend)
        out = out[0] if isinstance(out, tuple) else out
        add(
            "values",
            _compare(out, expected, spec.bound(case, ref, config, CPU), derived_spec.bound(case, ref, config, CPU)),
        )
        if spec.gradients is None:
            continue
        exact = spec.gradients.oracle_vjp(case, ref)
        grads = spec.gradients.kernel_vjp(case, config, backend)
        hand = spec.gradients.bound(case, ref, exact, config, CPU)
        derived = derived_spec.gradients.bound(case, ref, exact, config, CPU)
        for g in hand:
            if grads.get(g) is not None:
                add("gradients", _compare(grads[g], exact[g], hand[g], derived[g]))
    out_rows = []
    for part, row in rows.items():
        if not row["elements"]:
            continue
        r = np.concatenate(row["ratios"]) if row["ratios"] else np.zeros(0)
        stats = (
            {
                "median": float(np.median(r)),
                "p10": float(np.percentile(r, 10)),
                "p90": float(np.percentile(r, 90)),
                "max": float(r.max()),
            }
            if r.size
            else dict.fromkeys(("median", "p10", "p90", "max"), float("nan"))
        )
        out_rows.append(
            {
                "kernel": name,
                "dtype": dtype,
                "part": part,
                "cases": count,
                **stats,
                **{k: row[k] for k in ("false_alarms", "unverifiable", "elements")},
            }
        )
    return out_rows


def soundness(names: list[str], examples: int) -> list[dict[str, Any]]:
    """``verify --examples N``'s draws (seed 0) of each kernel x dtype, its values,
    gradients and contract checks judged by the derived bounds: a failure is a false alarm."""
    from pallascheck.properties import runner
    from studies.derived_references import REFERENCES, judged

    rows = []
    for name in names:
        spec = judged(get_spec(name), REFERENCES[name])
        for dtype in spec.dtypes:
            tally = runner.run_property(
                spec,
                dtype,
                Backend("interpret"),
                examples=examples,
                seed=0,
                selected=("values", "gradients", "contract"),
            )
            checked = {c: o.examples for c, o in tally.outcomes.items()}
            budget = {c: round(o.budget_used, 3) for c, o in tally.outcomes.items()}
            rows.append(
                {
                    "kernel": name,
                    "dtype": dtype,
                    "examples": examples,
                    "cases": checked,
                    "budget": budget,
                    "failure": tally.failure.splitlines()[0] if tally.failure else "",
                }
            )
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
