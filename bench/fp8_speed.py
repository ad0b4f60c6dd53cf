"""Speed of the block-scaled FP8 matmul against XLA's FP8 dot and our bf16 matmul, one
run, interleaved (each round times every contender once, in turn), on the GPU:

    python -m pallascheck.bench.fp8_speed [--sizes 4096 8192] [--rounds 5]

XLA's FP8 dot is ``jnp.dot`` of e4m3 operands with an f32 result rescaled by one
per-tensor scale, rounded to bf16 (XLA has no block-scaled dot); the bf16 matmul is
kernels/matmul.py's Mosaic GPU kernel under its default config. Our FP8 matmul runs
twice: under its default config (warp-specialised, two consumers) and under
``mosaic_gpu_fp8_matmul.ONE_CONSUMER`` (one warpgroup a tile, the default before).
TFLOP/s count 2 M N K.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.kernels import fp8, fp8_matmul, matmul, mosaic_gpu_fp8_matmul


def _time(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", default="mosaic_gpu")
    args = parser.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; median of {args.rounds} interleaved rounds")
    for size in args.sizes:
        key = jax.random.key(size)
        a = jax.random.normal(key, (size, size), jnp.float32)
        b = jax.random.normal(jax.random.fold_in(key, 1), (size, size), jnp.float32)
        x, xs = fp8.xla_reference(a, block=(1, 128))
        w, ws = fp8.xla_reference(b, block=(128, 128))
        a16, bt16 = a.astype(jnp.bfloat16), b.T.astype(jnp.bfloat16)
        best = {"size": size}
        contenders = {
            "fp8_matmul (ours)": (
                lambda *o: fp8_matmul.fp8_matmul(*o, config=mosaic_gpu_fp8_matmul.Config(), backend=args.backend),
                (x, xs, w, ws),
            ),
            "fp8_matmul, 1 consumer": (
                lambda *o: fp8_matmul.fp8_matmul(*o, config=mosaic_gpu_fp8_matmul.ONE_CONSUMER, backend=args.backend),
                (x, xs, w, ws),
            ),
            "XLA FP8 dot": (
                jax.jit(lambda x, w: (jnp.dot(x, w.T, preferred_element_type=jnp.float32) * 0.5).astype(jnp.bfloat16)),
                (x, w),
            ),
            "bf16 matmul (ours)": (lambda p, q: matmul.matmul(p, q, backend=args.backend), (a16, bt16)),
        }
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, (fn, operands) in contenders.items():
                times[name].append(_time(fn, *operands))
        flops = 2.0 * size**3
        for name, ts in times.items():
            best[name] = float(np.median(ts))
            print(f"  {size}^3  {name:24s} {1e3 * best[name]:8.2f} ms  {flops / best[name] / 1e12:7.1f} TFLOP/s")
        ours = best["fp8_matmul (ours)"]
        print(
            f"  {size}^3  fp8/bf16 speed-up {best['bf16 matmul (ours)'] / ours:.2f}x (target >= 1.5x at 8192), "
            f"fp8/XLA FP8 {best['XLA FP8 dot'] / ours:.2f}x (target >= 1.0x), "
            f"over the one-consumer form {best['fp8_matmul, 1 consumer'] / ours:.2f}x"
        )


if __name__ == "__main__":
    main()
