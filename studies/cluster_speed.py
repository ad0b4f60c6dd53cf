"""A campaign's cases/s on a Ray cluster of three nodes on this machine against the same
campaign with the local worker processes (docs/cluster.md, docs/results.md).

Both run the same untargeted campaign (``--random``: the pairs in turn, so the work
per task is alike) for the same seconds from a cold start: the workers' start, their
imports and first compiles count in both, each with a compilation cache of its own,
empty (a cache the first run filled made the second 2.5 times as fast). Local: ``--jobs`` the cores (plan.default_jobs), and as many jobs as the cluster has
workers (the same processes competing for the cores).
Cluster: ``ray.cluster_utils.Cluster`` with three nodes of ``--cpus-per-node`` CPUs, one
worker per CPU (plan.cluster_slots), so the cluster's workers and Ray's own daemons
share this machine's cores with each other as the local ones do not.

    python -m studies.cluster_speed [--seconds S] [--kernel K ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import jax
import ray
from ray.cluster_utils import Cluster

from pallascheck.fuzz import campaign, cluster, plan
from pallascheck.kernels.backends import Backend
from pallascheck.properties.device import compilation


def _campaign(kernels: list[str], seconds: float, jobs: int, joined: cluster.Cluster | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as corpus:
        result = campaign.run(
            kernels,
            Backend("interpret"),
            corpus,
            seconds=seconds,
            examples=4,
            jobs=jobs,
            targeted=False,
            dtypes=["float32"],
            cluster=joined,
        )
    return {
        "jobs": jobs,
        "tasks": result.tasks,
        "cases": result.cases,
        "seconds": round(result.seconds, 1),
        "cases_per_s": round(result.cases / result.seconds, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0, help="each campaign's time")
    parser.add_argument("--kernel", action="append", help="default: rms_norm, layer_norm, cross_entropy")
    parser.add_argument("--cpus-per-node", type=int, default=1)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    kernels = args.kernel or ["rms_norm", "layer_norm", "cross_entropy"]
    backend = Backend("interpret")
    caches = tempfile.mkdtemp(prefix="cluster-speed-")
    # workers inherit it: the local ones from this process, the cluster's from its nodes, started below
    local = {}
    # the local default (every core), and as many local workers as the cluster has
    for jobs in sorted({plan.default_jobs("fuzz", backend), 3 * args.cpus_per_node}):
        os.environ[compilation.CACHE_ENV_VAR] = os.path.join(caches, f"local-{jobs}")
        local[jobs] = _campaign(kernels, args.seconds, jobs, None)
        print(f"local workers: {local[jobs]}", flush=True)
    os.environ[compilation.CACHE_ENV_VAR] = os.path.join(caches, "cluster")
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": args.cpus_per_node, "include_dashboard": False})
    for _ in range(2):
        nodes.add_node(num_cpus=args.cpus_per_node)
    nodes.wait_for_nodes()
    try:
        joined = cluster.connect(nodes.address, backend)
        on_cluster = _campaign(kernels, args.seconds, joined.slots, joined)
    finally:
        cluster.disconnect()
        nodes.shutdown()
        shutil.rmtree(caches)
    print(f"3-node Ray cluster: {on_cluster}")
    ratio = {jobs: on_cluster["cases_per_s"] / figures["cases_per_s"] for jobs, figures in local.items()}
    for jobs, r in ratio.items():
        print(f"cluster / local ({jobs} jobs) cases/s: {r:.2f}")
    print(f"cores {plan.cores()}, jax {jax.__version__}, ray {ray.__version__}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "local": local,
                    "cluster": on_cluster,
                    "ratio": ratio,
                    "cores": plan.cores(),
                    "jax": jax.__version__,
                    "ray": ray.__version__,
                    "kernels": kernels,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
