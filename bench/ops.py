"""``pallascheck bench``: kernel speed against xla_reference in the same dtype.

Times are medians over repeated calls of jitted functions after a warm-up, with
``block_until_ready``; each kernel is timed with its default config and with the
fastest config of its autotuning space.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallascheck.bench.attention import bench_attention
from pallascheck.bench.collectives import bench_collectives
from pallascheck.bench.losses import bench as bench_losses
from pallascheck.bench.moe import run as bench_moe
from pallascheck.bench.timing import (
    best_config,
    fastest,
    interleaved_medians,
    median_seconds,
    print_row,
)
from pallascheck.bench.top_k import bench_top_k
from pallascheck.kernels import matmul, mosaic_gpu_matmul, norms
from pallascheck.kernels.backends import Backend, NotOnBackend

MATMUL_SIZES = ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 2048, 8192), (2048, 8192, 2048), (8192, 8192, 8192))
NORM_SHAPES = ((8192, 1024), (8192, 4096), (32768, 2048))
DTYPES = ("bfloat16", "float32")
MATMUL_ROUNDS, MATMUL_BURST = 20, 10


def bench_matmul(backend: Backend, dtype: str) -> list[dict]:
    """Our best config, our default and XLA (and on Mosaic GPU JAX's bundled Hopper
    matmul, its best config) timed together in shuffled rounds of MATMUL_BURST
    back-to-back calls: sub-millisecond shapes are compared by the device's time per
    call, not by one call's launch and synchronisation latency."""
    rows = []
    for m, k, n in MATMUL_SIZES:
        kx, ky = jax.random.split(jax.random.key(0))
        x = jax.random.normal(kx, (m, k), dtype)
        y = jax.random.normal(ky, (k, n), dtype)
        ref = jax.jit(matmul.xla_reference)

        # jitted as the reference is: the kernel's Python dispatch (validation, padding,
        # config resolution) is not what is compared
        @functools.cache  # one compile per config: the search's executable is the one timed
        def jitted(config: matmul.Config | mosaic_gpu_matmul.Config | None = None) -> Callable[[], jax.Array]:
            fn = jax.jit(lambda a, b: matmul.matmul(a, b, config=config, backend=backend))
            return lambda: fn(x, y)

        # the search times like the comparison (bursts, shuffled rounds): single calls
        # picked configs 5% slower at 4096^3 on the H200
        space = matmul.configs(m, n, k, backend, itemsize=x.dtype.itemsize)
        best = fastest(jitted, space, MATMUL_ROUNDS // 2, burst=MATMUL_BURST)
        row: dict[str, Any] = {"op": "matmul", "shape": f"{m}x{k}x{n}", "dtype": dtype}
        if best is None:
            rows.append({**row, "error": "no config of the space ran"})
            continue
        cfg = best[1]
        row["best_config"] = str(cfg)
        thunks = {"kernel_best": jitted(cfg), "kernel_default": jitted(), "xla": lambda: ref(x, y)}
        if backend.is_mosaic_gpu:
            bundled = _bundled_hopper_matmul(x, y)
            if bundled is None:
                row["bundled_mgpu_error"] = "no config of the bundled hopper_matmul_mgpu ran"
            else:
                thunks["bundled_mgpu"] = bundled
        t, errors = interleaved_medians(thunks, MATMUL_ROUNDS, burst=MATMUL_BURST)
        flops = 2.0 * m * n * k
        row.update({f"{name}_ms": seconds * 1e3 for name, seconds in t.items()})
        row.update({f"{name}_tflops": flops / seconds / 1e12 for name, seconds in t.items()})
        row.update({f"{name}_error": err for name, err in errors.items()})
        for name in ("xla", "bundled_mgpu"):
            if name in t and "kernel_best" in t:
                row[f"speed_vs_{name}"] = t[name] / t["kernel_best"]
        rows.append(row)
    return rows


def _bundled_hopper_matmul(x: jax.Array, y: jax.Array) -> Callable[[], jax.Array] | None:
    """JAX's bundled Mosaic GPU matmul (ops/gpu/hopper_matmul_mgpu) with the fastest of
    a few of its tile configs (searched as ours is); a config that does not fit or
    compile is skipped; None when none ran."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as bundled

    @functools.cache
    def jitted(tiles: tuple[int, int, int]) -> Callable[[], jax.Array]:
        tm, tn, steps = tiles
        config = bundled.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=steps)
        fn = jax.jit(lambda a, b: bundled.matmul(a, b, None, config=config))
        return lambda: fn(x, y)

    best = fastest(jitted, [(128, 128, 4), (128, 256, 4), (256, 128, 4)], MATMUL_ROUNDS // 2, burst=MATMUL_BURST)
    return None if best is None else jitted(best[1])


def bench_norms(backend: Backend, dtype: str) -> list[dict]:
    rows = []
    for kind in norms.KINDS:
        kernel, reference = getattr(norms, kind), getattr(norms, f"xla_reference_{kind}")
        for r, d in NORM_SHAPES:
            x = jax.random.normal(jax.random.key(1), (r, d), dtype)
            scale = jnp.ones((d,), dtype)
            g = jax.random.normal(jax.random.key(2), (r, d), dtype)

            def fwd_bwd(fn):
                return jax.jit(lambda x, s: jax.vjp(lambda a, b: fn(a, b), x, s)[1](g))

            ref_f, ref_fb = jax.jit(lambda x, s: reference(x, s)), fwd_bwd(reference)
            t_ref, t_ref_fb = median_seconds(lambda: ref_f(x, scale)), median_seconds(lambda: ref_fb(x, scale))
            t_best, cfg = best_config(
                lambda c: lambda: kernel(x, scale, config=c, backend=backend), norms.configs(r, d, backend)
            )
            k_fb = fwd_bwd(lambda a, b: kernel(a, b, config=cfg, backend=backend))
            t_fb = median_seconds(lambda: k_fb(x, scale))
            bytes_fwd = 2 * x.size * x.dtype.itemsize
            rows.append(
                {
                    "op": kind,
                    "shape": f"{r}x{d}",
                    "dtype": dtype,
                    "xla_ms": t_ref * 1e3,
                    "kernel_best_ms": t_best * 1e3,
                    "best_config": str(cfg),
                    "kernel_GBps": bytes_fwd / t_best / 1e9,
                    "speed_vs_xla": t_ref / t_best,
                    "xla_fwd_bwd_ms": t_ref_fb * 1e3,
                    "kernel_fwd_bwd_ms": t_fb * 1e3,
                    "fwd_bwd_speed_vs_xla": t_ref_fb / t_fb,
                }
            )
    return rows


def _per_dtype(bench: Callable[[Backend, str], list[dict]]) -> Callable[[Backend], list[dict]]:
    """Every dtype of DTYPES the backend's kernels take (Mosaic GPU: bf16 only here)."""
    return lambda backend: [
        row for dtype in DTYPES if not (backend.is_mosaic_gpu and dtype == "float32") for row in bench(backend, dtype)
    ]


# op family -> benchmark(backend) -> rows; every row has "op", "shape", "dtype" and
# ratios named "*speed_vs_*" (above 1: the kernel is faster).
BENCHES: dict[str, Callable[[Backend], list[dict]]] = {
    "matmul": _per_dtype(bench_matmul),
    "norms": _per_dtype(bench_norms),
    "attention": bench_attention,
    "losses": bench_losses,
    "moe": bench_moe,
    "top_k": bench_top_k,
    "collectives": bench_collectives,
}


def run(backend: Backend, ops: list[str] | None = None) -> list[dict]:
    """Run the benchmarks of ``ops`` (default: all of BENCHES), printing each row."""
    unknown = sorted(set(ops or ()) - set(BENCHES))
    if unknown:
        raise ValueError(f"--op must be among {sorted(BENCHES)}, got {unknown}")
    rows = []
    for op in ops or BENCHES:
        try:
            for row in BENCHES[op](backend):
                print_row(row)
                rows.append(row)
        except NotOnBackend as missing:
            print(f"  {op}: not on {backend}: {missing}", flush=True)
    return rows
