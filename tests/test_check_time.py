"""``pallascheck bench --check-time``'s summary line (bench/check_time.py)."""

from __future__ import annotations

import pytest

from pallascheck.bench import check_time
from pallascheck.cli import bench as bench_cli
from pallascheck.kernels.backends import Backend


def _result(first, later, peak):
    return {
        "kernel": "ragged_dot",
        "dtype": "bfloat16",
        "device": "NVIDIA H200",
        "jax": "0.11.2",
        "first_seconds": first,
        "median_seconds_after_first": later,
        "peak_device_bytes": peak,
    }


def test_the_summary_says_what_was_not_measured_instead_of_printing_zero() -> None:
    assert check_time.summary(_result(46.22, 24.5, 10.2 * 2**30)) == (
        "ragged_dot bfloat16 on NVIDIA H200 (jax 0.11.2): first case 46.22 s, then median 24.50 s; "
        "peak device memory 10.2 GiB"
    )
    # one case: no later case to take a median of (it read "then median 0.00 s")
    assert check_time.summary(_result(46.22, None, None)) == (
        "ragged_dot bfloat16 on NVIDIA H200 (jax 0.11.2): first case 46.22 s, no case after the first; "
        "peak memory not reported by the device"
    )
    assert "no case checked;" in check_time.summary(_result(None, None, None))


def test_the_dtype_defaults_to_one_the_kernel_has() -> None:
    """``bench --check-time fp8_matmul`` without --dtype checks its float8_e4m3fn (it
    asked for bfloat16 and crashed in the kernel's own dtype check, on an H200); an
    alias resolves; a dtype the kernel lacks is a one-line error naming its dtypes."""
    gpu = Backend("mosaic_gpu")
    assert bench_cli._dtype("fp8_matmul", None, gpu) == "float8_e4m3fn"
    assert bench_cli._dtype("attention", None, gpu) == "bfloat16"
    assert bench_cli._dtype("attention", "f16", gpu) == "float16"
    with pytest.raises(SystemExit, match=r"--dtype 'float32': attention has no such version on mosaic_gpu: .*bfloat16"):
        bench_cli._dtype("attention", "float32", gpu)
