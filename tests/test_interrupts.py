"""Commands stopped before their end by SIGTERM (``timeout``, a batch system) end as
Ctrl-C ends them (``cli._common.terminate_as_interrupt``). A verify run prints the
verdict of the units that finished, lists the unfinished ones under NOT CHECKED, stops
its workers and exits 130; the same command with ``--resume`` then runs only the
unfinished units (fuzz/verify.py, ``Interrupted``). A fuzz campaign ends as
interrupted, keeping what it found."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

USER_MODULE = textwrap.dedent("""
    import functools
    import glob
    import os
    import signal
    import time
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from pallascheck.specs import from_reference

    def reference(x, y):
        return x * y

    def body(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] * y_ref[...]

    @functools.partial(jax.jit, static_argnames="interpret")
    def multiply(x, y, interpret=False):
        return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, y)

    def stopping(x, y, interpret=False):
        # Once FINE's property is journaled as finished, stop the verify run as
        # `timeout` would, and stay in flight like a long unit.
        if os.environ.get("STOP_THE_RUN"):
            while not any('"values"' in open(p).read() for p in glob.glob(".pallascheck/verify-runs/*.jsonl")):
                time.sleep(0.1)
            with open("stopper.pid", "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(3600)
        return multiply(x, y, interpret=interpret)

    FINE = from_reference(multiply, reference, name="fine", inputs={"x": (8, 16), "y": (8, 16)}, dtypes=("float32",))
    STOPS = from_reference(
        stopping, reference, name="stops", inputs={"x": (8, 16), "y": (8, 16)}, dtypes=("float32",)
    )
""")


def test_an_interrupted_run_prints_and_keeps_what_finished_and_resume_runs_the_rest(tmp_path: Path) -> None:
    (tmp_path / "specs_dir").mkdir()
    (tmp_path / "specs_dir" / "my_specs.py").write_text(USER_MODULE)
    pallascheck = Path(sys.executable).with_name("pallascheck")
    args = [str(pallascheck), "verify", "--path", "specs_dir", "--kernel", "my_specs:STOPS", "--kernel"]
    args += ["my_specs:FINE", "--examples", "1", "--json", "out.json"]
    env = dict(os.environ, PALLASCHECK_CACHE_DIR=str(tmp_path / "cache"))

    stopped = subprocess.run(
        [*args, "--jobs", "2"],
        cwd=tmp_path,
        env=dict(env, STOP_THE_RUN="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert stopped.returncode == 130, stopped.stdout + stopped.stderr
    # STOPS' property unfinished; its bad-input unit may have ended before the stop or not
    assert re.search(r"INTERRUPTED with [12] of 4 units unfinished \(under NOT CHECKED\)", stopped.stdout), (
        stopped.stdout
    )
    assert "my_specs:FINE float32 property: passed in" in stopped.stderr, stopped.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["interrupted"] and not result["complete"]
    fine = [r for r in result["rows"] if r["kernel"] == "my_specs:FINE" and r["verdict"] != "not checked"]
    assert {r["check"] for r in fine} >= {"values", "deterministic"} and all(r["passed"] for r in fine), fine
    assert {(n["kernel"], n["why"]) for n in result["not_checked"]} >= {
        ("my_specs:STOPS", "property: interrupted before it ended")
    }, result["not_checked"]

    # the worker left in flight was stopped with the run
    in_flight = int((tmp_path / "stopper.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(in_flight, 0)

    resumed = subprocess.run([*args, "--jobs", "1", "--resume"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "my_specs:FINE float32 property: passed in" in resumed.stderr and "(an earlier run's, --resume)" in (
        resumed.stderr
    ), resumed.stderr
    assert "my_specs:STOPS float32 property: passed in" in resumed.stderr, resumed.stderr
    result = json.loads((tmp_path / "out.json").read_text())
    assert not result["interrupted"] and {r["kernel"] for r in result["rows"]} == {"my_specs:FINE", "my_specs:STOPS"}


def _terminated_once(args: list[str], cwd: Path, ready: Callable[[], bool]) -> tuple[int, str, str]:
    """Run the command ``args`` in ``cwd`` (its own compilation cache), send it SIGTERM
    as `timeout` would once ``ready()`` holds (a state of the run, never a clock), and
    return its exit status, stdout and stderr."""
    env = dict(os.environ, PALLASCHECK_CACHE_DIR=str(cwd / "cache"))
    driver = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not ready():
            assert driver.poll() is None, driver.communicate()
            time.sleep(0.2)
        driver.send_signal(signal.SIGTERM)
        out, err = driver.communicate(timeout=120)
    finally:
        driver.kill()
    return driver.returncode, out, err


def test_a_campaign_stopped_by_sigterm_ends_as_interrupted_keeping_what_it_found(tmp_path: Path) -> None:
    from pallascheck.fuzz import corpus

    tests = os.path.dirname(os.path.abspath(__file__))
    pallascheck = Path(sys.executable).with_name("pallascheck")
    args = [str(pallascheck), "fuzz", "--path", tests, "--kernel", "fuzz_targets:WRONG_FIRST_ELEMENT", "--dtype"]
    args += ["float32", "--minutes", "10", "--jobs", "1", "--corpus", str(tmp_path / "corpus")]
    # once the corpus holds a finding: the campaign's progress, not the clock's
    returncode, out, err = _terminated_once(
        args, tmp_path, lambda: bool(corpus.Corpus(str(tmp_path / "corpus")).failures())
    )
    assert re.search(r"\ninterrupted: 1 tasks, \d+ cases in \d+ s; [1-9]\d* new findings", out), out + err
    # a task in flight (the worker may be between two) is said to be stopped by the interrupt
    assert "after the time given" not in out, out
    assert returncode is not None and corpus.Corpus(str(tmp_path / "corpus")).failures()


def test_a_mutation_run_stopped_by_sigterm_keeps_its_outcomes_and_says_what_did_not_run(tmp_path: Path) -> None:
    """rms_norm's five statistics mutants (tests/test_mutate.py), one at a time: SIGTERM
    once the first outcome is written ends the run as Ctrl-C does, exit 130, the
    outcome kept in --out and the rest listed as not run (interrupted)."""
    pallascheck = Path(sys.executable).with_name("pallascheck")
    out = tmp_path / "mutants.jsonl"
    args = [str(pallascheck), "mutate", "--kernel", "rms_norm", "--dtype", "float32", "--examples", "1", "--jobs", "1"]
    args += ["--operator", "rescale", "--function", "rms_statistics|layer_norm_statistics", "--out", str(out)]

    def mutants_written() -> list[dict]:
        lines = out.read_text().splitlines() if out.exists() else []
        return [r for r in (json.loads(line) for line in lines if line.endswith("}")) if r["kind"] == "mutant"]

    returncode, printed, err = _terminated_once(args, tmp_path, lambda: bool(mutants_written()))  # the first outcome
    assert returncode == 130, printed + err
    kept = mutants_written()
    assert kept and len(kept) < 5, kept
    assert " - interrupted" in printed and "not run (interrupted): #" in printed, printed
