"""activation(x @ y): a matmul accumulating in f32 with its activation fused, rounded once."""

import jax
import jax.numpy as jnp

from pallascheck.bench.gate.task import Arg, Task


def matmul_epilogue(x: jax.Array, y: jax.Array, *, activation: str = "none") -> jax.Array:
    z = jnp.dot(x, y, preferred_element_type=jnp.float32)
    if activation == "gelu_tanh":
        z = jax.nn.gelu(z, approximate=True)
    return z.astype(x.dtype)


TASK = Task(
    name="matmul_epilogue",
    reference=matmul_epilogue,
    inputs={"x": Arg(("m", "k"), reduction="k"), "y": Arg(("k", "n"), reduction="k")},
    dims={"m": (8, 17, 32, 64), "k": (16, 64, 100), "n": (16, 32, 64)},
    shown={"m": 32, "k": 64, "n": 32},
    options={"activation": ("none", "gelu_tanh")},
    signature="matmul_epilogue(x, y, *, activation) -> activation(x @ y) in x's dtype ('none' or 'gelu_tanh')",
)
