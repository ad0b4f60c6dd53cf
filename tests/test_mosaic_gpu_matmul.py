"""The Mosaic GPU matmul's warp-specialised form (``Config(consumers=2)``) on every
config of it the backend's space holds, on a shape that spans several CTAs in both
directions, with a partial band and padding: values and gradients within the bound
(the pre-activation the backward saves goes through the narrower epilogue). The
property tests draw these configs too, among the others."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallascheck.kernels import mosaic_gpu_matmul, tiling
from pallascheck.kernels.backends import Backend
from pallascheck.properties import checks, runner, strategies
from pallascheck.properties.registry import get_spec
from pallascheck.properties.spec import Case

M, K, N = 130, 40, 260  # 3 row tiles of 64 (the last partial), 2 K tiles of 32, 3 CTA columns of 128


def _case(activation: str, seed: int) -> Case:
    return Case(
        {
            "x": strategies.elements(seed, (M, K), "bfloat16", "normal", reduction=K),
            "y": strategies.elements(seed + 1, (K, N), "bfloat16", "normal", reduction=K),
            "cotangent": strategies.elements(seed + 2, (M, N), "bfloat16", "normal"),
        },
        {"activation": activation, "out_dtype": "bfloat16"},
    )


def test_warp_specialized_configs_within_bound(each_backend: Backend) -> None:
    if not each_backend.is_mosaic_gpu:
        pytest.skip(f"a Mosaic GPU kernel: not on {each_backend}")
    spec = get_spec("matmul")
    specialised = [c for c in mosaic_gpu_matmul.configs(M, N, K, 2, each_backend) if c.consumers == 2]
    assert specialised, "the config space holds no warp-specialised config"
    for config in specialised:
        for activation, seed in (("none", 0), ("silu", 3)):
            tally = runner.check_case(
                spec,
                _case(activation, seed),
                config,
                each_backend,
                selected=("values", "gradients"),
                context=checks.Context(
                    kernel="matmul", dtype="bfloat16", backend=str(each_backend), config=str(config)
                ),
            )
            assert all(o.passed for o in tally.outcomes.values())


def test_band_order_visits_every_tile_once() -> None:
    """The CTA -> (row tile, column tile) map of the banded order is a bijection,
    with a last band shorter than the others."""
    m_tiles, n_tiles = 11, 5  # bands of 8 and 3 rows
    seen = [
        tuple(int(v) for v in mosaic_gpu_matmul.band_order(np.int32(pid), m_tiles, n_tiles))
        for pid in range(m_tiles * n_tiles)
    ]
    assert sorted(seen) == [(i, j) for i in range(m_tiles) for j in range(n_tiles)]


@pytest.mark.parametrize("out_dtype", ["bfloat16", "float32"])
def test_hardware_config_space_fits_shared_memory_for_the_drawn_output_dtype(out_dtype: str) -> None:
    """Every config the spec offers the H200 for a bf16 product with this output dtype
    passes the kernel's own shared-memory check (an f32 output tile is twice a bf16
    one: `verify --examples 15` on the H200 once drew a 5-stage config whose f32 output
    did not fit, 237568 bytes against 232448). Nothing runs: the check is on the CPU."""
    case = Case(
        {"x": np.zeros((1024, 1024), jnp.bfloat16), "y": np.zeros((1024, 1024), jnp.bfloat16)},
        {"activation": "none", "out_dtype": out_dtype},
    )
    space = get_spec("matmul").configs(case, Backend("mosaic_gpu"))
    assert any(c.consumers == 2 for c in space)
    for config in space:
        tiling.require_shared_memory(
            config, mosaic_gpu_matmul.smem_bytes(config, 2, jnp.dtype(out_dtype).itemsize, True)
        )
