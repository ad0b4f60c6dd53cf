"""``pallascheck mutate``: the operators write the kernel bugs they name, and the
command scores a kernel's checks by the mutants they kill - ours (rms_norm, a few
mutants with a pinned seed) and a user's own kernel and spec imported with --path."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from pallascheck import cli
from pallascheck.fuzz import durations
from pallascheck.fuzz.mutation import operators

# A kernel module with one instance of each bug class, and code that is never mutated
# (argument validation, the config dataclass, error paths).
KERNEL = textwrap.dedent("""\
    import dataclasses
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl

    LOG2_E = 1.4426950408889634


    @dataclasses.dataclass(frozen=True)
    class Config:
        block: int = 8


    def _validate(x):
        if x.ndim < 1:
            raise ValueError("x must have rank >= 1")


    def _kernel(x_ref, o_ref, acc_ref, sem, *, n, eps):
        step = pl.program_id(0)
        slot = step % 2
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        m = jnp.full((8, 1), -jnp.inf)
        x = x_ref[pl.ds(step * 8, 8)].astype(jnp.float32)

        def body(i, carry):
            acc, m_prev = carry
            m_new = jnp.maximum(m_prev, jnp.max(x, axis=1, keepdims=True))
            acc = acc * jnp.exp(m_prev - m_new)
            return acc + jnp.dot(x, x, preferred_element_type=jnp.float32), m_new

        acc, m = lax.fori_loop(0, n, body, (jnp.zeros((8, 8), jnp.float32), m))
        acc_ref[...] *= LOG2_E
        ok = (lax.broadcasted_iota(jnp.int32, (8, 1), 0) < n) & (step >= 0)
        o_ref[...] = jnp.where(ok, acc / (jnp.sum(acc, axis=1, keepdims=True) + eps), 0.0)
        sem.at[slot].wait()


    def call(x):
        _validate(x)
        spec = pl.BlockSpec((8, 8), lambda i: (i, 0))
        return pl.pallas_call(_kernel, grid=(pl.cdiv(x.shape[0], 8),), in_specs=[spec], out_specs=spec)(x[: x.shape[0]])
""")


def _mutations(operator: str) -> set[tuple[str, str]]:
    return {
        (" ".join(m.before.split()), " ".join(m.after.split()))
        for m in operators.generate(KERNEL, operators=[operator])
    }


@pytest.mark.parametrize(
    "operator, expected",
    [
        (
            "index_offset",
            {
                ("i", "(i + 1)"),
                ("0", "(0 + 1)"),
                ("step * 8", "(step * 8 + 1)"),
                ("8", "(8 - 1)"),
                ("pl.program_id(0)", "(pl.program_id(0) + 1)"),
                ("x.shape[0]", "(x.shape[0] - 1)"),
            },
        ),
        ("loop_bound", {("0", "(0 + 1)"), ("n", "(n - 1)")}),
        ("cdiv", {("pl.cdiv(x.shape[0], 8)", "((x.shape[0]) // (8))")}),
        (
            "mask",
            {
                (
                    "(lax.broadcasted_iota(jnp.int32, (8, 1), 0) < n)",
                    "(lax.broadcasted_iota(jnp.int32, (8, 1), 0) <= n)",
                ),
                ("(step >= 0)", "(step < 0)"),
                (
                    "(lax.broadcasted_iota(jnp.int32, (8, 1), 0) < n) & (step >= 0)",
                    "(lax.broadcasted_iota(jnp.int32, (8, 1), 0) < n) | (step >= 0)",
                ),
            },
        ),
        (
            "cast",
            {
                ("x_ref[pl.ds(step * 8, 8)].astype(jnp.float32)", "x_ref[pl.ds(step * 8, 8)]"),
                ("jnp.dot(x, x, preferred_element_type=jnp.float32)", "jnp.dot(x, x)"),
            },
        ),
        (
            "accumulator",
            {
                ("acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)", "pass"),
                ("jnp.zeros((8, 8), jnp.float32)", "jnp.ones((8, 8), jnp.float32)"),
                ("-jnp.inf", "0.0"),
            },
        ),
        ("rescale", {("acc * jnp.exp(m_prev - m_new)", "(acc)"), ("acc_ref[...] *= LOG2_E", "pass")}),
        ("reduction", {("x", "m"), ("acc", "x"), ("1", "0")}),
        ("pipeline", {("slot", "(slot + 1)"), ("step % 2", "((step + 1) % 2)")}),
        ("constant", {("1.4426950408889634", repr(1.4426950408889634 * (1 + 2**-7)))}),
        (
            "running_stat",
            {
                ("jnp.maximum(m_prev, jnp.max(x, axis=1, keepdims=True))", "jnp.max(x, axis=1, keepdims=True)"),
                (
                    "acc + jnp.dot(x, x, preferred_element_type=jnp.float32)",
                    "(jnp.dot(x, x, preferred_element_type=jnp.float32))",
                ),
            },
        ),
    ],
)
def test_each_operator_writes_its_bug(operator: str, expected: set[tuple[str, str]]) -> None:
    found = _mutations(operator)
    assert expected <= found, f"missing {expected - found}; found {found}"


def test_validation_config_and_error_paths_are_not_mutated() -> None:
    mutants = operators.generate(KERNEL)
    assert {m.function for m in mutants} == {"<module>", "_kernel", "_kernel.body", "call"}
    assert not any("raise" in m.diff(KERNEL, "k.py") or "block: int" in m.before for m in mutants)
    for m in mutants:  # one change each, and the rest of the module byte for byte
        changed = [
            line
            for line in m.diff(KERNEL, "k.py").splitlines()
            if line.startswith(("-", "+")) and not line.startswith(("---", "+++"))
        ]
        assert len(changed) == 2, m.label


def _rows(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_mutate_scores_the_rms_norm_checks_and_resumes_an_unfinished_run(tmp_path, monkeypatch, capsys) -> None:
    """rms_norm's checks with a pinned seed, on a few of norms.py's mutants: both
    rescales dropped from its statistics die; layer norm's statistics are unreached
    (a survivor class the score counts); the default eps, which the spec always
    overrides, changes no output (equivalent, left out). Score 2 / (2 + 3). The
    first run's budget ends after the baseline; the resumed run keeps its results
    and runs the rest. Each run opens with its plan and each mutant's line ends with
    the time left; the durations are kept for the next run's estimate."""
    monkeypatch.chdir(tmp_path)  # the earlier durations: none at first
    out = tmp_path / "rms_norm.jsonl"
    args = [
        "mutate",
        "--kernel",
        "rms_norm",
        "--dtype",
        "float32",
        "--examples",
        "1",
        "--seed",
        "0",
        "--jobs",
        "1",
        "--operator",
        "rescale",
        "--operator",
        "constant",
        "--function",
        "rms_statistics|layer_norm_statistics|<module>",
        "--out",
        str(out),
    ]
    assert cli.main(args + ["--budget", "0.1"]) == 0
    printed = capsys.readouterr()
    assert "not run (over --budget): #0, #1, #5, #6" in printed.out
    assert "mutate: the baseline and 7 mutants on 1 job; earlier durations known for 0 of 8" in printed.err
    assert cli.main(args + ["--resume"]) == 0
    printed = capsys.readouterr()
    assert "mutate: the baseline and 4 mutants (3 reused) on 1 job; earlier durations known for 1 of 5" in printed.err
    mutant_lines = [line for line in printed.err.splitlines() if line.startswith("[")]
    assert len(mutant_lines) == 7 and all(
        re.search(r"\(\d+ s elapsed, about \d+ s left\)$", line) for line in mutant_lines
    )
    assert mutant_lines[-1].endswith("about 0 s left)"), mutant_lines
    rows = [r for r in _rows(out) if r["kind"] == "mutant"]
    status: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        status.setdefault((r["function"], r["operator"]), []).append(r["status"])
    assert status == {
        ("<module>", "constant"): ["equivalent"] * 2,
        ("rms_statistics", "rescale"): ["killed"] * 2,
        ("layer_norm_statistics", "rescale"): ["unreached"] * 3,
    }
    killed = [r for r in rows if r["status"] == "killed"]
    assert all(r["check"] == "values" and r["cases"] == 1 for r in killed)
    assert "mutation score 40.0% (2/5)" in printed.out
    # every mutant's time and the baseline's are kept for the next run's estimate
    assert len(durations.load("mutate")) == 1 + 7


