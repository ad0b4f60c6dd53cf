"""A blocked cumulative sum along rows, as a Pallas kernel.

Each row is scanned in blocks of ``BLOCK`` columns: a block's own cumulative sum
(f32), plus the carry, the running total of the blocks before it; the carry then
adds the block's total. Element i is thus a sum of its i + 1 prefix terms whose
longest chain of additions is (BLOCK - 1) + (blocks before it): the blocked order
with block ``BLOCK``. ``bug=True`` plants a stale carry: the carry adds the block's
first element instead of its total.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

BLOCK = 16


def cumsum_reference(x: jax.Array) -> jax.Array:
    return jnp.cumsum(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def _kernel(x_ref, o_ref, *, bug: bool):
    rows, n = x_ref.shape

    def block(b, carry):
        sl = pl.ds(b * BLOCK, BLOCK)
        local = jnp.cumsum(x_ref[:, sl].astype(jnp.float32), axis=1)
        o_ref[:, sl] = (carry + local).astype(o_ref.dtype)
        return carry + (local[:, :1] if bug else local[:, -1:])

    lax.fori_loop(0, n // BLOCK, block, jnp.zeros((rows, 1), jnp.float32))


@functools.partial(jax.jit, static_argnames=("interpret", "bug"))
def blocked_cumsum(x: jax.Array, *, interpret: bool = False, bug: bool = False) -> jax.Array:
    if x.ndim != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"x: [rows, N] with N a multiple of {BLOCK}, got {x.shape}")
    return pl.pallas_call(
        functools.partial(_kernel, bug=bug), interpret=interpret, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype)
    )(x)


# ---- check (the whole of it) ----
from pallascheck.specs import Facts, Input, blocked, from_reference  # noqa: E402


def spec(kernel=blocked_cumsum):
    return from_reference(
        kernel,
        cumsum_reference,
        name="example_blocked_cumsum",
        inputs={"x": Input((4, 48), reduction=48, kinds=("normal", "large", "subnormal", "positive"))},
        facts=Facts(order=blocked(BLOCK)),
    )


SPEC = spec()  # the kernel as shipped (spec(functools.partial(blocked_cumsum, bug=True)): its planted bug)
