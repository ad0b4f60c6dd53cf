"""What the CPU can check of the warp-specialised FP8 matmul beyond its properties in
the Mosaic GPU interpreter (tests/test_kernel_properties.py): it lowers for CUDA at
8192^3 and at the small tier's shapes, so that a GPU run fails on no lowering error,
and its Config refuses what the form cannot run, naming the field and the rule."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest

from pallascheck.kernels import compat, fp8_matmul, mosaic_gpu_fp8_matmul
from pallascheck.kernels.backends import get_backend
from pallascheck.properties.families import fp8_matmul as family

H100_SMS = 132
SCALE_BLOCK = mosaic_gpu_fp8_matmul.SCALE_BLOCK


@pytest.fixture
def no_gpu_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lowering needs neither a visible GPU nor its SM count (the H100's stands in)."""
    monkeypatch.setattr(compat, "require_backend_available", lambda name: None)
    monkeypatch.setattr(mosaic_gpu_fp8_matmul, "persistent_ctas", lambda tiles, backend: min(tiles, H100_SMS))


def _lowered(m: int, n: int, k: int, config: mosaic_gpu_fp8_matmul.Config) -> str:
    kb, nb = -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK)
    args = (
        jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((m, kb), jnp.float32),
        jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((nb, kb), jnp.float32),
    )
    call = functools.partial(
        fp8_matmul.kernel_call, out_dtype=jnp.dtype(jnp.bfloat16), config=config, backend=get_backend("mosaic_gpu")
    )
    return jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.usefixtures("no_gpu_needed")
@pytest.mark.parametrize("config", [mosaic_gpu_fp8_matmul.Config(), mosaic_gpu_fp8_matmul.ONE_CONSUMER], ids=repr)
def test_lowers_for_cuda_at_8192(config: mosaic_gpu_fp8_matmul.Config) -> None:
    assert "mosaic_gpu" in _lowered(8192, 8192, 8192, config)


@pytest.mark.usefixtures("no_gpu_needed")
def test_the_default_lowers_for_cuda_at_the_small_tier_shapes() -> None:
    """Ragged rows, columns and K; one row; fewer rows than one consumer's tile."""
    d = family.Domain()
    for m, n, k in itertools.product(d.m, d.n, d.k):
        assert "mosaic_gpu" in _lowered(m, n, k, mosaic_gpu_fp8_matmul.Config()), (m, n, k)


@pytest.mark.usefixtures("no_gpu_needed")
def test_every_warp_specialised_config_drawn_lowers_for_cuda() -> None:
    m, n, k = (max(dims) for dims in (family.M_DIMS, family.N_DIMS, family.K_DIMS))
    drawn = [c for c in fp8_matmul.configs(m, n, k, "mosaic_gpu") if c.consumers == 2]
    assert drawn
    for config in drawn:
        assert "mosaic_gpu" in _lowered(m, n, k, config), config


def test_the_default_is_the_warp_specialised_form() -> None:
    config = mosaic_gpu_fp8_matmul.Config()
    assert config.consumers == 2 and config in fp8_matmul.configs(8192, 8192, 8192, "mosaic_gpu")
    drawn = fp8_matmul.configs(100, 150, 300, "mosaic_gpu_interpret")
    assert {c.consumers for c in drawn} == {1, 2}  # the interpreter's checks reach both forms


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"consumers": 3}, r"config.consumers must be 1 or 2"),
        ({"tile_m": 32}, r"config.tile_m must be 64 or 128"),
        ({"consumers": 1, "spans_per_step": 2}, r"config.spans_per_step must be 1, or 2 with consumers=2"),
        ({"spans_per_step": 3}, r"config.spans_per_step must be 1, or 2 with consumers=2"),
    ],
)
def test_config_names_the_field_and_the_rule(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mosaic_gpu_fp8_matmul.Config(**fields)


def test_a_swapped_body_needs_the_one_consumer_form() -> None:
    x = jnp.ones((64, 128), jnp.float8_e4m3fn)
    s = jnp.ones((64, 1), jnp.float32)
    with pytest.raises(ValueError, match=r"config.consumers must be 1 when a kernel body is passed"):
        mosaic_gpu_fp8_matmul.tiled_call(
            x,
            s,
            x,
            jnp.ones((1, 1), jnp.float32),
            out_dtype=jnp.bfloat16,
            config=mosaic_gpu_fp8_matmul.Config(),
            backend=get_backend("mosaic_gpu_interpret"),
            body=lambda *refs, steps: None,
        )
