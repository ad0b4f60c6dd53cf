"""Kernels that misbehave the ways a fuzz campaign must survive, for tests/test_fuzz_campaign.py.

Each is a plain jnp relu checked with the elementwise spec builder (no Pallas, so
the ``interpret`` keyword the builder passes is unused: these test the campaign,
not a kernel), broken one way: it hangs, aborts the
process, allocates without bound, or is wrong at the first element (a value
failure whose worst element is the same at every shape: one signature). And the
probe's report of a device whose arithmetic the tolerance model does not describe.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.specs import elementwise_like


def _relu(x, interpret=None):
    return jnp.maximum(x, jnp.zeros((), x.dtype))


def _hangs(x, interpret=None):
    time.sleep(3600)
    return _relu(x)


def _aborts(x, interpret=None):
    os.abort()


def _hoards(x, interpret=None):
    hoard = []
    while True:  # 64 MiB at a time, written so that it is resident
        hoard.append(np.ones(2**26, np.uint8))


def _wrong_first_element(x, interpret=None):
    return _relu(x).at[(0,) * x.ndim].add(jnp.asarray(1.0, x.dtype))


def _spec(fn, name):
    return elementwise_like(
        fn, name=name, activation="relu", dtypes=("float32",), differentiable=False, interpret="interpret"
    )


def _out_of_device_memory(x, interpret=None):
    # what XLA raises when a device refuses an allocation (a GPU shared by processes
    # whose allocator pools together outgrew it)
    raise jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 128.00MiB with allocator GPU_0_bfc on device 0."
    )


SOUND = _spec(_relu, "relu")
OUT_OF_DEVICE_MEMORY = _spec(_out_of_device_memory, "relu_out_of_device_memory")
HANGS = _spec(_hangs, "relu_that_hangs")
ABORTS = _spec(_aborts, "relu_that_aborts")
HOARDS = _spec(_hoards, "relu_that_hoards_memory")
WRONG_FIRST_ELEMENT = _spec(_wrong_first_element, "relu_wrong_at_first_element")


def _crash_or_wrong(x, interpret=None):
    if x.size > 64:  # two bugs: shrinking the crash's input reaches the wrong value
        raise RuntimeError("kernel crashed on a large input")
    return _wrong_first_element(x)


CRASH_OR_WRONG = _spec(_crash_or_wrong, "relu_that_crashes_or_is_wrong")


_first_input: list[bytes] = []


def _wrong_then_slow(x, interpret=None):
    """-1 at the first element, where a relu is never negative: wrong on every input.
    Every call on an input other than the first it was given takes 6 s (under the 10 s
    case limit), so shrinking the first failure outlasts a campaign's time; the calls
    on the first input (its case's and the reruns of its failure, which tell a steady
    failure from an intermittent one) are not slowed, so the failure is found and
    saved at once."""
    seen = str(x.shape).encode() + np.asarray(x).tobytes()
    if not _first_input:
        _first_input.append(seen)
    if seen != _first_input[0]:
        time.sleep(6)
    return _relu(x).at[(0,) * x.ndim].set(-1)


WRONG_THEN_SLOW = _spec(_wrong_then_slow, "relu_wrong_then_slow")


_flaky_calls = [0]


def _relu_on_the_host(x: np.ndarray) -> np.ndarray:
    _flaky_calls[0] += 1
    out = np.maximum(x, 0)
    if _flaky_calls[0] == 1:
        out[(0,) * x.ndim] += 1
    return out


def _wrong_on_its_first_call(x, interpret=None):
    """Wrong on its first run, then right with the same input, compiled or not (the
    host callback runs every time): what state kept between calls or a race looks
    like from outside."""
    return jax.pure_callback(_relu_on_the_host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


WRONG_ON_ITS_FIRST_CALL = _spec(_wrong_on_its_first_call, "relu_wrong_on_its_first_call")


def _slow_relu(x, interpret=None):
    time.sleep(0.3)  # a task of seconds: a node removed mid-campaign has one in flight
    return _relu(x)


SLOW = _spec(_slow_relu, "relu_slowly")
# three verify units that each outlast the removal of a node (tests/test_cluster.py)
SLOW_IN_THREE_DTYPES = elementwise_like(
    _slow_relu,
    name="relu_slowly_in_three_dtypes",
    activation="relu",
    dtypes=("float32", "float16", "bfloat16"),
    differentiable=False,
    interpret="interpret",
)


def _wrong_when_long(x, interpret=None):
    """Wrong at the first element of inputs of 4 elements or more: a campaign's first
    draw (the smallest input) passes, so a run that fails at once replayed a failure."""
    return _wrong_first_element(x) if x.size >= 4 else _relu(x)


WRONG_WHEN_LONG = _spec(_wrong_when_long, "relu_wrong_when_long")


def _machine_memory() -> tuple[int, int]:
    """(total, available) bytes of this machine, as /proc/meminfo and Ray's memory monitor count them."""
    with open("/proc/meminfo") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return fields["MemTotal"], fields["MemAvailable"]


def _swells_past_rays_threshold(x, interpret=None):
    """Touches memory until the machine's use is past the fraction at which the Ray node
    it runs on kills a worker (the RAY_memory_usage_threshold that node was started
    with, which its workers inherit), then waits to be killed; never into the machine's
    last 2 GiB."""
    threshold = float(os.environ["RAY_memory_usage_threshold"])
    hoard = []
    while True:
        total, available = _machine_memory()
        if (total - available) / total > threshold + 0.02 or available < 2 * 2**30:
            break
        hoard.append(np.ones(2**26, np.uint8))  # 64 MiB, written so that it is resident
    time.sleep(3600)
    return _relu(x)


SWELLS = _spec(_swells_past_rays_threshold, "relu_that_swells_past_rays_threshold")


def _short_accumulator_dot(x, y) -> np.ndarray:
    """A dot of the probe's shapes on a device whose accumulator keeps 22 significand
    bits (f32 keeps 24): the exact sums, rounded to nearest at 22 bits."""
    exact = np.asarray(x, np.float64) @ np.asarray(y, np.float64)
    fraction, exponent = np.frexp(exact)
    return np.ldexp(np.round(fraction * 2.0**22) / 2.0**22, exponent)


def probe_of_a_short_accumulator(backend) -> dict:
    """``pallascheck probe``'s report (bench.probe.device_report's format) of a device
    whose accumulator is short: the probe's own measurements and comparison with the
    backend's tolerance model, run on ``_short_accumulator_dot``. No CPU computes this way;
    a campaign's reaction to such a device is tested with it."""
    from pallascheck.bench import probe
    from pallascheck.oracles.tolerance import arithmetic_for

    measured = probe.probe_path(_short_accumulator_dot)
    return {
        "backend": str(backend),
        "device": "cpu",
        "jax_version": jax.__version__,
        "paths": {"emulated": measured},
        "violations": {"emulated": probe.assumption_violations(measured, arithmetic_for(backend))},
    }
