"""FP8: the formats' facts, the quantiser's layouts, the fused-MMA model and the
emulated sum it rests on (the kernels' properties run in test_kernel_properties.py
and the broken variants in test_sensitivity.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallascheck.fuzz import scope
from pallascheck.kernels import fp8
from pallascheck.oracles import fp8_matmul as oracle
from pallascheck.oracles import tolerance
from pallascheck.properties import strategies


@pytest.mark.parametrize(("name", "u", "top"), [("float8_e4m3fn", 2.0**-4, 448.0), ("float8_e5m2", 2.0**-3, 57344.0)])
def test_fp8_formats_in_the_tolerance_model(name: str, u: float, top: float) -> None:
    assert tolerance.unit_roundoff(name) == u
    assert tolerance.largest_finite(name) == top
    past = np.float32(top * (1 + 2 * u))  # rounds past the max
    overflowed = float(jnp.asarray(past).astype(name).astype(jnp.float32))
    assert {"nan": np.isnan, "inf": np.isinf}[tolerance.OVERFLOWS_TO[name]](overflowed)


def test_dtype_aliases_resolve() -> None:
    assert scope.canonical_dtype("e4m3") == "float8_e4m3fn"
    assert scope.canonical_dtype("E5M2") == "float8_e5m2"
    assert scope.canonical_dtype("float8_e4m3fn") == "float8_e4m3fn"


def test_power_of_two_scale_is_the_smallest_above() -> None:
    ratios = np.array([0.75, 1.0, 1.5, 2.0**-130, 3.0], np.float32)
    got = np.asarray(fp8.power_of_two_at_least(jnp.asarray(ratios)))
    np.testing.assert_array_equal(got, [1.0, 1.0, 2.0, 2.0**-126, 4.0])


@pytest.mark.parametrize("block", fp8.BLOCKS)
def test_quantize_never_saturates_to_nan_and_keeps_its_bound(block: tuple[int, int]) -> None:
    a = strategies.quantize_input(3, (130, 300), "float32", "beyond_max")
    q, scale = fp8.quantize(jnp.asarray(a), block=block)
    full = np.repeat(np.repeat(np.asarray(scale, np.float64), block[0], 0), 128, 1)[:130, :300]
    deq = np.asarray(q).astype(np.float64) * full
    assert np.isfinite(deq).all()
    bound = oracle.quantize_bound(oracle.quantize_oracle(a), full, dtype=jnp.float8_e4m3fn)
    assert (np.abs(deq - a) <= bound).all()


def test_emulated_fused_sum_cuts_below_the_grid() -> None:
    """One group with 13 fraction bits: below 2^16 the grid is 2^3, so 2^2 is cut and
    2^3 kept; with 24 bits both are kept."""
    products = np.array([[2.0**16, 2.0**2], [2.0**16, 2.0**3]])
    np.testing.assert_array_equal(oracle.emulate_fused_sum(products, 13, 32), [2.0**16, 2.0**16 + 8])
    np.testing.assert_array_equal(oracle.emulate_fused_sum(products, 24, 32), [2.0**16 + 4, 2.0**16 + 8])


def test_fused_mma_bound_holds_on_its_emulation() -> None:
    """The Hopper model's span coefficient bounds the emulated sum's error on positive
    products (errors all one way, the worst case for truncation), where the emulation
    does lose bits (docs/fp8.md gives the budget it uses: 0.066 here)."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (64, 128)).astype(jnp.float8_e4m3fn).astype(np.float64)
    w = rng.uniform(0, 1, (64, 128)).astype(jnp.float8_e4m3fn).astype(np.float64)
    products = x[:, None, :] * w[None, :, :]
    mma = tolerance.HOPPER_FP8_MMA
    err = np.abs(oracle.emulate_fused_sum(products, mma.fraction_bits, mma.group) - products.sum(-1))
    ratio = err / (mma.span_coefficient(128) * products.sum(-1))
    assert err.max() > 0  # the cut happened: the bound is tested, not vacuous
    assert ratio.max() <= 1.0


def test_contract_is_the_recipe_and_sees_a_missing_promotion() -> None:
    """The contract is DeepSeek-V3's recipe (Hopper's FP8 matrix unit over each
    128-product block, promoted in f32), whatever the backend's arithmetic: wider than
    an f32 product's bound, which the shipped kernel exceeds on the H100 (docs/fp8.md).
    Replayed with the Hopper model (truncating, the harsher cut), the promoted kernel
    stays inside it at K = 4096 on positive inputs, where the cuts add up, and the
    kernel that carries its sum through the matrix unit does not."""
    from studies import fp8_promotion

    x, xs = strategies.fp8_blocks(0, (4, 4096), "float8_e4m3fn", "positive", (1, 128))
    w, ws = strategies.fp8_blocks(1, (4, 4096), "float8_e4m3fn", "positive", (128, 128))
    ref = oracle.oracle(x, xs, w, ws)
    bf16 = np.dtype(jnp.bfloat16)
    contract = oracle.contract(ref, arith=tolerance.GPU, out_dtype=bf16)
    assert (contract > fp8_promotion.f32_product(ref, arith=tolerance.GPU, out_dtype=bf16)).all()
    # the same on every backend: the CPU's rounding f32 additions (u, not 2u) only tighten the promotion's sum
    assert (oracle.contract(ref, arith=tolerance.CPU, out_dtype=bf16) <= contract).all()
    used = {
        kernel: np.max(np.abs(fp8_promotion.emulated(kernel, x, xs, w, ws) - ref.out) / contract)
        for kernel in fp8_promotion.KERNELS
    }
    assert used["promoted"] <= 1.0 < used["no_promotion"], used


def test_emulated_fused_sum_reads_its_initial_accumulator() -> None:
    """The accumulator is one more term of the first group: 2^16 in it puts 2^2 below
    the 13-bit grid, as a product of that size would."""
    got = oracle.emulate_fused_sum(np.array([[2.0**2]]), 13, 32, initial=np.array([2.0**16]))
    np.testing.assert_array_equal(got, [2.0**16])
