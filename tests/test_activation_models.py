"""Tests of the activation constants (oracles/activations.py) and of the f32
accuracy they assume, against the f32 kernels (kernels/activations.py) run by
XLA:CPU and against float64 derivatives computed by jax autodiff.

"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
import scipy.special
from jax import lax

from pallascheck.kernels.activations import ACTIVATIONS
from pallascheck.kernels.compat import float64_enabled
from pallascheck.oracles import tolerance
from pallascheck.oracles.activations import ACTIVATION_MODELS, activation_model

U32 = tolerance.unit_roundoff(np.float32)
T32 = tolerance.CPU.transcendental_rel(np.float32)
TINY32 = tolerance.smallest_normal(np.float32)
CPU_DEVICE = jax.devices("cpu")[0]

GRID = np.linspace(-20.0, 20.0, 2_000_001)  # spacing h = 2e-5
H = 2e-5
# beyond the grid every f' and f'' tends monotonically to its limit; probe it anyway
TAIL = np.concatenate([np.geomspace(20.0, 1e6, 2000), -np.geomspace(20.0, 1e6, 2000)])


def _derivatives64(fn, z: np.ndarray, orders=(1, 2)) -> dict[int, np.ndarray]:
    """f', f'' (or other orders) of the float64 model function by jax autodiff, elementwise."""
    out = {}
    with float64_enabled(), jax.default_device(CPU_DEVICE):
        zz = jnp.asarray(z, jnp.float64)
        g = fn
        for k in range(1, max(orders) + 1):
            g = jax.grad(g)
            if k in orders:
                out[k] = np.asarray(jax.jit(jax.vmap(g))(zz), np.float64)
    return out


def test_activation_lookup():
    assert set(ACTIVATION_MODELS) == set(ACTIVATIONS)
    with pytest.raises(ValueError, match="activation must be one of"):
        activation_model("swish")


def _sup_abs(fn, k: int, on_grid: np.ndarray) -> float:
    """sup |f^(k)| over [-20, 20]: the sup lies within h/2 of a local maximum of
    the grid values; each near-top grid maximum is refined by a bounded scalar
    maximisation over [z - h, z + h] (so a sup between grid points is found)."""
    a = np.abs(on_grid)
    is_peak = (a >= np.roll(a, 1)) & (a >= np.roll(a, -1)) & (a >= a.max() * (1 - 1e-3))
    candidates = np.flatnonzero(is_peak)
    candidates = candidates[np.argsort(-a[candidates], kind="stable")][:16]
    with float64_enabled(), jax.default_device(CPU_DEVICE):
        g = fn
        for _ in range(k):
            g = jax.grad(g)
        g = jax.jit(g)
        best = float(a.max())
        for i in candidates:
            res = scipy.optimize.minimize_scalar(
                lambda z: -abs(float(g(jnp.float64(z)))),
                bounds=(GRID[i] - H, GRID[i] + H),
                method="bounded",
                options={"xatol": 1e-12},
            )
            best = max(best, -float(res.fun))
    return best


# float64 evaluation of f^(k) errs by a few ulps: a constant equal to the exact sup
# (sigmoid' and silu'' peak at exactly 0.25 and 0.5) must not fail on that alone.
F64_SLACK = 1 + 2.0**-50


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_lipschitz_and_curvature_on_dense_grid(name):
    """max|f'| <= lipschitz and max|f''| <= curvature, derivatives by float64
    autodiff of the model function on a grid of spacing 2e-5 over [-20, 20], the
    peaks refined between grid points, and a geometric probe of the tails."""
    model = ACTIVATION_MODELS[name]
    d = _derivatives64(model.fn, GRID, orders=(1, 2))
    tail = _derivatives64(model.fn, TAIL, orders=(1, 2))
    assert np.all(np.isfinite(d[1])) and np.all(np.isfinite(d[2]))
    sup1 = _sup_abs(model.fn, 1, d[1])
    assert sup1 <= model.lipschitz * F64_SLACK, f"{name}: max|f'| = {sup1!r} > lipschitz {model.lipschitz}"
    assert np.abs(tail[1]).max() <= model.lipschitz
    if np.isfinite(model.curvature):
        sup2 = _sup_abs(model.fn, 2, d[2])
        assert sup2 <= model.curvature * F64_SLACK, f"{name}: max|f''| = {sup2!r} > curvature {model.curvature}"
        assert np.abs(tail[2]).max() <= model.curvature
    else:  # relu: f' jumps at 0
        assert name == "relu"


