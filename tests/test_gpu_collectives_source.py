"""What the CPU can check of the Mosaic GPU ring collectives
(kernels/mosaic_gpu_collectives.py), which need two or more Hopper GPUs to run: they
use no NVLink multicast or multimem API (a program that does can take a shared
host's GPUs out of service), and every kernel lowers for CUDA, on 2 and 4 devices,
for the dtypes and configs the GPU checks draw (the Mosaic GPU interpreter has no
remote references or semaphores, so lowering is as far as the CPU goes; the values
are checked on the hardware by tests/test_gpu_collectives.py)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallascheck.kernels import mosaic_gpu_collectives as mgc
from pallascheck.properties.families import collectives as family

H100_SMS = 132
FORBIDDEN = re.compile(r"multimem|multicast|semaphore_signal_multicast|all_gather_mgpu|reduce_scatter_mgpu", re.I)


def test_no_multicast_api_in_the_gpu_collectives() -> None:
    source = inspect.getsource(mgc)
    code = "\n".join(line.split("#")[0] for line in source.splitlines())
    # the module docstring names what is forbidden; the code must not use it
    body = code[code.index('"""', 3) + 3 :]
    assert not FORBIDDEN.search(body), FORBIDDEN.findall(body)


def _lower(local, in_specs, out_specs, p, *shapes):
    mesh = jax.sharding.AbstractMesh((p,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, sp)) for (s, d), sp in zip(shapes, in_specs)]
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("config", family.MOSAIC_GPU.configs, ids=repr)
def test_the_gpu_kernels_lower_for_cuda(p: int, config: mgc.Config) -> None:
    config = dataclasses.replace(config, ctas=config.ctas or H100_SMS)  # no GPU to count SMs on here
    tm, tk, tn = config.tile_m, config.tile_k, config.tile_n * config.consumers
    gather = _lower(
        functools.partial(mgc.all_gather_local, axis="x", p=p, config=config),
        (P("x"),),
        P(),
        p,
        ((p * 3, 256), jnp.float32),
    )
    agmm = _lower(
        functools.partial(mgc.all_gather_matmul_local, axis="x", p=p, out_dtype=jnp.float32, config=config),
        (P("x", None), P(None, "x")),
        P(None, "x"),
        p,
        ((p * tm, 3 * tk), jnp.bfloat16),
        ((3 * tk, p * tn), jnp.bfloat16),
    )
    rs = _lower(
        functools.partial(mgc.matmul_reduce_scatter_local, axis="x", p=p, out_dtype=jnp.float16, config=config),
        (P(None, "x"), P("x", None)),
        P("x", None),
        p,
        ((p * tm, p * 2 * tk), jnp.float16),
        ((p * 2 * tk, tn), jnp.float16),
    )
    for text in (gather, agmm, rs):
        assert "mosaic_gpu" in text  # one Mosaic GPU custom call per device program


def test_boxes_cover_a_slot_once() -> None:
    """Every element of a slot is in exactly one box of exactly one CTA."""
    for rows, cols, itemsize, ctas in ((3, 128, 4, 8), (200, 256, 2, 132), (64, 8192, 2, 16), (1, 128, 2, 4)):
        boxes = mgc.plan_boxes(rows, cols, itemsize, ctas)
        assert boxes.count % boxes.ctas == 0 and boxes.ctas <= ctas
        assert boxes.box_rows * boxes.box_cols * boxes.count == rows * cols
        assert boxes.box_cols * itemsize >= 16 and boxes.box_cols <= 256 and boxes.box_rows <= mgc.MAX_BOX_ROWS
