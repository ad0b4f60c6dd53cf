"""`pallascheck verify`'s output explains itself: a legend, a marked verdict, failures
first, one line per kernel by default and every row with --full."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from pallascheck.fuzz import verify
from pallascheck.fuzz.verify import Row
from pallascheck.kernels.backends import Backend
from pallascheck.properties.device import compilation

ROWS = [
    Row("matmul", "float32", "values", True, 6, 0.5, 0.1, 1.0, contract_budget=0.25),
    Row("matmul", "float32", "reference", True, 6, 0.75, None, 1.0, contract_budget=210.0),
    Row("attention", "bfloat16", "values", True, 6, 0.4, 0.1, 2.0, contract_budget=0.3),
    Row("attention", "bfloat16", "gradients", False, 6, 3.5, None, 2.0, contract_budget=0.9),
    Row("attention", "-", "errors", True, 2, 0.0, None, 0.5),
]


def _lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_summary_has_one_line_per_kernel_failures_first(capsys) -> None:
    verify.print_summary(ROWS)
    header, _, first, second = _lines(capsys)
    ok, fail = verify.marks()
    assert header.split()[:2] == ["verdict", "kernel"]
    assert first.startswith(fail) and " attention " in first and "2/3" in first and "3.5 (gradients bfloat16)" in first
    assert second.startswith(ok) and " matmul " in second
    # the kernel's own contract budget, not xla_reference's 210 (reported, never a verdict)
    assert "0.25 (values float32)" in second and "210" not in second


def test_full_table_marks_failures_and_the_informational_contract(capsys) -> None:
    verify.print_table(ROWS)
    lines = _lines(capsys)
    assert lines[2].startswith(verify.marks()[1]) and "gradients" in lines[2]
    (reference,) = [line for line in lines if " reference " in line]
    assert f"210{verify.INFO_MARK}" in reference


def test_legend_names_every_column() -> None:
    short, full = verify.legend(), verify.legend(full=True)
    for word in ("verdict", "budget used", "contract", "xla_reference"):
        assert word in short and word in full
    assert "prob. budget" in full and "probabilistic" in full and "prob. budget" not in short


def test_verify_command_prints_legend_failures_then_one_line_per_kernel(tmp_path, monkeypatch, capsys) -> None:
    from fuzz_targets import SOUND, WRONG_FIRST_ELEMENT

    from pallascheck import cli
    from pallascheck.properties import registry

    for kernel in (SOUND, WRONG_FIRST_ELEMENT):  # plain jnp relus: no compile to speak of
        monkeypatch.setitem(registry._REGISTRY, kernel.name, kernel)
    argv = [
        "verify",
        "--kernel",
        SOUND.name,
        "--kernel",
        WRONG_FIRST_ELEMENT.name,
        "--examples",
        "1",
        "--jobs",
        "1",
        "--backend",
        "interpret",
        "--failures",
        str(tmp_path / "failures"),
    ]
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    # the plan first (a first run here: no earlier durations), then each unit with the time left
    assert re.search(r"^verify: (\d+) units on 1 job; earlier durations known for 0 of \1:", err), err
    units = [line for line in err.splitlines() if line.startswith("  [")]
    assert units and all(re.search(r"\(\d+ s elapsed, about \d+ s left\)$", line) for line in units), err
    order = [
        out.index(s)
        for s in (
            "How to read this:",
            "FAILURES (1;",
            "[values] kernel=relu_wrong_at_first_element",
            "Per kernel",
            "\nFAIL: ",
        )
    ]
    assert order == sorted(order), out
    summary = out[out.index("Per kernel") :].splitlines()
    ok, fail = verify.marks()
    assert summary[3].startswith(fail) and WRONG_FIRST_ELEMENT.name in summary[3], summary
    assert summary[4].startswith(ok) and f" {SOUND.name} " in summary[4], summary
    assert list((tmp_path / "failures").iterdir())  # the failing case is saved for replay


def test_a_hardware_property_runs_in_parts_that_depend_on_examples_alone() -> None:
    units = verify.plan(Backend("mosaic_gpu"), ["matmul"], ["bfloat16"], examples=15)
    parts = [u for u in units if u.kind == "property"]
    assert sorted(u.part for u in parts) == [0, 1, 2, 3] and {u.parts for u in parts} == {4}
    assert sorted(verify.part_examples(15, u) for u in parts) == [3, 4, 4, 4]
    seeds = {verify.part_seed(7, u) for u in parts}
    assert len(seeds) == 4 and verify.part_seed(7, min(parts, key=lambda u: u.part)) == 7
    assert len({u.key for u in parts}) == 4 and len({u.hang_report for u in parts}) == 4
    # the interpreters compile on every core already: one part, the whole property
    (interpreted,) = [
        u for u in verify.plan(Backend("interpret"), ["matmul"], ["bfloat16"], examples=15) if u.kind == "property"
    ]
    assert (interpreted.parts, verify.part_examples(15, interpreted), verify.part_seed(7, interpreted)) == (1, 15, 7)


def test_the_rows_of_a_propertys_parts_merge_into_one_row_per_check() -> None:
    parts = [
        Row("matmul", "bfloat16", "values", True, 64, 0.5, 0.1, 2.0, contract_budget=0.25),
        Row("matmul", "bfloat16", "gradients", True, 64, 0.3, None, 1.0),
        Row("matmul", "bfloat16", "values", False, 48, 1.5, None, 3.0, contract_budget=0.75),
        Row("matmul", "bfloat16", "gradients", True, 48, 0.2, None, 1.0, contract_budget=0.5),
    ]
    values, gradients = verify.merge_parts(parts)
    assert values == Row("matmul", "bfloat16", "values", False, 112, 1.5, 0.1, 5.0, contract_budget=0.75)
    assert gradients == Row("matmul", "bfloat16", "gradients", True, 112, 0.3, None, 2.0, contract_budget=0.5)


def test_a_first_run_starts_the_distributed_unit_and_leaves_the_bad_input_checks_last(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no durations recorded: every unit is unknown
    kinds = [u.kind for u in verify.plan(Backend("interpret"), None, None)]
    assert kinds[0] == "distributed", kinds
    assert kinds.index("errors") > max(i for i, k in enumerate(kinds) if k == "property"), kinds
    # a GPU run leaves them to the CPU run: they run in the TPU interpreter whatever --backend says
    assert "distributed" not in {u.kind for u in verify.plan(Backend("mosaic_gpu"), None, None)}
    assert verify.distributed_elsewhere(Backend("mosaic_gpu"), None) and not verify.distributed_elsewhere(
        Backend("interpret"), None
    )


@pytest.mark.parametrize("worker", [True, False])
def test_only_a_workers_host_blas_and_xla_autotuning_are_limited_on_a_gpu_backend(tmp_path, worker: bool) -> None:
    code = (
        "from pallascheck.properties.device import compilation; import os, threadpoolctl\n"
        "from pallascheck.kernels.backends import Backend\n"
        f"compilation.configure(Backend('mosaic_gpu'), worker={worker})\n"
        "print(os.environ.get('XLA_FLAGS', ''))\n"
        "print(max(i['num_threads'] for i in threadpoolctl.threadpool_info() if i['user_api'] == 'blas'))"
    )
    env = dict(
        os.environ,
        PALLASCHECK_CACHE_DIR="",
        OPENBLAS_NUM_THREADS="2",
        OMP_NUM_THREADS="2",
        XLA_FLAGS="--xla_gpu_enable_command_buffer=",
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True
    )
    flags, threads = out.stdout.splitlines()[-2:]
    assert int(threads) == (compilation.WORKER_BLAS_THREADS if worker else 2), out
    expected = ["--xla_gpu_enable_command_buffer=", *(compilation.GPU_WORKER_FLAGS if worker else ())]
    assert flags.split() == expected, out  # the user's flags kept, ours added to a worker's only


@pytest.mark.parametrize("user_fraction", [None, "0.5"])
def test_workers_sharing_a_gpu_each_allocate_at_most_their_share(tmp_path, user_fraction: str | None) -> None:
    """Two workers on one GPU: each JAX allocator held to half of our 95% (each grows
    its own pool and keeps what it frees: together they ran an H100 out of memory); a
    fraction the user set is kept, and the process then plans with its share."""
    code = (
        "from pallascheck.properties.device import compilation; import os\n"
        "from pallascheck.kernels.backends import Backend\n"
        "compilation.configure(Backend('mosaic_gpu'), worker=True)\n"
        "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'], compilation.allocator_capped())"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_PYTHON_CLIENT_MEM_FRACTION", compilation.CAPPED_ENV_VAR)
    }
    env |= {"PALLASCHECK_CACHE_DIR": "", compilation.SHARING_ENV_VAR: "2"}
    if user_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = user_fraction
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == (["0.4750", "True"] if user_fraction is None else ["0.5", "False"]), out


def test_a_workers_xla_flags_leave_a_flag_the_user_set(monkeypatch) -> None:
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=4")
    compilation.add_xla_flags(compilation.GPU_WORKER_FLAGS)
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_autotune_level=4"
