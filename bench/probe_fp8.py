"""``pallascheck probe`` for FP8: the arithmetic of a dot of FP8 (e4m3fn) operands.

Two paths: ``wgmma`` (one Hopper FP8 wgmma chain over K, on the GPU or in the Mosaic
GPU interpreter; an f32 or an f16 accumulator) and ``xla`` (``jnp.dot`` of FP8
operands with an f32 result, on the backend's platform). Crafted inputs, as for
bf16 (bench/probe.py), with FP8-exact values (e4m3fn reaches 2^-9, so a product
reaches 2^-18):

- fraction bits: 1 + 2^-k for k = 1..18 (1 * 1 and 2^-a * 2^-b in one row): the
  largest k kept;
- rounding: 1 + 0.75 * 2^-f and its negation, f the bits just measured: toward zero
  gives 1, nearest 1 + 2^-f;
- group size (a small FPRev): row j holds 256 * 256 at position 0, its negation at j
  and 1 * 1 elsewhere; the ones survive only in groups holding neither (the fused sum
  aligns them to 2^16 and cuts them) and after the pair has cancelled; matched
  against ``oracles.fp8_matmul.emulate_fused_sum`` for groups of 8 .. 128;
- subnormal input: 2^-9 * 1, kept or flushed;
- emulation: random e4m3 tiles (normal, positive, wide exponents), the wgmma against
  the emulation with the measured bits and group: the fraction of outputs that agree
  bit for bit (the emulating oracle is offered only at 100%).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallascheck.kernels import compat
from pallascheck.kernels.backends import Backend
from pallascheck.kernels.mosaic_gpu_matmul import operand_transforms
from pallascheck.oracles.fp8_matmul import emulate_fused_sum
from pallascheck.oracles.tolerance import Arithmetic, arithmetic_for

ROWS, K, COLS = 64, 128, 64
E4M3 = jnp.float8_e4m3fn
GROUPS = (8, 16, 32, 64, 128)
BIG = 256.0  # 256 * 256 = 2^16 per product
Fp8Dot = Callable[[np.ndarray, np.ndarray], np.ndarray]  # x [ROWS, K], w [COLS, K] (exact in e4m3) -> f64


def _wgmma_dot(backend: Backend, acc_dtype: Any) -> Fp8Dot:
    """One wgmma chain (K / 32 instructions into one accumulator) of x @ w^T."""

    def body(x_gmem, w_gmem, o_gmem, x_smem, w_smem, o_smem, bar):
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, bar)
        plgpu.copy_gmem_to_smem(w_gmem, w_smem, bar)
        plgpu.barrier_wait(bar)

        def run(acc_ref):
            plgpu.wgmma(acc_ref, x_smem, compat.transposed_smem(w_smem))
            return acc_ref[...]

        o_smem[...] = pl.run_scoped(run, plgpu.ACC((ROWS, COLS), acc_dtype)).astype(jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    call = jax.jit(
        plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
            scratch_types=(
                plgpu.SMEM((ROWS, K), E4M3, transforms=operand_transforms(K, E4M3)),
                plgpu.SMEM((COLS, K), E4M3, transforms=operand_transforms(K, E4M3)),
                plgpu.SMEM((ROWS, COLS), jnp.float32),
                plgpu.Barrier(num_arrivals=2),
            ),
            interpret=backend.interpret_arg(),
        )
    )
    return lambda x, w: np.asarray(call(jnp.asarray(x, E4M3), jnp.asarray(w, E4M3))).astype(np.float64)


def _xla_dot(backend: Backend) -> Fp8Dot:
    device = jax.devices(backend.platform)[0]
    fn = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32))
    return lambda x, w: np.asarray(
        fn(jax.device_put(jnp.asarray(x, E4M3), device), jax.device_put(jnp.asarray(w, E4M3), device))
    ).astype(np.float64)


def paths(backend: Backend) -> dict[str, Fp8Dot]:
    out = {"xla": _xla_dot(backend)}
    if backend.is_mosaic_gpu:
        out["wgmma f32"] = _wgmma_dot(backend, jnp.float32)
        if not backend.is_interpreted:  # the interpreter's numpy matmul refuses FP8 into f16 (jax 0.12.0.1)
            out["wgmma f16"] = _wgmma_dot(backend, jnp.float16)
    return out


def _rows(dot: Fp8Dot, x_rows: np.ndarray, w_row: np.ndarray) -> np.ndarray:
    """x_rows [R, <=K] against one w row [<=K] (placed in every w row): the R sums."""
    x = np.zeros((ROWS, K))
    x[: x_rows.shape[0], : x_rows.shape[1]] = x_rows
    w = np.zeros((COLS, K))
    w[:, : len(w_row)] = w_row
    assert np.array_equal(x.astype(E4M3).astype(np.float64), x), "probe input not exact in e4m3"
    return dot(x, w)[: x_rows.shape[0], 0]


def fraction_bits(dot: Fp8Dot) -> int:
    """The largest k in 1..18 with 1 + 2^-k kept (2^-k = 2^-ceil(k/2) * 2^-floor(k/2))."""
    ks = np.arange(1, 19)
    x = np.stack([np.ones(len(ks)), 2.0 ** -np.ceil(ks / 2)], axis=1)
    w = [1.0, 1.0]
    kept = []
    for k, row in zip(ks, x):  # w's second element varies per row: one call per k
        w = [1.0, 2.0 ** -np.floor(k / 2)]
        kept.append(_rows(dot, row[None], np.array(w))[0] == 1.0 + 2.0**-k)
    kept_arr = np.array(kept)
    return int(ks[kept_arr].max()) if kept_arr.any() else 0


def rounding(dot: Fp8Dot, bits: int) -> str:
    """1 + 0.75 * 2^-f as 1 + 2^-f - 2^-(f+2) (and negated): 'toward-zero' or 'nearest'."""
    if bits + 2 > 18:
        return "not resolved (more bits than FP8 inputs reach)"
    half = lambda e: (2.0 ** -np.ceil(e / 2), 2.0 ** -np.floor(e / 2))  # noqa: E731
    (a1, b1), (a2, b2) = half(bits), half(bits + 2)
    got = _rows(dot, np.array([[1.0, a1, -a2], [-1.0, -a1, a2]]), np.array([1.0, b1, b2]))
    past = np.round((np.abs(got) - 1.0) / 2.0**-bits).astype(int).tolist()
    return {(0, 0): "toward-zero", (1, 1): "nearest"}.get(tuple(past), f"other {past}")


def group_size(dot: Fp8Dot, bits: int) -> str:
    """Row j: 256 at position 0, -256 at j, 2^-6 elsewhere (times w = 1): a 2^-6 term
    survives only where its group holds neither 256 and it is added after the pair has
    cancelled; the pattern is matched against the emulated fused sums."""
    x = np.full((K - 1, K), 2.0**-6)
    x[:, 0] = BIG
    x[np.arange(K - 1), np.arange(1, K)] = -BIG
    got = np.concatenate([_rows(dot, x[i : i + ROWS], np.ones(K)) for i in range(0, K - 1, ROWS)])
    matches = [f"fused-{g}" for g in GROUPS if np.array_equal(emulate_fused_sum(x, bits, g), got)]
    if len(matches) == len(GROUPS):
        return "not resolved (no term was cut)"
    return ", ".join(matches) or "none of fused-" + "/".join(str(g) for g in GROUPS)


def subnormal_input(dot: Fp8Dot) -> str:
    tiny = 2.0**-9  # e4m3fn's smallest subnormal
    got = _rows(dot, np.array([[tiny]]), np.array([1.0]))[0]
    return "kept" if got == tiny else ("flushed" if got == 0 else "other")


def emulation_agreement(dot: Fp8Dot, bits: int, group: int, cases: int, seed: int = 0) -> tuple[int, int]:
    """(outputs bit-identical to ``emulate_fused_sum``, outputs) over ``cases`` random
    tile pairs: N(0,1), uniform positive and wide-exponent e4m3 values in turn."""
    rng = np.random.default_rng(seed)
    same = total = 0
    for case in range(cases):
        kind = case % 3
        draw = lambda shape: (  # noqa: E731
            rng.standard_normal(shape)
            if kind == 0
            else rng.uniform(0, 1, shape)
            if kind == 1
            else rng.standard_normal(shape) * 2.0 ** rng.integers(-6, 8, shape)
        )
        x = np.clip(draw((ROWS, K)), -448, 448).astype(E4M3).astype(np.float64)
        w = np.clip(draw((COLS, K)), -448, 448).astype(E4M3).astype(np.float64)
        got = dot(x, w)
        want = emulate_fused_sum(x[:, None, :] * w[None, :, :], bits, group)
        same += int(np.sum(got == want))
        total += got.size
    return same, total


def probe_path(dot: Fp8Dot, emulation_cases: int) -> dict[str, Any]:
    bits = fraction_bits(dot)
    groups = group_size(dot, bits)
    measured: dict[str, Any] = {
        "fraction_bits": bits,
        "rounding": rounding(dot, bits),
        "group": groups,
        "subnormal_input": subnormal_input(dot),
    }
    if groups.startswith("fused-") and emulation_cases:
        same, total = emulation_agreement(dot, bits, int(groups.split(",")[0].split("-")[1]), emulation_cases)
        measured["emulation_bit_exact"] = f"{same}/{total} ({100.0 * same / total:.2f}%)"
    return measured


def violations(measured: dict[str, Any], arith: Arithmetic, path: str) -> list[str]:
    """Where the model the bounds use (``arith.fp8_mma``; None: f32 sums) does not hold."""
    mma = arith.fp8_mma
    if not path.startswith("wgmma f32"):
        return []
    if mma is None:  # f32 round-to-nearest: every probe bit kept
        ok = measured["fraction_bits"] >= 18 and measured["rounding"].startswith(("nearest", "not resolved"))
        return [] if ok else [f"the model sums FP8 products in f32, measured {measured}"]
    out = []
    if measured["fraction_bits"] < mma.fraction_bits:
        out.append(f"{measured['fraction_bits']} fraction bits kept, the model assumes {mma.fraction_bits}")
    if f"fused-{mma.group}" not in measured["group"] and measured["fraction_bits"] <= mma.fraction_bits:
        out.append(f"groups {measured['group']}, the model assumes fused-{mma.group}")
    if measured["subnormal_input"] != "kept":
        out.append("FP8 subnormal inputs are flushed; the model keeps them")
    return out


def run(backend: Backend, emulation_cases: int = 0) -> dict[str, Any]:
    """Every FP8 property of every path of ``backend``, and the model's violations."""
    arith = arithmetic_for(backend)
    measured = {
        name: probe_path(dot, emulation_cases if name.startswith("wgmma") else 0)
        for name, dot in paths(backend).items()
    }
    return {"paths": measured, "violations": {n: violations(m, arith, n) for n, m in measured.items()}}


def print_table(report: dict[str, Any]) -> None:
    names = list(report["paths"])
    labels = ("fraction_bits", "rounding", "group", "subnormal_input", "emulation_bit_exact")
    rows = [[label] + [str(report["paths"][n].get(label, "-")) for n in names] for label in labels]
    rows.append(["tolerance model"] + ["VIOLATED" if report["violations"][n] else "holds" for n in names])
    widths = [max(len(r[i]) for r in rows + [["property", *names]]) for i in range(len(names) + 1)]
    print("FP8 (e4m3fn) dot arithmetic, f32 result (wgmma f16: an f16 accumulator)")
    for row in [["property", *names]] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    for name, problems in report["violations"].items():
        for problem in problems:
            print(f"  {name}: {problem}")
