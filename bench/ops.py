"""``pallascheck bench``: kernel speed against xla_reference in the same dtype.

Times are medians over repeated calls of jitted functions after a warm-up, with
``block_until_ready``; each kernel is timed with its default config and with the
fastest config of its autotuning space.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from pallascheck.kernels import matmul, norms
from pallascheck.kernels.backends import Backend, NotOnBackend

from .attention import bench_attention
from .collectives import bench_collectives
from .losses import bench as bench_losses
from .moe import run as bench_moe
from .top_k import bench_top_k
from .timing import best_config, median_seconds

MATMUL_SIZES = ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 2048, 8192), (2048, 8192, 2048), (8192, 8192, 8192))
NORM_SHAPES = ((8192, 1024), (8192, 4096), (32768, 2048))
DTYPES = ("bfloat16", "float32")


def bench_matmul(backend: Backend, dtype: str) -> list[dict]:
    rows = []
    for m, k, n in MATMUL_SIZES:
        kx, ky = jax.random.split(jax.random.key(0))
        x = jax.random.normal(kx, (m, k), dtype)
        y = jax.random.normal(ky, (k, n), dtype)
        ref = jax.jit(matmul.xla_reference)
        t_ref = median_seconds(lambda: ref(x, y))
        # jitted as the reference is: the kernel's Python dispatch (validation, padding,
        # config resolution) is not what is compared
        def jitted(config: object = None) -> Callable[[], jax.Array]:
            fn = jax.jit(lambda a, b: matmul.matmul(a, b, config=config, backend=backend))
            return lambda: fn(x, y)

        t_best, cfg = best_config(jitted, matmul.configs(m, n, k, backend, itemsize=x.dtype.itemsize))
        t_default = median_seconds(jitted())
        flops = 2.0 * m * n * k
        row = {"op": "matmul", "shape": f"{m}x{k}x{n}", "dtype": dtype, "xla_ms": t_ref * 1e3,
               "kernel_default_ms": t_default * 1e3, "kernel_best_ms": t_best * 1e3, "best_config": str(cfg),
               "kernel_tflops": flops / t_best / 1e12, "xla_tflops": flops / t_ref / 1e12,
               "speed_vs_xla": t_ref / t_best}
        if backend.is_mosaic_gpu:
            row.update(_bundled_hopper_matmul(x, y, t_best, flops))
        rows.append(row)
    return rows


def _bundled_hopper_matmul(x: jax.Array, y: jax.Array, t_ours: float, flops: float) -> dict:
    """JAX's bundled Mosaic GPU matmul (ops/gpu/hopper_matmul_mgpu), best of a few of
    its tile configs; a config that does not fit or compile is skipped."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as bundled

    results = []
    for tm, tn, steps in ((128, 128, 4), (128, 256, 4), (256, 128, 4)):
        config = bundled.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=steps)
        fn = jax.jit(lambda a, b, config=config: bundled.matmul(a, b, None, config=config))
        try:
            results.append((median_seconds(lambda: fn(x, y), repeats=10), config))
        except Exception as err:  # noqa: BLE001 - a config of the competitor that does not run
            print(f"    bundled hopper_matmul_mgpu {config} failed: {type(err).__name__}: {str(err)[:120]}")
    if not results:
        return {"bundled_mgpu_error": "no config ran"}
    t, config = min(results, key=lambda r: r[0])
    return {"bundled_mgpu_ms": t * 1e3, "bundled_mgpu_tflops": flops / t / 1e12,
            "speed_vs_bundled_mgpu": t / t_ours}


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
            t_best, cfg = best_config(lambda c: (lambda: kernel(x, scale, config=c, backend=backend)), norms.configs(r, d, backend))
            k_fb = fwd_bwd(lambda a, b: kernel(a, b, config=cfg, backend=backend))
            t_fb = median_seconds(lambda: k_fb(x, scale))
            bytes_fwd = 2 * x.size * x.dtype.itemsize
            rows.append({"op": kind, "shape": f"{r}x{d}", "dtype": dtype, "xla_ms": t_ref * 1e3,
                         "kernel_best_ms": t_best * 1e3, "best_config": str(cfg),
                         "kernel_GBps": bytes_fwd / t_best / 1e9, "speed_vs_xla": t_ref / t_best,
                         "xla_fwd_bwd_ms": t_ref_fb * 1e3, "kernel_fwd_bwd_ms": t_fb * 1e3,
                         "fwd_bwd_speed_vs_xla": t_ref_fb / t_fb})
    return rows


def _per_dtype(bench: Callable[[Backend, str], list[dict]]) -> Callable[[Backend], list[dict]]:
    """Every dtype of DTYPES the backend's kernels take (Mosaic GPU: bf16 only here)."""
    return lambda backend: [row for dtype in DTYPES if not (backend.is_mosaic_gpu and dtype == "float32")
                            for row in bench(backend, dtype)]


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


def print_row(row: dict) -> None:
    print("  " + "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def run(backend: Backend, ops: "list[str] | None" = None) -> list[dict]:
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
