"""Deliberately broken layer_norm / rms_norm variants for the sensitivity meta-test.

Each variant swaps exactly one kernel body (forward or backward) through
``norms.make_norm`` and keeps the tiling, custom_vjp wiring and public signature, so
the harness must catch it from the numbers alone.

``VARIANTS`` maps a variant name to ``(kernel it breaks, callable)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallascheck.kernels import norms
from pallascheck.oracles import norms as norms_oracle
from pallascheck.properties.families.norms import Domain, make_spec
from pallascheck.properties.families.norms import cases as norms_cases
from pallascheck.properties.spec import KernelSpec
from pallascheck.properties.strategies import DTYPES

# --------------------------------------------------------------------- forward bodies


def _one_pass_variance_in_input_dtype_forward(
    x_ref, scale_ref, offset_ref, y_ref, mean_ref, rstd_ref, *, kind, eps, tile
):
    """var = E[x^2] - E[x]^2 in the input dtype: catastrophic cancellation for large means."""
    col_ok, row_ok, features = tile.col_ok(), tile.row_ok(), tile.features
    x = tile.load(x_ref, row_ok & col_ok)  # BUG: no upcast
    mean = jnp.sum(x, axis=1, keepdims=True) / features
    mean_sq = jnp.sum(x * x, axis=1, keepdims=True) / features
    var = mean_sq - mean * mean  # BUG: one pass, cancels
    mean32 = mean.astype(jnp.float32)
    rstd = lax.rsqrt(var.astype(jnp.float32) + eps)
    centered = x.astype(jnp.float32) - mean32
    centered = jnp.where(col_ok, centered, jnp.zeros_like(centered))
    tile.store(mean_ref, mean32, row_ok)
    tile.store(rstd_ref, rstd, row_ok)
    norms.store_output(tile, y_ref, centered, rstd, scale_ref, offset_ref)


def _one_pass_variance_forward(x_ref, scale_ref, offset_ref, y_ref, mean_ref, rstd_ref, *, kind, eps, tile):
    """var = E[x^2] - E[x]^2 in f32: faithful to its own one-pass arithmetic, but its
    rounding errors scale with E[x^2], not with the variance."""
    col_ok, row_ok, features = tile.col_ok(), tile.row_ok(), tile.features
    x = tile.load_f32(x_ref, row_ok & col_ok)
    mean = jnp.sum(x, axis=1, keepdims=True) / features
    var = jnp.sum(x * x, axis=1, keepdims=True) / features - mean * mean  # BUG: one pass
    rstd = lax.rsqrt(var + eps)
    centered = jnp.where(col_ok, x - mean, 0.0)
    tile.store(mean_ref, mean, row_ok)
    tile.store(rstd_ref, rstd, row_ok)
    norms.store_output(tile, y_ref, centered, rstd, scale_ref, offset_ref)


def _eps_outside_sqrt_forward(x_ref, scale_ref, offset_ref, y_ref, mean_ref, rstd_ref, *, kind, eps, tile):
    """rstd = 1 / (sqrt(var) + eps) (layer norm) or 1 / (sqrt(ms) + eps) (rms norm)."""
    col_ok, row_ok, features = tile.col_ok(), tile.row_ok(), tile.features
    x = tile.load_f32(x_ref, row_ok & col_ok)
    if kind == "layer_norm":
        mean, centered, _ = norms.layer_norm_statistics(x, col_ok, features, eps)
        var = jnp.sum(centered * centered, axis=1, keepdims=True) / features
        tile.store(mean_ref, mean, row_ok)
    else:
        centered = x
        var = jnp.sum(x * x, axis=1, keepdims=True) / features
    rstd = 1.0 / (jnp.sqrt(var) + eps)  # BUG: eps outside the square root
    tile.store(rstd_ref, rstd, row_ok)
    norms.store_output(tile, y_ref, centered, rstd, scale_ref, offset_ref)


def _unmasked_padding_forward(x_ref, scale_ref, offset_ref, y_ref, mean_ref, rstd_ref, *, kind, eps, tile):
    """Statistics summed over the padding columns too (garbage/NaN leaks when D is not a power of two)."""
    row_ok, features = tile.row_ok(), tile.features
    # BUG: only the rows are masked (memory safety on Triton); padding columns hold
    # NaN on the interpreters and the next row's values on Triton.
    x = tile.load_f32(x_ref, row_ok)
    mean = jnp.sum(x, axis=1, keepdims=True) / features
    centered = x - mean  # BUG: not masked either
    var = jnp.sum(centered * centered, axis=1, keepdims=True) / features
    rstd = lax.rsqrt(var + eps)
    tile.store(mean_ref, mean, row_ok)
    tile.store(rstd_ref, rstd, row_ok)
    norms.store_output(tile, y_ref, centered, rstd, scale_ref, offset_ref)


# -------------------------------------------------------------------- backward bodies


def _missing_rstd_backward(x_ref, scale_ref, mean_ref, rstd_ref, g_ref, dx_ref, dscale_ref, doffset_ref, *, kind, tile):
    """dx without the final rstd factor."""
    g, gs, xhat, rstd, ok = norms.backward_operands(tile, x_ref, scale_ref, mean_ref, rstd_ref, g_ref)
    proj = jnp.sum(gs * xhat, axis=1, keepdims=True) / tile.features
    if kind == "layer_norm":
        dx = gs - jnp.sum(gs, axis=1, keepdims=True) / tile.features - xhat * proj  # BUG: no rstd
    else:
        dx = gs - xhat * proj  # BUG: no rstd
    tile.store(dx_ref, dx, ok)
    norms.store_param_partials(tile, dscale_ref, doffset_ref, g, xhat, ok)


def _missing_projection_backward(
    x_ref, scale_ref, mean_ref, rstd_ref, g_ref, dx_ref, dscale_ref, doffset_ref, *, kind, tile
):
    """dx drops the xhat * mean(gs * xhat) term."""
    g, gs, xhat, rstd, ok = norms.backward_operands(tile, x_ref, scale_ref, mean_ref, rstd_ref, g_ref)
    dx = rstd * (gs - jnp.sum(gs, axis=1, keepdims=True) / tile.features)  # BUG: no projection
    tile.store(dx_ref, dx, ok)
    norms.store_param_partials(tile, dscale_ref, doffset_ref, g, xhat, ok)


def _dscale_drops_last_row_block_backward(
    x_ref, scale_ref, mean_ref, rstd_ref, g_ref, dx_ref, dscale_ref, doffset_ref, *, kind, tile
):
    """The last row block's dscale partial is zeroed (visible only when rows > block_rows)."""
    g, gs, xhat, rstd, ok = norms.backward_operands(tile, x_ref, scale_ref, mean_ref, rstd_ref, g_ref)
    proj = jnp.sum(gs * xhat, axis=1, keepdims=True) / tile.features
    dx = rstd * (gs - jnp.sum(gs, axis=1, keepdims=True) / tile.features - xhat * proj)
    tile.store(dx_ref, dx, ok)
    last = pl.program_id(0) == pl.num_programs(0) - 1
    keep = ok & jnp.logical_not(last)  # BUG: the last row block contributes nothing
    gx = g * xhat
    col_ok = tile.col_ok()
    tile.store(dscale_ref, jnp.sum(jnp.where(keep, gx, jnp.zeros_like(gx)), axis=0, keepdims=True), col_ok)
    tile.store(doffset_ref, jnp.sum(jnp.where(ok, g, jnp.zeros_like(g)), axis=0, keepdims=True), col_ok)


