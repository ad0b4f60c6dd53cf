"""A spec from a user's own module runs through ``pallascheck verify``, ``fuzz`` and
the ``replay`` command they print, exactly as printed, in a temporary project
(``--path DIR`` and ``MODULE:NAME``). The module's kernel has a planted bug, so that
each command has a failure to report and replay."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pallascheck.properties import runner

USER_MODULE = textwrap.dedent("""
    import functools
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from pallascheck.specs import Facts, from_reference

    def reference(x, y):
        return x * jax.nn.sigmoid(x) * y

    def body(x_ref, y_ref, o_ref):
        x = x_ref[...].astype(jnp.float32)
        o_ref[...] = (x * jax.nn.sigmoid(x) + y_ref[...]).astype(o_ref.dtype)  # the bug: + instead of *

    @functools.partial(jax.jit, static_argnames="interpret")
    def fused(x, y, interpret=False):
        return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x, y)

    SPEC = from_reference(fused, reference, name="fused", inputs={"x": (8, 16), "y": (8, 16)}, dtypes=("float32",))
""")


def _run(command: str | list[str], cwd: Path) -> subprocess.CompletedProcess:
    args = shlex.split(command) if isinstance(command, str) else command
    pallascheck = Path(sys.executable).with_name("pallascheck")
    if args[0] == "pallascheck":
        args = [str(pallascheck)] + args[1:]
    env = dict(os.environ, PALLASCHECK_CACHE_DIR=str(cwd / "cache"))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("user_project")
    (root / "specs_dir").mkdir()
    (root / "specs_dir" / "my_specs.py").write_text(USER_MODULE)
    return root


def test_verify_runs_a_user_spec_and_its_printed_replays_run_as_printed(project: Path) -> None:
    done = _run("pallascheck verify --path specs_dir --kernel my_specs:SPEC --examples 2 --jobs 1", project)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "FAIL" in out, out[-3000:]
    assert "derived bound: facts" in out, out[-3000:]
    printed = re.search(r"replay: (pallascheck verify .*)", out).group(1)
    again = _run(printed, project)
    assert again.returncode == 1 and "[values] kernel=my_specs:SPEC" in again.stdout, again.stdout[-3000:]
    saved = re.search(r"pallascheck replay FILE( --path \S+)\)", out).group(1)
    case = Path(runner.failure_path(str(project / ".pallascheck" / "failures"), "my_specs:SPEC", "float32", "values"))
    replayed = _run(f"pallascheck replay '{case}'{saved}", project)
    assert replayed.returncode == 1 and "FAIL" in replayed.stdout, replayed.stdout[-3000:] + replayed.stderr[-3000:]
    # the replay prints its own command, --path kept: it runs as printed
    own = re.search(r"replay: (pallascheck replay .*)", replayed.stdout).group(1)
    assert own.endswith(" --path specs_dir"), own
    rerun = _run(own, project)
    assert rerun.returncode == 1 and "FAIL" in rerun.stdout, rerun.stdout[-3000:] + rerun.stderr[-3000:]


def test_fuzz_runs_a_user_spec_and_its_printed_replay_runs_as_printed(project: Path) -> None:
    done = _run(
        "pallascheck fuzz --path specs_dir --kernel my_specs:SPEC --minutes 0.1 --jobs 1 --examples 2 --corpus corpus",
        project,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    printed = re.search(r"replay: (pallascheck replay .*)", out).group(1)
    replayed = _run(printed, project)
    assert replayed.returncode == 1 and "FAIL" in replayed.stdout, replayed.stdout[-3000:] + replayed.stderr[-3000:]


def test_an_installed_package_declares_its_specs_by_entry_point(tmp_path: Path) -> None:
    """A distribution on the path whose entry point (group ``pallascheck.specs``) names a
    module: importing it registers its spec, which ``registry()`` then lists, in a fresh
    interpreter (the registry loads entry points once per process)."""
    package = tmp_path / "site"
    (package / "my_kernels").mkdir(parents=True)
    (package / "my_kernels" / "__init__.py").write_text(
        USER_MODULE + "\nfrom pallascheck.specs import register\nregister(SPEC)\n"
    )
    info = package / "my_kernels-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-kernels\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pallascheck.specs]\nmy_kernels = my_kernels\n")
    code = "from pallascheck.properties.registry import registry; print('fused' in registry())"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(package)),
    )
    assert done.stdout.strip() == "True", done.stdout + done.stderr[-3000:]
