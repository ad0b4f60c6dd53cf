"""The Mosaic GPU ring collectives on 2 and 4 GPUs of one host: the multi-device
checks, the broken variants, JAX's collective matmul as an outside client, then the
benchmark against NCCL and JAX's kernel, each in a child process over the first N
GPUs with a timeout (a deadlock comes back as a reported hang).

    python -m studies.gpu_collectives --gpus 2 4 --examples 12 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from pallascheck.properties.device import multidevice

CHECKS = "pallascheck.properties.families.collectives"
TESTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
VARIANTS = "broken.gpu_collectives_variants:VARIANTS"


def _child(target: str, gpus: int, kwargs: dict, timeout_s: float, **extra: Any) -> dict:
    start = time.perf_counter()
    try:
        result = multidevice.run_with_devices(target, gpus, kwargs, platform="gpu", timeout_s=timeout_s, **extra)
        return {"result": result, "seconds": round(time.perf_counter() - start, 1)}
    except multidevice.ChildTimeout as err:
        return {"hang": str(err)[-1500:], "seconds": round(time.perf_counter() - start, 1)}
    except multidevice.ChildFailed as err:
        return {"failed": str(err)[-3000:], "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[2])
    parser.add_argument("--examples", type=int, default=12)
    parser.add_argument("--parts", nargs="+", default=["checks", "variants", "bundled", "bench"])
    parser.add_argument("--out", default="gpu_collectives.json")
    args = parser.parse_args()
    report: dict[str, Any] = {}
    for gpus in args.gpus:
        r = report[str(gpus)] = {}
        if "checks" in args.parts:
            r["checks"] = _child(
                f"{CHECKS}:run_checks", gpus, {"examples": args.examples, "backend": "mosaic_gpu"}, 480
            )
            print(gpus, "checks", json.dumps(r["checks"])[:3000], flush=True)
        if "variants" in args.parts:
            sys.path.insert(0, TESTS_DIR)
            from broken import gpu_collectives_variants as v

            for name in v.VARIANTS:
                timeout = 30 if name in v.DEADLOCKS else 90
                r[name] = _child(
                    f"{CHECKS}:run_variants",
                    gpus,
                    {"variants": VARIANTS, "names": [name], "examples": args.examples, "backend": "mosaic_gpu"},
                    timeout,
                    import_path=TESTS_DIR,
                )
                print(gpus, name, json.dumps(r[name])[:600], flush=True)
        if "bundled" in args.parts:
            r["bundled"] = _child(f"{CHECKS}:run_bundled", gpus, {"examples": args.examples}, 480)
            print(gpus, "bundled", json.dumps(r["bundled"])[:3000], flush=True)
        if "bench" in args.parts:
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, range(gpus))), **multidevice.NO_MULTICAST_ENV)
            start = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "pallascheck.bench.collectives", "--ring"],
                env=env,
                capture_output=True,
                text=True,
                timeout=540,
            )
            r["bench"] = {
                "output": (proc.stdout + proc.stderr)[-6000:],
                "seconds": round(time.perf_counter() - start, 1),
            }
            print(gpus, "bench", r["bench"]["output"], flush=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
