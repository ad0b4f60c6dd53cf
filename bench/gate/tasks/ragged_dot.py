"""Grouped matmul: out[r] = lhs[r] @ rhs[group of r], rows past the groups 0 (MoE experts)."""

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.bench.gate.task import Arg, Dims, Task


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(lhs.shape[0])
    group = jnp.sum(rows[:, None] >= ends[None, :], axis=1)
    inside = group < rhs.shape[0]
    weights = rhs[jnp.minimum(group, rhs.shape[0] - 1)]
    out = jnp.einsum("mk,mkn->mn", lhs, weights, preferred_element_type=jnp.float32)
    return jnp.where(inside[:, None], out, 0.0).astype(lhs.dtype)


def _group_sizes(rng: np.random.Generator, dims: Dims, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    # sizes summing to at most m, empty groups included (the MoE expert that got no token)
    cuts = np.sort(rng.integers(0, dims["m"] + 1, shape[0]))
    return np.diff(cuts, prepend=0).astype(dtype)


TASK = Task(
    name="ragged_dot",
    reference=ragged_dot,
    inputs={
        "lhs": Arg(("m", "k"), reduction="k"),
        "rhs": Arg(("g", "k", "n"), reduction="k"),
        "group_sizes": Arg(("g",), dtype="int32", values=_group_sizes, differentiable=False),
    },
    dims={"m": (16, 32, 40), "k": (16, 32), "n": (16, 32), "g": (2, 3, 4)},
    shown={"m": 32, "k": 32, "n": 16, "g": 3},
    signature="ragged_dot(lhs, rhs, group_sizes) -> lhs[r] @ rhs[group(r)], rows past sum(group_sizes) 0",
)