USER_KERNEL = textwrap.dedent('''\
    """A user's Pallas relu over blocks of 8 elements."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    BLOCK = 8


    def _relu_kernel(x_ref, y_ref):
        y_ref[...] = jnp.maximum(x_ref[...], 0.0).astype(y_ref.dtype)


    def relu(x, interpret=False):
        flat = x.reshape(-1)
        n = flat.shape[0]
        blocks = pl.cdiv(n, BLOCK)
        padded = jnp.pad(flat, (0, blocks * BLOCK - n))
        y = pl.pallas_call(
            _relu_kernel, grid=(blocks,), in_specs=[pl.BlockSpec((BLOCK,), lambda i: (i,))],
            out_specs=pl.BlockSpec((BLOCK,), lambda i: (i,)),
            out_shape=jax.ShapeDtypeStruct(padded.shape, x.dtype), interpret=interpret,
        )(padded)
        return y[:n].reshape(x.shape)
''')

USER_SPEC = textwrap.dedent("""\
    from pallascheck.specs import elementwise_like

    from my_relu import relu

    # lengths of several blocks: an index map off by one reads or writes a neighbour block
    SPEC = elementwise_like(relu, name="my_relu", activation="relu", shapes=((40,), (3, 33)), dtypes=("float32",),
                            differentiable=False, interpret="interpret")
""")


def test_mutate_works_on_a_users_kernel_and_spec(tmp_path, capsys) -> None:
    """The user's own spec module names its kernel; mutate finds the kernel's module
    behind it, and every mutant of its block offsets and running max dies."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_relu.py").write_text(USER_KERNEL)
    (project / "my_relu_spec.py").write_text(USER_SPEC)
    out = tmp_path / "mutants.jsonl"
    code = cli.main(
        [
            "mutate",
            "--kernel",
            "my_relu_spec:SPEC",
            "--path",
            str(project),
            "--examples",
            "1",
            "--jobs",
            "1",
            "--operator",
            "index_offset",
            "--operator",
            "running_stat",
            "--out",
            str(out),
            "--fail-under",
            "100",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "mutating my_relu (" in printed
    rows = [r for r in _rows(out) if r["kind"] == "mutant"]
    assert {r["operator"] for r in rows} == {"index_offset", "running_stat"}
    assert len(rows) >= 4 and all(r["status"] == "killed" for r in rows), rows
    assert "mutation score 100.0%" in printed


def test_recorded_outputs_are_values_inside_a_compiled_layout_program() -> None:
    # On hardware the checks call the kernel inside jax.jit (one program per layout):
    # recording its tracers instead of its values failed every baseline on the GPU.
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallascheck.fuzz.mutation import worker

    outputs: list = []
    kernel = worker._recorded(lambda x: {"y": x * 2}, outputs)
    jax.jit(kernel)(jnp.arange(3.0))
    kernel(jnp.ones(2))
    jax.effects_barrier()
    assert [np.asarray(o["y"]).tolist() for o in outputs] == [[0.0, 2.0, 4.0], [2.0, 2.0]]
