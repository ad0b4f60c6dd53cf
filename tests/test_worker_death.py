"""A verify worker that dies with no report of why (a crash, or the host's
out-of-memory killer) takes no other unit with it: the units the broken pool held run
again one worker at a time, and only the unit that kills its worker alone is booked,
as a crash that says what can kill a worker (fuzz/verify.py, ``_run_pool``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

USER_MODULE = textwrap.dedent("""
    import functools
    import os
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from pallascheck.specs import from_reference

    def reference(x, y):
        return x * y

    def body(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] * y_ref[...]

    def dying_body(x_ref, y_ref, o_ref):
        os._exit(3)  # the worker dies as the out-of-memory killer would stop it

    def kernel(body):
        @functools.partial(jax.jit, static_argnames="interpret")
        def run(x, y, interpret=False):
            return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, y)
        return run

    FINE = from_reference(kernel(body), reference, name="fine", inputs={"x": (8, 16), "y": (8, 16)}, dtypes=("float32",))
    DIES = from_reference(
        kernel(dying_body), reference, name="dies", inputs={"x": (8, 16), "y": (8, 16)}, dtypes=("float32",)
    )
""")


def test_a_worker_that_dies_takes_only_its_own_unit_down(tmp_path: Path) -> None:
    (tmp_path / "specs_dir").mkdir()
    (tmp_path / "specs_dir" / "my_specs.py").write_text(USER_MODULE)
    pallascheck = Path(sys.executable).with_name("pallascheck")
    args = [str(pallascheck), "verify", "--path", "specs_dir", "--kernel", "my_specs:DIES", "--kernel"]
    args += ["my_specs:FINE", "--examples", "1", "--jobs", "2", "--json", "out.json"]
    env = dict(os.environ, PALLASCHECK_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "they run again, one worker at a time" in done.stderr, done.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    fine = [r for r in result["rows"] if r["kernel"] == "my_specs:FINE" and r["verdict"] != "not checked"]
    assert {r["check"] for r in fine} >= {"values", "deterministic"} and all(r["passed"] for r in fine), fine
    crashed = [r for r in result["rows"] if r["check"] == "crash"]
    assert [r["kernel"] for r in crashed] == ["my_specs:DIES"], crashed
    assert result["failures"] == [
        "a verify worker process died while this unit ran alone in it: the kernel or XLA crashed it, or the "
        "host's out-of-memory killer stopped it (the system log says which)"
    ]
