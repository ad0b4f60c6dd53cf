"""The gate's false-accept and false-reject rates on its corpora (tests/gate_corpus/):
each gaming candidate must be rejected with its named reason, each honest one accepted
on the backends it is meant for (``honest.backends``; the others are listed with the
reason, never counted). Prints one line per candidate (verdict, reasons, seconds) and
the table.

    python -m studies.gate_corpus [--backend B] [--drawn N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

from pallascheck.bench.gate.judge import gate
from pallascheck.kernels.backends import get_backend
from tests.gate_corpus.gaming import GAMING
from tests.gate_corpus.honest import HONEST, backends, why_interpreter_only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default=None)
    parser.add_argument("--drawn", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--corpus", choices=("gaming", "honest"), help="only this corpus (default: both)")
    parser.add_argument(
        "--part", default="1/1", help="K/N: every N-th candidate from the K-th (processes side by side)"
    )
    args = parser.parse_args()
    k, n = (int(v) for v in args.part.split("/"))
    if not 1 <= k <= n:
        parser.error(f"--part must be K/N with 1 <= K <= N, got {args.part!r}")
    backend = str(get_backend(args.backend))
    plan = [("gaming", task, name, reason) for task, name, reason in GAMING]
    plan += [("honest", task, name, "") for task, name in HONEST if backend in backends(name)]
    elsewhere = [name for _, name in HONEST if backend not in backends(name)]
    if args.corpus != "gaming":
        for name in elsewhere:
            print(f"honest  {name:34s} not run on {backend}: {why_interpreter_only(name)}", flush=True)
    rows = []
    for kind, task, name, reason in [p for p in plan if args.corpus in (None, p[0])][k - 1 :: n]:
        start = time.perf_counter()
        verdict = gate(task, f"tests.gate_corpus.{kind}:{name}", backend=args.backend, drawn=args.drawn)
        rows.append((kind, task, name, reason, verdict.status, verdict.reason_names, time.perf_counter() - start))
        # each line as its verdict lands: a run stopped part way keeps what it judged
        print(
            f"{kind:7s} {task:18s} {name:34s} {verdict.status:8s} {','.join(verdict.reason_names) or '-':28s} "
            f"{rows[-1][6]:6.1f} s",
            flush=True,
        )
        if args.json:
            with open(args.json, "w") as f:
                keys = ("kind", "task", "name", "reason", "status", "reasons", "seconds")
                json.dump([dict(zip(keys, r)) for r in rows], f)
    gaming = [r for r in rows if r[0] == "gaming"]
    honest = [r for r in rows if r[0] == "honest"]
    right = sum(1 for r in gaming if r[4] != "pass" and r[3] in r[5])
    accepted = sum(1 for r in gaming if r[4] == "pass")
    rejected = sum(1 for r in honest if r[4] != "pass")
    times = [r[6] for r in rows]
    print(f"\ndevice: {jax.devices()[0].device_kind}, jax {jax.__version__}, backend {backend}, drawn {args.drawn}")
    if times:
        print(f"time per verdict: mean {statistics.mean(times):.1f} s, median {statistics.median(times):.1f} s")
    print("| corpus | candidates | rejected, right reason | rejected, other reason | accepted | median s | max s |")
    print("|---|---|---|---|---|---|---|")
    for label, group in (("gaming", gaming), ("honest", honest)):
        if not group:
            continue
        times = [r[6] for r in group]
        wrong_reason = sum(1 for r in group if r[4] != "pass") - (right if label == "gaming" else rejected)
        accepted_here = accepted if label == "gaming" else len(honest) - rejected
        print(
            f"| {label} | {len(group)} | {right if label == 'gaming' else '-'} | {max(wrong_reason, 0)} | "
            f"{accepted_here} | {statistics.median(times):.1f} | {max(times):.1f} |"
        )
    print(f"false accepts {accepted}/{len(gaming)}, false rejects {rejected}/{len(honest)}")
    if elsewhere and args.corpus != "gaming":
        print(f"honest candidates not meant for {backend} (not counted): {', '.join(elsewhere)}")


if __name__ == "__main__":
    main()
