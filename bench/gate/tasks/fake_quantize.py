"""Symmetric int8 quantize-dequantize per row: round(x / s) * s with s = max|x| / 127."""

import jax
import jax.numpy as jnp

from pallascheck.bench.gate.task import Arg, Task

# rows of zeros get this scale instead of 0 (no division by zero): the smallest normal f32
TINY = 2.0**-126


def fake_quantize(x: jax.Array) -> jax.Array:
    z = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(z), axis=-1, keepdims=True) / 127.0, TINY)
    return (jnp.clip(jnp.round(z / scale), -127.0, 127.0) * scale).astype(x.dtype)


TASK = Task(
    name="fake_quantize",
    reference=fake_quantize,
    inputs={"x": Arg(("rows", "d"))},
    dims={"rows": (1, 8, 13), "d": (32, 64, 128)},
    shown={"rows": 8, "d": 128},
    kinds=("normal", "positive", "few_distinct"),
    # bf16 inputs land on rounding ties (127 x / max|x| = k + 1/2 exactly), where either
    # rounding is right and the bound is a whole quantization step: f32 inputs, where a
    # near-tie is rare
    dtypes=("float32",),
    signature="fake_quantize(x) -> per-row symmetric int8 quantize-dequantize (scale max|x|/127, round half to even)",
)
