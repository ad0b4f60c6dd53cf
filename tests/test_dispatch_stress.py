"""``pallascheck bench --dispatch-stress``: a kernel called from several threads at
once gives the bits it gives alone, or the command counts the calls that do not."""

from __future__ import annotations

import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

from pallascheck import cli
from pallascheck.bench import dispatch_stress
from pallascheck.kernels.backends import Backend
from pallascheck.properties.spec import Case
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

    return from_reference(
        kernel,
        lambda x: x * jax.nn.sigmoid(x),
        name="silu",
        inputs={"x": (8, 32)},
        dtypes=("float32",),
        differentiable=False,
    )


def test_calls_that_change_under_concurrency_are_counted() -> None:
    # right, except every 7th call, negated (every element's sign bit flips, zeros and
    # NaNs too, whatever input kind the case drew): the calls alone (one per case) are right
    spec = _scaled_silu(-1.0 if n % 7 == 6 else 1.0 for n in itertools.count())
    result = dispatch_stress.run(
        spec, Backend("interpret"), dtype="float32", cases=2, seconds=1.0, threads=2, shapes="small"
    )
    calls, bad = result["calls"]["forward"], result["mismatches"]["forward"]
    assert calls > 20 and 0 < bad < calls, result
    assert "256 elements differ from its bits alone; nearest: " in result["notes"][0]


def test_a_wrong_call_is_traced_to_the_inputs_whose_output_it_is() -> None:
    rng = np.random.default_rng(0)
    drawn = [Case({"x": rng.standard_normal(6), "w": rng.standard_normal(6)}, {}) for _ in range(3)]

    def product(case: Case) -> dict[str, np.ndarray]:
        return {"out": case.arrays["x"] * case.arrays["w"], "sum": np.sum(case.arrays["x"])}

    wanted = {("forward", i): product(c) for i, c in enumerate(drawn)}

    def trace(got: dict[str, np.ndarray], i: int) -> str:
        return dispatch_stress._trace(got, "forward", i, drawn, wanted, product)

    # handed another call's buffers: that call's output, exactly
    assert trace(wanted["forward", 2], 0) == "; they are case 2's bits alone, exactly"
    # one input from another call's transfer
    assert trace(product(Case({"x": drawn[0].arrays["x"], "w": drawn[1].arrays["w"]}, {})), 0) == (
        "; they are the bits of case 0 with its w from case 1, exactly"
    )
    # neither: the nearest candidate, and by how much (every element of out and the sum)
    assert trace({"out": np.zeros(6), "sum": np.float64(0)}, 1).endswith(", which differs in 7")
    assert dispatch_stress._trace(wanted["forward", 0], "forward", 0, drawn[:1], wanted, product) == ""


def test_a_deterministic_kernel_gives_no_mismatch_and_the_command_says_so(capsys) -> None:
    spec = _scaled_silu(itertools.repeat(1.0))
    result = dispatch_stress.run(
        spec, Backend("interpret"), dtype="float32", cases=2, seconds=0.5, threads=2, shapes="small", inputs="device"
    )
    assert result["calls"]["forward"] > 0 and result["mismatches"] == {"forward": 0, "oracle": 0}
    argv = [
        "bench",
        "--dispatch-stress",
        "rms_norm",
        "--backend",
        "interpret",
        "--dtype",
        "float32",
        "--seconds",
        "1",
        "--threads",
        "2",
        "--cases",
        "2",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "whose bits differ from the call alone" in out and "oracle:" in out
    with pytest.raises(SystemExit, match="threads must be >= 1"):
        cli.main(argv[:-4] + ["--threads", "0"])
    with pytest.raises(SystemExit, match="cases must be >= 1"):
        cli.main(argv[:-2] + ["--cases", "0"])
    with pytest.raises(ValueError, match="inputs must be one of placed, host, device, got 'pinned'"):
        dispatch_stress.run(spec, Backend("interpret"), dtype="float32", inputs="pinned")
