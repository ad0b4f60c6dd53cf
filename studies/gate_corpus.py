"""The gate's false-accept and false-reject rates on its corpora (tests/gate_corpus/):
each gaming candidate must be rejected with its named reason, each honest one accepted
on the backends it is meant for (``honest.backends``; the others are listed with the
reason, never counted). Prints one line per candidate (verdict, reasons, seconds) and
the table.

    python -m studies.gate_corpus [--backend B] [--drawn N] [--json PATH] [--warm]

``--warm`` judges each candidate a second time in the same process and reports that
verdict's time too (what a search loop calling the gate again pays: compiled programs
reused); the verdicts counted are the first ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax

from pallascheck.bench.gate.judge import gate
from pallascheck.kernels.backends import ENV_VAR, get_backend
from pallascheck.properties.device import compilation
from tests.gate_corpus.gaming import GAMING, GAMING_ONLY_ON, gaming_here
from tests.gate_corpus.honest import (
    EXPECTED_FINDINGS,
    HONEST,
    backends,
    dtypes_on,
    finding_seen,
    why_not_meant,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--drawn", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--only", action="append", help="only this candidate (repeatable)")
    parser.add_argument("--warm", action="store_true", help="judge each candidate again and time it warm")
    parser.add_argument("--corpus", choices=("gaming", "honest"), help="only this corpus (default: both)")
    parser.add_argument(
        "--part", default="1/1", help="K/N: every N-th candidate from the K-th (processes side by side)"
    )
    args = parser.parse_args()
    k, n = (int(v) for v in args.part.split("/"))
    if not 1 <= k <= n:
        parser.error(f"--part must be K/N with 1 <= K <= N, got {args.part!r}")
    # before JAX starts, as `pallascheck gate` sets up: the compilation cache and XLA's
    # flags for the backend (on the CPU its quick compiles: most of a cold verdict is
    # compiling the derivation's float64 operations), and the CPU rounding bf16
    # intermediates as the candidates write them
    compilation.configure(get_backend(args.backend))
    compilation.add_xla_flags(compilation.AS_WRITTEN_CPU_FLAGS)
    resolved = get_backend(args.backend)
    backend = str(resolved)
    # our kernels among the candidates pick their lowering from the environment: the
    # corpus's backend
    os.environ[ENV_VAR] = backend
    meant = [(t, n) for t, n in HONEST if backend in backends(n)]
    plan = [("gaming", task, name, (reason,)) for task, name, reason in GAMING if gaming_here(name, resolved.platform)]
    if args.corpus != "honest":
        for _, name, _ in GAMING:
            if not gaming_here(name, resolved.platform):
                print(f"gaming  {name:34s} not run on {backend}: {GAMING_ONLY_ON[name][1]}", flush=True)
    # outside findings where this run sees them (its intermediates are rounded as written):
    # right when rejected for the reasons expected
    seen = {n for _, n in meant if finding_seen(n, backend, as_written=True)}
    plan += [("honest", t, n, ()) for t, n in meant if n not in seen]
    plan += [("finding", t, n, EXPECTED_FINDINGS[n][0]) for t, n in meant if n in seen]
    elsewhere = [name for _, name in HONEST if backend not in backends(name)]
    if args.corpus != "gaming":
        for name in elsewhere:
            print(f"honest  {name:34s} not run on {backend}: {why_not_meant(name, backend)}", flush=True)
    rows = []
    chosen = [p for p in plan if args.corpus in (None, "honest" if p[0] == "finding" else p[0])]
    chosen = [p for p in chosen if not args.only or p[2] in args.only]
    for kind, task, name, expected in chosen[k - 1 :: n]:
        module = "gaming" if kind == "gaming" else "honest"
        start = time.perf_counter()
        source = f"tests.gate_corpus.{module}:{name}"
        only = dtypes_on(name, backend)
        verdict = gate(task, source, backend=args.backend, drawn=args.drawn, dtypes=only)
        seconds = time.perf_counter() - start
        warm = None
        if args.warm:
            start = time.perf_counter()
            gate(task, source, backend=args.backend, drawn=args.drawn, dtypes=only)
            warm = time.perf_counter() - start
        rows.append((kind, task, name, expected, verdict.status, verdict.reason_names, seconds, warm))
        # each line as its verdict lands: a run stopped part way keeps what it judged
        print(
            f"{kind:7s} {task:18s} {name:34s} {verdict.status:8s} {','.join(verdict.reason_names) or '-':28s} "
            f"{seconds:6.1f} s" + ("" if warm is None else f"  warm {warm:6.1f} s"),
            flush=True,
        )
        if args.json:
            with open(args.json, "w") as f:
                keys = ("kind", "task", "name", "expected", "status", "reasons", "seconds", "warm_seconds")
                json.dump([dict(zip(keys, r)) for r in rows], f)
    times = [r[6] for r in rows]
    warm_times = [r[7] for r in rows if r[7] is not None]
    print(f"\ndevice: {jax.devices()[0].device_kind}, jax {jax.__version__}, backend {backend}, drawn {args.drawn}")
    if times:
        print(f"time per verdict: mean {statistics.mean(times):.1f} s, median {statistics.median(times):.1f} s")
    if warm_times:
        print(
            f"time per verdict, warm: mean {statistics.mean(warm_times):.1f} s, median "
            f"{statistics.median(warm_times):.1f} s, max {max(warm_times):.1f} s"
        )
    print("| corpus | candidates | rejected, right reason | rejected, other reason | accepted | median s | max s |")
    print("|---|---|---|---|---|---|---|")
    counts = {}
    for label in ("gaming", "honest", "finding"):
        group = [r for r in rows if r[0] == label]
        if not group:
            continue
        rejected = [r for r in group if r[4] != "pass"]
        right = [r for r in rejected if label != "honest" and _right_reasons(label, r[3], r[5])]
        counts[label] = (len(group), len(right), len(rejected) - len(right), len(group) - len(rejected))
        took = [r[6] for r in group]
        print(
            f"| {label} | {len(group)} | {len(right) if label != 'honest' else '-'} | {len(rejected) - len(right)} | "
            f"{len(group) - len(rejected)} | {statistics.median(took):.1f} | {max(took):.1f} |"
        )
    gaming, honest = counts.get("gaming", (0, 0, 0, 0)), counts.get("honest", (0, 0, 0, 0))
    print(f"false accepts {gaming[3]}/{gaming[0]}, false rejects {honest[2]}/{honest[0]}")
    if "finding" in counts:
        print(f"outside kernels' expected findings made: {counts['finding'][1]}/{counts['finding'][0]}")
    if elsewhere and args.corpus != "gaming":
        print(f"honest candidates not meant for {backend} (not counted): {', '.join(elsewhere)}")


def _right_reasons(kind: str, expected: tuple[str, ...], reasons: list[str]) -> bool:
    """A gaming candidate must get its own reason; a finding only the reasons expected."""
    return expected[0] in reasons if kind == "gaming" else bool(reasons) and set(reasons) <= set(expected)


if __name__ == "__main__":
    main()
