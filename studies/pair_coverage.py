"""``python -m studies.pair_coverage``: the pairs of each spec's declared parameters
that verify's default draws meet, without and with the draws for the pairs they miss.

Draws only: the runner's ``check_case`` is replaced by a recorder, so no kernel runs.
"Before" is the budgeted draws and the code-path draws (the spec with no declared
parameters, its cases then scored against the declaration); "after" adds the examples
drawn for pairs. The extra cases and the drawing time of each are printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from pallascheck.kernels.backends import Backend
from pallascheck.properties import pairs, runner
from pallascheck.properties.registry import get_spec

KERNELS = ("attention", "matmul", "ragged_dot", "gated_linear_unit", "fp8_matmul")


def measure(name: str, backend: Backend, examples: int) -> list[dict[str, Any]]:
    """Per dtype: pairs declared, met before and after, cases and drawing seconds of each."""
    spec = get_spec(name)
    parameters = spec.parameters_for(backend)
    declared = {pairs.label(p) for p in pairs.declared(parameters)}
    rows = []
    for dtype in spec.dtypes_for(backend):
        result: dict[str, Any] = {"kernel": name, "backend": str(backend), "dtype": dtype, "pairs": len(declared)}
        for phase, run_spec in (("before", dataclasses.replace(spec, parameters=())), ("after", spec)):
            checked: list[tuple[Any, Any]] = []

            def record(spec_, case, config, backend_, *, context, selected, tally=None, checked=checked):
                checked.append((case, config))
                return tally or runner.Tally()

            original, runner.check_case = runner.check_case, record
            try:
                start = time.perf_counter()
                runner.run_property(run_spec, dtype, backend, examples=examples, seed=0, cover_pairs=True)
                seconds = time.perf_counter() - start
            finally:
                runner.check_case = original
            met = {pairs.label(p) for case, config in checked for p in pairs.met(parameters, case, config)}
            result[phase] = {"met": len(met & declared), "cases": len(checked), "seconds": round(seconds, 2)}
            if phase == "after":
                result["not_met"] = sorted(declared - met)
        rows.append(result)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", help="default: interpret and mosaic_gpu_interpret")
    parser.add_argument("--examples", type=int, default=runner.EXAMPLES)
    parser.add_argument("--json", help="also write the rows as JSON to this path")
    args = parser.parse_args()
    rows = []
    for backend_name in args.backend or ("interpret", "mosaic_gpu_interpret"):
        backend = Backend(backend_name)
        for name in KERNELS:
            if get_spec(name).runs_on(backend):
                for row in measure(name, backend, args.examples):
                    rows.append(row)
                    b, a = row["before"], row["after"]
                    print(
                        f"{row['kernel']:18} {row['backend']:21} {row['dtype']:14} pairs {b['met']}/{row['pairs']} -> "
                        f"{a['met']}/{row['pairs']}; cases {b['cases']} -> {a['cases']}; "
                        f"drawing {b['seconds']} s -> {a['seconds']} s; not met: {row['not_met']}",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
