"""``python -m studies.fp8_promotion``: how much of the FP8 matmul's accuracy contract
the correct kernel and the missing-promotion bug use on Hopper, as K grows.

Two kernels on the same inputs (``strategies.fp8_blocks``: x [m, K] with 1x128
scales, w [n, K] with 128x128 scales, each input kind of ``--kinds``):
- ``promoted``: the shipped kernel (``fp8_matmul``; each 128-product span summed by the
  matrix unit, then scaled and added in f32);
- ``no_promotion``: tests/broken/mosaic_gpu_fp8_matmul_variants.py (the running sum
  carried through the matrix unit across all of K).

Where they run:
- ``--backend mosaic_gpu``: the kernels on a Hopper GPU (the measurement);
- ``--emulate`` (the CPU, no GPU): both kernels' arithmetic replayed with the Hopper
  model (``oracles.fp8_matmul.emulate_fused_sum``: 32-product groups, 13 fraction
  bits, truncated as MMA-Sim has it; the H100 probe classifies the cut as nearest,
  and a truncating cut loses at least as much, all in one direction, so the
  emulation is the harsher estimate), the promotion in f32 numpy.

For each (K, kind, kernel) it prints the worst |error| / allowed error over the m x n
outputs under: the implementation bound (``oracles.fp8_matmul.bound`` at the
kernel's promotion interval; for ``no_promotion`` the bound of the shipped kernel,
which it claims to be), the contract (``oracles.fp8_matmul.contract``: the recipe,
Hopper's FP8 matrix unit over each 128-product block promoted in f32) and, for
comparison, the contract it replaced (``f32_product``: an f32-accumulated product of
the dequantised operands, which the shipped kernel exceeds on the H100). Above 1 fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallascheck.kernels import fp8_matmul, mosaic_gpu_fp8_matmul
from pallascheck.kernels.backends import Backend
from pallascheck.kernels.fp8 import SCALE_BLOCK
from pallascheck.oracles import fp8_matmul as oracle
from pallascheck.oracles.tolerance import GPU, Arithmetic, arithmetic_for
from pallascheck.properties import strategies

KINDS = ("normal", "positive", "outlier", "power_of_two")
KERNELS = ("promoted", "no_promotion")


def f32_product(ref: oracle.Fp8MatmulOracle, *, arith: Arithmetic, out_dtype: Any) -> np.ndarray:
    """The contract before 2026-11-27: the bound of an f32-accumulated product of the
    dequantised operands, read as f32 (never tf32)."""
    return oracle.reference_bound(
        ref, arith=dataclasses.replace(arith, matmul_input_f32="float32"), out_dtype=out_dtype
    )


def _to_bf16(a: np.ndarray) -> np.ndarray:
    """f32 -> bf16 by round-to-nearest-even, as float64."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def emulated(kernel: str, x: np.ndarray, xs: np.ndarray, w: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """The kernel's bf16 output, its arithmetic replayed with the Hopper FP8 model: each
    128-wide block's FP8 products through ``emulate_fused_sum`` (from zero for
    ``promoted``, from the running sum in the block's scale units for ``no_promotion``,
    as the variant's ``acc / s`` does), scaled and added in f32."""
    mma = GPU.fp8_mma
    if mma is None:
        raise ValueError("the GPU arithmetic has no FP8 matrix unit model")
    q = x.astype(np.float64)[:, None, :] * w.astype(np.float64)[None, :, :]  # exact FP8 products [m, n, K]
    m, n, k = q.shape
    acc = np.zeros((m, n), np.float32)
    for kb in range(-(-k // SCALE_BLOCK)):
        block = q[..., kb * SCALE_BLOCK : (kb + 1) * SCALE_BLOCK]
        scale = (xs[:, kb][:, None] * np.repeat(ws[:, kb], SCALE_BLOCK)[:n][None, :]).astype(np.float32)
        if kernel == "promoted":
            part = oracle.emulate_fused_sum(block, mma.fraction_bits, mma.group).astype(np.float32)
            acc = acc + part * scale
        else:
            carried = (acc / scale).astype(np.float64)
            acc = oracle.emulate_fused_sum(block, mma.fraction_bits, mma.group, initial=carried).astype(np.float32)
            acc = acc * scale
    return _to_bf16(acc)


def _on_device(kernel: str, x: np.ndarray, xs: np.ndarray, w: np.ndarray, ws: np.ndarray, backend: Backend) -> Any:
    operands = tuple(jnp.asarray(a) for a in (x, xs, w, ws))
    if kernel == "promoted":
        out = fp8_matmul.fp8_matmul(*operands, backend=backend)
    else:
        sys.path.insert(0, "tests")
        from broken import mosaic_gpu_fp8_matmul_variants

        out = mosaic_gpu_fp8_matmul_variants.no_promotion(*operands, backend=backend)
    return np.asarray(out, np.float64)


def measure(
    ks: Sequence[int], kinds: Sequence[str], m: int, n: int, backend: Backend | None, seed: int = 0
) -> list[dict[str, Any]]:
    """One row per (K, kind, kernel): the worst error / allowed error under each bound.
    ``backend`` None: the Hopper emulation on the CPU (judged with the GPU arithmetic)."""
    arith = GPU if backend is None else arithmetic_for(backend)
    config: Any = mosaic_gpu_fp8_matmul.Config() if backend is None or backend.is_mosaic_gpu else fp8_matmul.Config()
    rows = []
    for k in ks:
        for kind in kinds:
            x, xs = strategies.fp8_blocks(seed, (m, k), "float8_e4m3fn", kind, (1, SCALE_BLOCK))
            w, ws = strategies.fp8_blocks(seed + 1, (n, k), "float8_e4m3fn", kind, (SCALE_BLOCK, SCALE_BLOCK))
            ref = oracle.oracle(x, xs, w, ws)
            bounds = {
                "implementation": oracle.bound(ref, config=config, arith=arith, out_dtype=np.dtype("bfloat16")),
                "contract": oracle.contract(ref, arith=arith, out_dtype=np.dtype("bfloat16")),
                "f32_product": f32_product(ref, arith=arith, out_dtype=np.dtype("bfloat16")),
            }
            for kernel in KERNELS:
                if backend is None:
                    out = emulated(kernel, x, xs, w, ws)
                else:
                    out = _on_device(kernel, x, xs, w, ws, backend)
                err = np.abs(out - np.asarray(ref.out))
                row: dict[str, Any] = {"k": k, "kind": kind, "kernel": kernel}
                for name, b in bounds.items():
                    with np.errstate(divide="ignore", invalid="ignore"):
                        row[name] = float(np.nanmax(np.where(err > 0, err / np.asarray(b), 0.0)))
                # DeepSeek-V3's figure: the error relative to the result, worst element
                with np.errstate(divide="ignore", invalid="ignore"):
                    relative = np.where(np.abs(ref.out) > 0, err / np.abs(ref.out), 0.0)
                row["median_relative"] = float(np.median(relative))
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    return (
        f"K={row['k']:>6} {row['kind']:13} {row['kernel']:13} implementation {row['implementation']:9.3g}  "
        f"contract {row['contract']:9.3g}  f32 product {row['f32_product']:9.3g}  "
        f"median |err|/|z| {row['median_relative']:.2e}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.fp8_promotion", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--backend", help="run the kernels here (mosaic_gpu on a Hopper GPU)")
    where.add_argument("--emulate", action="store_true", help="replay the Hopper model on the CPU")
    parser.add_argument("--k", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=strategies.FP8_KINDS)
    parser.add_argument("--m", type=int, default=128, help="rows of x (the emulation: keep m n K small)")
    parser.add_argument("--n", type=int, default=128)
    args = parser.parse_args(argv)
    if any(k % SCALE_BLOCK for k in args.k):
        parser.error(f"--k must be multiples of {SCALE_BLOCK}")
    measure(args.k, args.kinds, args.m, args.n, None if args.emulate else Backend(args.backend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
