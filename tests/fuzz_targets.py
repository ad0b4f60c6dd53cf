"""Kernels that misbehave the ways a fuzz campaign must survive, for tests/test_fuzz_campaign.py.

Each is a plain jnp relu checked with the elementwise spec builder (no Pallas, so
the ``interpret`` keyword the builder passes is unused: these test the campaign,
not a kernel), broken one way: it hangs, aborts the
process, allocates without bound, or is wrong at the first element (a value
failure whose worst element is the same at every shape: one signature).
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


SOUND = _spec(_relu, "relu")
HANGS = _spec(_hangs, "relu_that_hangs")
ABORTS = _spec(_aborts, "relu_that_aborts")
HOARDS = _spec(_hoards, "relu_that_hoards_memory")
WRONG_FIRST_ELEMENT = _spec(_wrong_first_element, "relu_wrong_at_first_element")


def _crash_or_wrong(x, interpret=None):
    if x.size > 64:  # two bugs: shrinking the crash's input reaches the wrong value
        raise RuntimeError("kernel crashed on a large input")
    return _wrong_first_element(x)


CRASH_OR_WRONG = _spec(_crash_or_wrong, "relu_that_crashes_or_is_wrong")


_calls = [0]


def _wrong_then_slow(x, interpret=None):
    """Wrong at the first element; every call after the first takes 6 s (under the
    10 s case limit), so shrinking the first failure outlasts a campaign's time."""
    _calls[0] += 1
    if _calls[0] > 1:
        time.sleep(6)
    return _wrong_first_element(x)


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
