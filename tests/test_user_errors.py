"""Errors a user can act on: each names what to change."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallascheck import cli
from pallascheck.fuzz import targets
from pallascheck.kernels.backends import Backend
from pallascheck.properties import runner
from pallascheck.properties.spec import Case
from pallascheck.specs import elementwise_like


def _forward_only_relu(x, interpret=False):
    def body(x_ref, o_ref):
        o_ref[...] = jnp.maximum(x_ref[...], 0)

    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x)


def test_forward_only_kernel_with_default_differentiable_names_the_option() -> None:
    spec = elementwise_like(
        _forward_only_relu, name="forward_only_relu", activation="relu", dtypes=("float32",), interpret="interpret"
    )
    tally = runner.run_property(spec, "float32", Backend("interpret"), examples=1, selected=("gradients",))
    assert "this kernel has no VJP: pass differentiable=False" in tally.failure, tally.failure
    # the defaults as they are: True for the family builders, False for from_reference
    assert "the family builders' default" in tally.failure and "from_reference's default is False" in tally.failure
    forward_only = elementwise_like(
        _forward_only_relu,
        name="forward_only_relu",
        activation="relu",
        dtypes=("float32",),
        interpret="interpret",
        differentiable=False,
    )
    assert not runner.run_property(forward_only, "float32", Backend("interpret"), examples=1).failure


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_cli_version_description_and_help_for_every_option(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"pallascheck {version('pallascheck')}"
    parser = cli.build_parser()
    assert "``" not in parser.description and ":func:" not in parser.description
    for name, sub in _subparsers(parser).items():
        for action in sub._actions:
            assert action.help, f"pallascheck {name} {action.option_strings or action.dest} has no help"
        text = sub.format_help()
        assert "(default: None)" not in text, name
    fuzz_help = " ".join(_subparsers(parser)["fuzz"].format_help().split())
    assert "(default: 10.0)" in fuzz_help and "(default: .pallascheck/corpus)" in fuzz_help


def test_examples_means_hypothesis_examples_in_every_help() -> None:
    subs = _subparsers(cli.build_parser())
    for name in ("verify", "fuzz"):
        (examples,) = [a for a in subs[name]._actions if "--examples" in a.option_strings]
        assert examples.help.startswith("Hypothesis examples per kernel x dtype"), (name, examples.help)


USER_SPECS = textwrap.dedent("""
    from pallascheck.properties.families.norms import RMS_NORM

    SPEC = RMS_NORM


    def spec():
        return RMS_NORM