# ------------------------------------------------------------------------- variants


def _variant(kind: str, doc: str, **bodies) -> Callable:
    fn = norms.make_norm(kind, **bodies)
    fn.__doc__ = doc
    return fn


ln_one_pass_variance_in_input_dtype = _variant(
    "layer_norm",
    "Forward var = E[x^2] - E[x]^2 in the input dtype: cancellation for rows with a large mean.",
    forward_body=_one_pass_variance_in_input_dtype_forward,
)
ln_eps_outside_sqrt = _variant(
    "layer_norm",
    "Forward rstd = 1 / (sqrt(var) + eps) instead of rsqrt(var + eps).",
    forward_body=_eps_outside_sqrt_forward,
)
ln_backward_missing_rstd = _variant(
    "layer_norm",
    "Backward dx misses the final rstd factor.",
    backward_body=_missing_rstd_backward,
)
ln_backward_missing_projection = _variant(
    "layer_norm",
    "Backward dx drops the xhat * mean(gs * xhat) term.",
    backward_body=_missing_projection_backward,
)
rms_eps_outside_sqrt = _variant(
    "rms_norm",
    "Forward rstd = 1 / (sqrt(mean(x^2)) + eps) instead of rsqrt(mean(x^2) + eps).",
    forward_body=_eps_outside_sqrt_forward,
)
rms_backward_missing_rstd = _variant(
    "rms_norm",
    "Backward dx misses the final rstd factor.",
    backward_body=_missing_rstd_backward,
)
ln_unmasked_padding = _variant(
    "layer_norm",
    "Forward statistics sum over the padding columns unmasked (garbage/NaN when D is not a power of two).",
    forward_body=_unmasked_padding_forward,
)
ln_dscale_drops_last_row_block = _variant(
    "layer_norm",
    "The last row block's dscale partial sum is dropped (visible only when rows > block_rows).",
    backward_body=_dscale_drops_last_row_block_backward,
)

ln_one_pass_variance = _variant(
    "layer_norm",
    "Layer norm with var = E[x^2] - E[x]^2 in f32 (within its own one-pass bound).",
    forward_body=_one_pass_variance_forward,
)

