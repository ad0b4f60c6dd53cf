"""Errors a user can act on: each names what to change."""

from __future__ import annotations

import argparse
from importlib.metadata import version

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from pallascheck import cli
from pallascheck.fuzz import targets
from pallascheck.kernels.backends import Backend
from pallascheck.properties import runner
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


@pytest.mark.parametrize("command", ["verify", "fuzz"])
def test_unknown_kernel_lists_close_matches_and_creates_nothing(command, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    argv = [command, "--kernel", "matmull"] + (["--corpus", str(tmp_path / "corpus")] if command == "fuzz" else [])
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert "no kernel named 'matmull': did you mean 'matmul'?" in str(exit_.value.code)
    assert list(tmp_path.iterdir()) == []  # no corpus, no .pallascheck


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