""")

# (command line, run in, what the one line on stderr must say): every mistake a user
# makes in the command, each refused with the fix before anything is created. The
# project: specs/my_specs.py (a module with SPEC and a function spec), some.py, not.npz
# (arrays, no failure record) and saved.npz (a case of my_specs:SPEC saved by verify).
MISTAKES = [
    ("verify --kernel my_specs:SPEC", ".", "--kernel my_specs:SPEC: no module 'my_specs' on the import path"),
    ("verify --kernel my_specs:SPEC", ".", "add --path DIR, the directory that holds my_specs.py"),
    ("fuzz --kernel my_specs:SPEC", ".", "add --path DIR, the directory that holds my_specs.py"),
    ("verify --path specs --kernel my_specs:NOPE", ".", "has no KernelSpec 'NOPE': did you mean 'SPEC'?"),
    # the current directory is importable without --path: the module is found, the name is not
    ("verify --kernel my_specs:SPCE", "specs", "has no KernelSpec 'SPCE': did you mean 'SPEC'?"),
    ("verify --path specs --kernel my_specs:spec", ".", "'spec' is a function, not a KernelSpec"),
    ("fuzz --path specs --kernel my_specs:NOPE", ".", "did you mean 'SPEC'?"),
    ("verify --kernel matmull", ".", "--kernel: no kernel named 'matmull': did you mean 'matmul'"),
    ("fuzz --kernel matmull --corpus corpus", ".", "--kernel: no kernel named 'matmull': did you mean 'matmul'"),
    ("verify --backend cuda", ".", "--backend 'cuda' is not a backend: known: interpret"),
    ("fuzz --backend mosaic_gpuu", ".", "--backend 'mosaic_gpuu' is not a backend: did you mean 'mosaic_gpu'"),
    ("verify --kernel rms_norm --dtype float33", ".", "--dtype 'float33' matches no selected kernel"),
    ("verify --examples 0", ".", "argument --examples: must be >= 1, got 0"),
    ("fuzz --examples 0", ".", "argument --examples: must be >= 1, got 0"),
    ("verify --jobs 0", ".", "argument --jobs: must be >= 1, got 0 (leave --jobs out for the default)"),
    ("fuzz --jobs 0", ".", "argument --jobs: must be >= 1, got 0 (leave --jobs out for the default)"),
    ("fuzz --jobs -1", ".", "argument --jobs: must be >= 1, got -1"),
    ("fuzz --minutes 0", ".", "argument --minutes: must be > 0, got 0"),
    ("fuzz --minutes -5", ".", "argument --minutes: must be > 0, got -5"),
    ("fuzz --cases 0", ".", "argument --cases: must be >= 1, got 0"),
    ("verify --case-timeout 0", ".", "argument --case-timeout: must be > 0, got 0"),
    ("replay nonexistent.npz", ".", "replay FILE 'nonexistent.npz': no such file; give a .npz saved by verify"),
    ("replay some.py", ".", "replay FILE 'some.py' is not a saved case: give a .npz saved by verify"),
    ("replay not.npz", ".", "replay FILE 'not.npz' is not a saved case"),
    ("replay saved.npz", ".", "the case's kernel my_specs:SPEC: no module 'my_specs' on the import path"),
    ("replay saved.npz --repeat 0", ".", "argument --repeat: must be >= 1, got 0"),
    ("replay", ".", "the following arguments are required: FILE (see pallascheck replay --help)"),
]


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's project; sys.path and sys.modules are restored after each command."""
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "my_specs.py").write_text(USER_SPECS)
    (tmp_path / "some.py").write_text("x = 1\n")
    np.savez(tmp_path / "not.npz", x=np.zeros(3))
    meta = {"kernel": "my_specs:SPEC", "dtype": "float32", "backend": "interpret", "check": "values", "config": None}
    Case({"x": np.zeros((2, 8), np.float32)}, {"__failure__": meta}).save(str(tmp_path / "saved.npz"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_specs", raising=False)
    yield tmp_path
    sys.modules.pop("my_specs", None)


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("command,where,fix", MISTAKES, ids=[f"{c} [{f[:40]}]" for c, _, f in MISTAKES])
def test_a_mistake_ends_in_one_line_naming_the_fix_exit_2_and_nothing_created(
    command: str, where: str, fix: str, project: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.chdir(project / where)
    before = _tree(project)
    with pytest.raises(SystemExit) as exit_:
        cli.main(shlex.split(command))
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, (exit_.value.code, err)
    assert len(err.strip().splitlines()) == 1 and fix in err, err
    assert out == "", out  # refused before any banner
    assert _tree(project) == before  # no .pallascheck, no cache, no corpus


def test_the_console_command_exits_2_with_the_one_line(tmp_path: Path) -> None:
    """The same boundary through the installed script (``sys.exit(main())``)."""
    script = Path(sys.executable).with_name("pallascheck")
    done = subprocess.run(
        [str(script), "replay", "nonexistent.npz"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "pallascheck: replay FILE 'nonexistent.npz': no such file; give a .npz saved by verify (under --failures, "
        "default .pallascheck/failures/) or fuzz (CORPUS/failures/)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_unknown_kernel_with_no_close_match_lists_the_known_ones() -> None:
    message = targets.unknown_name("zzz", ["matmul", "attention"])
    assert message == "no kernel named 'zzz': known kernels: attention, matmul"


def test_without_libcst_only_mutate_is_missing_and_says_what_to_install() -> None:
    """A --no-deps install (a GPU image) may lack libcst: verify and fuzz still run."""
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['libcst'] = None\n"
        "from pallascheck import cli\n"
        "cli.build_parser().parse_args(['verify', '--examples', '1'])\n"
        "cli.main(['mutate', '--kernel', 'matmul'])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "pip install libcst" in done.stderr, done.stderr