def _eval_points() -> np.ndarray:
    """Exact f32 inputs: the grid subsampled, plus magnitudes from 1e-30 to 1e4."""
    mags = np.geomspace(1e-30, 1e4, 4000)
    return np.unique(np.concatenate([GRID[::5], mags, -mags, [0.0]]).astype(np.float32))


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_evaluation_error_of_f32_kernel(name):
    """|f32 kernel activation(z) - f(z)| <= evaluation_error(|z|, u32, t) for exact
    f32 inputs z (the error before any rounding to a lower output dtype)."""
    model = ACTIVATION_MODELS[name]
    z32 = _eval_points()
    with jax.default_device(CPU_DEVICE):
        got = np.asarray(jax.jit(ACTIVATIONS[name])(jnp.asarray(z32)), np.float64)
    z = z32.astype(np.float64)
    err = np.abs(got - model.fn(z))
    bound = np.broadcast_to(model.evaluation_error(np.abs(z), U32, T32), z.shape)
    bad = err > bound
    assert not bad.any(), f"{name}: {bad.sum()} points over; worst z={z[bad][np.argmax((err - bound)[bad])]!r}"
    ratio = np.max(np.where(bound > 0, err / np.where(bound > 0, bound, 1), 0.0))
    assert ratio <= 1.0, ratio


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu"])
def test_evaluation_error_near_underflow(name):
    model = ACTIVATION_MODELS[name]
    z32 = np.array([1.5 * TINY32, -1.5 * TINY32, 3 * TINY32], np.float32)
    with jax.default_device(CPU_DEVICE):
        got = np.asarray(jax.jit(ACTIVATIONS[name])(jnp.asarray(z32)), np.float64)
    z = z32.astype(np.float64)
    err = np.abs(got - model.fn(z))
    bound = model.evaluation_error(np.abs(z), U32, T32)
    assert np.all(err <= bound), (z, got, model.fn(z), err, bound)


@pytest.mark.parametrize(
    "name",
    [n for n in sorted(ACTIVATIONS)],
)
def test_derivative_error_of_f32_autodiff(name):
    """|f'(z) computed by jax autodiff of the f32 kernel activation (what the matmul
    backward pass does) - f'(z) in float64| <= derivative_error(u32, t)."""
    model = ACTIVATION_MODELS[name]
    z32 = _eval_points()
    with jax.default_device(CPU_DEVICE):
        got = np.asarray(jax.jit(jax.vmap(jax.grad(ACTIVATIONS[name])))(jnp.asarray(z32)), np.float64)
    exact = _derivatives64(model.fn, z32.astype(np.float64), orders=(1,))[1]
    err = np.abs(got - exact)
    bound = model.derivative_error(U32, T32)
    i = int(np.argmax(err))
    assert err[i] <= bound, f"{name}: z={float(z32[i])!r} error {err[i]!r} > {bound!r} (ratio {err[i] / bound:.3g})"


TRANSCENDENTALS = {  # name: (f32 function, float64 reference, f32 inputs)
    "exp": (jnp.exp, np.exp, np.linspace(-87, 88, 1_000_001)),
    "tanh": (jnp.tanh, np.tanh, np.concatenate([np.linspace(-10, 10, 1_000_001), np.geomspace(1e-30, 1, 200_000)])),
    "erf": (
        lax.erf,
        scipy.special.erf,
        np.concatenate([np.linspace(-6, 6, 1_000_001), np.geomspace(1e-30, 1, 200_000)]),
    ),
    "log": (jnp.log, np.log, np.geomspace(1e-37, 1e38, 1_000_001)),
    "rsqrt": (lax.rsqrt, lambda x: 1 / np.sqrt(x), np.geomspace(1e-37, 1e38, 1_000_001)),
}


@pytest.mark.parametrize(
    "name",
    [n for n in TRANSCENDENTALS],
)
def test_transcendental_accuracy_on_xla_cpu(name):
    """Arithmetic.transcendental_rel: XLA:CPU f32 exp/log/erf/tanh/rsqrt are within
    t = 2 ulp = 4u relative of the exact value (for normal results)."""
    fn, ref, x = TRANSCENDENTALS[name]
    x32 = np.unique(x.astype(np.float32))
    with jax.default_device(CPU_DEVICE):
        got = np.asarray(jax.jit(fn)(jnp.asarray(x32)), np.float64)
    exact = ref(x32.astype(np.float64))
    normal = np.isfinite(exact) & (np.abs(exact) >= TINY32) & (np.abs(exact) <= float(np.finfo(np.float32).max))
    rel = np.abs(got - exact)[normal] / np.abs(exact[normal])
    i = int(np.argmax(rel))
    assert rel[i] <= T32, f"{name}: x={float(x32[normal][i])!r} relative error {rel[i] / U32:.3f} u > t = {T32 / U32} u"