_BROKEN = {
    "ln_one_pass_variance_in_input_dtype": ln_one_pass_variance_in_input_dtype,
    "ln_eps_outside_sqrt": ln_eps_outside_sqrt,
    "ln_backward_missing_rstd": ln_backward_missing_rstd,
    "ln_backward_missing_projection": ln_backward_missing_projection,
    "rms_eps_outside_sqrt": rms_eps_outside_sqrt,
    "rms_backward_missing_rstd": rms_backward_missing_rstd,
    "ln_unmasked_padding": ln_unmasked_padding,
    "ln_dscale_drops_last_row_block": ln_dscale_drops_last_row_block,
}
# E[x^2] - E[x]^2 accumulated in f32 is the real kernel's precision class for f32
# input; in bf16/f16 it cancels catastrophically.
_DTYPES = {"ln_one_pass_variance_in_input_dtype": ("bfloat16", "float16")}
EXAMPLES = 30

# Variants that are wrong only on some inputs draw from those inputs (every example
# that cannot show the bug costs a full set of checks): dscale exists only with a
# scale, and a dropped last row block shows only with more than one row.
_ONLY = {"ln_dscale_drops_last_row_block": lambda case: "scale" in case.arrays and case.arrays["x"][..., 0].size > 1}


def _spec(name: str, fn: Callable) -> KernelSpec:
    spec = make_spec(fn.kind, fn, name=f"{fn.kind}[{name}]")
    if name in _ONLY:
        base = spec.cases
        spec = dataclasses.replace(spec, cases=lambda dtype, backend: base(dtype, backend).filter(_ONLY[name]))
    return spec


def _one_pass_spec() -> KernelSpec:
    """The one-pass layer norm with the bounds of its own arithmetic (what its author
    would derive) and layer norm's accuracy contract, on rows moved as far from 0 as
    its own bound allows (``_rows_moved_to_the_one_pass_limit``)."""
    spec = make_spec("layer_norm", ln_one_pass_variance, name="layer_norm[one_pass_variance]")

    def bound(case, ref, config, arith):
        compute = np.float32 if config is not None else case.arrays["x"].dtype
        return norms_oracle.bound(
            ref, out_dtype=case.arrays["x"].dtype, arith=arith, compute_dtype=compute, variance="one_pass"
        ).reshape(case.arrays["x"].shape)

    def gradient_bound(case, ref, grads, config, arith):
        x = case.arrays["x"]
        bounds = norms_oracle.gradient_bound(
            ref,
            case.arrays["cotangent"],
            x_dtype=x.dtype,
            param_dtype=x.dtype,
            block_rows=config.block_rows,
            arith=arith,
            with_offset=True,
            variance="one_pass",
        )
        bounds["dx"] = bounds["dx"].reshape(x.shape)
        return bounds

    return dataclasses.replace(
        spec,
        bound=bound,
        gradients=dataclasses.replace(spec.gradients, bound=gradient_bound),
        cases=lambda dtype, backend: norms_cases("layer_norm", dtype, backend, domain=Domain(x_kinds=("normal",))).map(
            _rows_moved_to_the_one_pass_limit
        ),
    )


def _rows_moved_to_the_one_pass_limit(case):
    """Each row of x moved by c times its standard deviation, |c| in [r / 2, r] with
    r = sqrt(1 / (2 (D + 3) u)), u = 2^-24. The one-pass variance errs by at most
    gamma_{D+3} E[x^2] ~ (D + 3) u (1 + c^2) var <= var / 2 there, so it stays positive
    and the variant returns numbers within its own bound, while the two-pass contract
    allows only ~(D + 3) u |c| var. Measured (seed 0, 12 cases): 0.004-0.10 of its own
    bound, 1.6-354x its contract where D > 1 (the shorter the row, the more; one
    D = 100 case at 0.21), 0 where D = 1 (no variance)."""
    x = case.arrays["x"]
    rows = x.astype(np.float64).reshape(-1, x.shape[-1])
    d = rows.shape[1]
    rng = np.random.default_rng(rows.size)
    limit = np.sqrt(1.0 / (2.0 * (d + 3) * 2.0**-24))
    c = rng.choice([-1.0, 1.0], (len(rows), 1)) * rng.uniform(limit / 2, limit, (len(rows), 1))
    std = rows.std(axis=1, keepdims=True)
    moved = rows + c * np.where(std > 0, std, 1.0)
    return dataclasses.replace(case, arrays={**case.arrays, "x": moved.reshape(x.shape).astype(x.dtype)})


# Variants whose implementation bound holds: only the accuracy contract (and the
# relations stated within it) can catch them (tests/test_sensitivity.py shows both).
CONTRACT_ONLY = ("ln_one_pass_variance",)
VARIANTS = {name: (_spec(name, fn), _DTYPES.get(name, DTYPES), EXAMPLES) for name, fn in _BROKEN.items()}
VARIANTS["ln_one_pass_variance"] = (_one_pass_spec(), ("float32",), 4)
