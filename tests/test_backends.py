"""What the backends take from JAX for free: interpreters that raise on an
out-of-bounds read, and NaN-poisoned scratch on the TPU (kernels/compat.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from pallascheck.kernels.backends import Backend


def test_mosaic_gpu_interpreter_raises_on_an_out_of_bounds_read() -> None:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def kernel(start_gmem, out_gmem, smem):
        smem[...] = jnp.zeros((128,), jnp.float32)
        out_gmem[...] = smem[pl.ds(start_gmem[0], 128)]  # past the end for a start > 0

    read = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
        scratch_types=(plgpu.SMEM((128,), jnp.float32),),
        interpret=Backend("mosaic_gpu_interpret").interpret_arg(),
    )
    assert float(read(jnp.array([0], jnp.int32)).sum()) == 0.0
    with pytest.raises(Exception, match="Out-of-bounds read"):
        jax.block_until_ready(read(jnp.array([64], jnp.int32)))
    # and the interpreter runs the next kernel (its state does not outlive the failure)
    assert float(read(jnp.array([0], jnp.int32)).sum()) == 0.0


def test_tpu_interpreter_raises_on_out_of_bounds_reads() -> None:
    assert Backend("tpu_interpret").interpret_arg().out_of_bounds_reads == "raise"


def test_scratch_is_poisoned_on_the_tpu_only() -> None:
    from jax._src import config

    for name, poisoned in (("tpu", True), ("interpret", False), ("mosaic_gpu", False)):
        with Backend(name).placement():
            assert config.jax_pallas_poison_buffers.value is poisoned, name
    assert config.jax_pallas_poison_buffers.value is False


@pytest.mark.parametrize("backend", ["interpret", "tpu_interpret"])
def test_interpreters_refuse_a_block_index_past_the_array(backend: str) -> None:
    """The interpreters clamp a block index past the last block (one block of 8 here:
    index 1 would read the same block again); hardware would read past the array."""

    def copy(index_map):
        spec = pl.BlockSpec((None, 8), index_map)
        return Backend(backend).pallas_call(
            lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
            grid=(2,),
            in_specs=[spec],
            out_specs=pl.BlockSpec((None, 8), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct((2, 8), jnp.float32),
            name="copy",
        )

    x = jnp.arange(16, dtype=jnp.float32).reshape(2, 8)
    assert (jax.jit(copy(lambda i: (i, 0)))(x) == x).all()
    with pytest.raises(
        IndexError,
        match=r"copy: the BlockSpec of input 0 maps grid point \(0,\) .* block index 1 "
        r"along axis 1, outside its 1 block",
    ):
        jax.jit(copy(lambda i: (i, 1)))(x)
    with pytest.raises(IndexError, match=r"grid point \(1,\) .* block index 2 along axis 0, outside its 2 block"):
        copy(lambda i: (i + 1, 0))(x)
