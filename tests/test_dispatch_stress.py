"""``pallascheck bench --dispatch-stress``: a kernel called from several threads at
once gives the bits it gives alone, or the command counts the calls that do not."""
from __future__ import annotations

import itertools
import threading

import jax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np
import pytest

from pallascheck.bench import dispatch_stress
from pallascheck.fuzz import cli
from pallascheck.kernels.backends import Backend
from pallascheck.specs import from_reference


def _scaled_silu(scales) -> object:
    """silu times ``next(scales)``, read from the host at every call."""
    lock = threading.Lock()

    def factor() -> np.float32:
        with lock:
            return np.float32(next(scales))

    def kernel(x, interpret=False):
        scale = io_callback(factor, jax.ShapeDtypeStruct((), jnp.float32))
        return x * jax.nn.sigmoid(x) * scale

    return from_reference(kernel, lambda x: x * jax.nn.sigmoid(x), name="silu", inputs={"x": (8, 32)},
                          dtypes=("float32",), differentiable=False)


def test_calls_that_change_under_concurrency_are_counted() -> None:
    # right, except every 7th call, negated (every element's sign bit flips, zeros and
    # NaNs too, whatever input kind the case drew): the calls alone (one per case) are right
    spec = _scaled_silu(-1.0 if n % 7 == 6 else 1.0 for n in itertools.count())
    result = dispatch_stress.run(spec, Backend("interpret"), dtype="float32", cases=2, seconds=1.0, threads=2,
                                 shapes="small")
    calls, bad = result["calls"]["forward"], result["mismatches"]["forward"]
    assert calls > 20 and 0 < bad < calls, result
    assert "256 elements differ from its bits alone; the nearest other case, " in result["notes"][0]


def test_a_wrong_call_is_traced_to_the_case_whose_bits_it_returned() -> None:
    # a call handed another case's buffers returns that case's output exactly
    alone = {0: np.array([[-1.0, -1.0, -1.0], [0.0, 1.0, 2.0]]), 1: np.ones((2, 3)), 2: -np.ones((2, 3))}
    assert dispatch_stress._whose(alone[2], {0: alone[0], 1: alone[1]}) == "; the nearest other case, 0, differs in 3"
    wrong = {"out": alone[1], "grad": alone[1][0]}
    others = {j: {"out": a, "grad": a[0]} for j, a in alone.items() if j != 2}
    assert dispatch_stress._whose(wrong, others) == "; they are case 1's bits alone, exactly"
    assert dispatch_stress._whose(alone[0], {}) == ""


def test_a_deterministic_kernel_gives_no_mismatch_and_the_command_says_so(capsys) -> None:
    spec = _scaled_silu(itertools.repeat(1.0))
    result = dispatch_stress.run(spec, Backend("interpret"), dtype="float32", cases=2, seconds=0.5, threads=2,
                                 shapes="small", device_inputs=True)
    assert result["calls"]["forward"] > 0 and result["mismatches"] == {"forward": 0, "oracle": 0}
    argv = ["bench", "--dispatch-stress", "rms_norm", "--backend", "interpret", "--dtype", "float32",
            "--seconds", "1", "--threads", "2", "--cases", "2"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "whose bits differ from the call alone" in out and "oracle:" in out
    with pytest.raises(SystemExit, match="threads must be >= 1"):
        cli.main(argv[:-4] + ["--threads", "0"])
    with pytest.raises(SystemExit, match="cases must be >= 1"):
        cli.main(argv[:-2] + ["--cases", "0"])
