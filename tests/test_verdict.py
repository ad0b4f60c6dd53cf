"""What a verdict covers: nothing asked for and not checked is folded into a PASS."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pallascheck import cli
from pallascheck.cli import verify as verify_command
from pallascheck.fuzz import scope, verify
from pallascheck.kernels.backends import Backend
from pallascheck.properties import checks, registry, runner
from pallascheck.properties.registry import get_spec


@pytest.mark.parametrize(
    ("value", "shown"),
    [(0.9999996, "0.9999996"), (1.002, "1.002"), (1.0, "1"), (1.0000000001, "1.0000000001"), (0.5, "0.5")],
)
def test_a_budget_near_one_prints_on_its_side_of_one(value: float, shown: str) -> None:
    assert verify.fmt_budget(value) == shown


def test_a_row_of_no_cases_is_not_checked_never_a_pass() -> None:
    row = verify.Row("k", "float32", "gradients", True, 0, 0.0, None, 0.0, note="no case reached it")
    assert not row.checked and row.verdict == "not checked"
    assert verify.as_json(row)["verdict"] == "not checked" and verify.as_json(row)["budget_used"] is None
    failed = verify.Row("k", "float32", "values", False, 0, float("inf"), None, 0.0)
    assert failed.checked and failed.verdict == "FAIL"
    merged = verify.merge_parts([row, verify.Row("k", "float32", "gradients", True, 2, 0.1, None, 0.0)])
    assert merged[0].checked and merged[0].note == ""  # another part checked it


@pytest.mark.parametrize(
    ("asked", "hint"), [("fp32", "'float32'"), ("bf16", "'bfloat16'"), ("float128", "did you mean 'float32'")]
)
def test_a_dtype_that_matches_no_selected_kernel_is_refused_with_the_close_match(asked: str, hint: str) -> None:
    specs = {"rms_norm": get_spec("rms_norm")}
    with pytest.raises(ValueError, match=f"--dtype '{asked}' matches no selected kernel on interpret: .*{hint}"):
        scope.dtypes([asked], specs, Backend("interpret"))


def test_a_dtype_one_kernel_lacks_is_listed_as_not_checked() -> None:
    specs = {"matmul": get_spec("matmul")}
    on = Backend("mosaic_gpu_interpret")  # the Mosaic GPU matmul takes bf16 and f16 only
    assert scope.dtypes(["bfloat16"], specs, on) == []
    with pytest.raises(ValueError, match="float32"):
        scope.dtypes(["float32"], specs, on)
    both = {"matmul": get_spec("matmul"), "attention": get_spec("attention")}
    assert [n.line() for n in scope.dtypes(["float16"], both, Backend("interpret"))] == []


def test_an_unknown_backend_is_refused_with_the_close_match() -> None:
    with pytest.raises(ValueError, match="did you mean 'mosaic_gpu'"):
        scope.backend("mosaic_gpuu")
    with pytest.raises(SystemExit, match="'cuda' is not a backend"):
        cli.main(["verify", "--backend", "cuda"])


def test_a_failing_property_keeps_its_other_checks_as_not_checked_rows(tmp_path, monkeypatch, capsys) -> None:
    """A property whose first case fails values runs no other check: those of the spec
    are rows, not checked and saying why, and the summary lists them beside the
    verdict (before, they vanished from the count: 13/13 became 9/10)."""
    from fuzz_targets import SOUND

    def fails_at_once(spec, dtype, backend, **kwargs):
        tally = runner.Tally()
        tally.add(checks.Outcome("values", False, 648.0, "worst element ..."), 0.1)
        tally.findings.append(runner.Finding("values", "[values] kernel=relu: budget used 648", None))
        return tally

    monkeypatch.setitem(registry._REGISTRY, SOUND.name, SOUND)
    monkeypatch.setattr(runner, "run_property", fails_at_once)
    monkeypatch.chdir(tmp_path)
    argv = ["verify", "--kernel", SOUND.name, "--examples", "1", "--jobs", "1", "--json", "v.json", "--full"]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "v.json").read_text())
    stopped = [r for r in report["rows"] if r["note"] == "the property stopped at its first failing case"]
    assert {r["check"] for r in stopped} == {"reference", "contract", "deterministic", "metamorphic"}, stopped
    assert all(r["verdict"] == "not checked" for r in stopped)
    assert not report["complete"] and len(report["not_checked"]) == len(stopped) + 1  # + errors: no bad input
    checked = [r for r in report["rows"] if r["verdict"] != "not checked"]
    assert [r["check"] for r in checked] == ["values"]
    assert f"\nFAIL: 0/1 checks passed - NOT CHECKED: {len(stopped) + 1} (above)" in out, out


def test_strict_fails_a_passing_run_that_left_something_asked_for_unchecked(tmp_path, monkeypatch, capsys) -> None:
    from fuzz_targets import SOUND

    bf16_only = dataclasses.replace(SOUND, name="relu_bf16_only", dtypes=("bfloat16",))
    for spec in (SOUND, bf16_only):
        monkeypatch.setitem(registry._REGISTRY, spec.name, spec)
    monkeypatch.chdir(tmp_path)
    argv = ["verify", "--kernel", SOUND.name, "--kernel", bf16_only.name, "--dtype", "float32"]
    argv += ["--examples", "1", "--jobs", "1", "--failures", ""]
    assert cli.main(argv) == 0  # everything checked passed
    out = capsys.readouterr().out
    assert "relu_bf16_only float32: relu_bf16_only has no float32 version on interpret" in out, out
    listed = out[out.index("NOT CHECKED (") :].split("\n\n")[0].splitlines()[1:]
    assert f"- NOT CHECKED: {len(listed)} (above)" in out, out
    assert cli.main([*argv, "--strict"]) == verify_command.STRICT_EXIT


def test_a_device_out_of_memory_is_not_checked_never_the_kernels_failure(monkeypatch) -> None:
    """An allocation the device refuses says nothing of the kernel's values: no finding,
    no FAIL; the checks it kept from running are not checked, saying so (a shared H100
    booked two workers' out-of-memory errors as the kernels' crashes)."""
    from fuzz_targets import CRASH_OR_WRONG, OUT_OF_DEVICE_MEMORY

    backend = Backend("interpret")
    tally = runner.run_property(OUT_OF_DEVICE_MEMORY, "float32", backend, examples=2)
    assert not tally.findings and "the device ran out of memory (RESOURCE_EXHAUSTED" in tally.stopped, tally
    monkeypatch.setattr(verify, "get_spec", lambda name: OUT_OF_DEVICE_MEMORY)
    options = verify.Options(backend, 2, 0, None, ("float32",))
    rows, failures = verify._property(verify.Unit("property", OUT_OF_DEVICE_MEMORY.name, "float32"), options, "")
    assert not failures and all(r.passed and not r.checked for r in rows), rows
    assert {r.note for r in rows} == {tally.stopped}
    # any other error a kernel raises is still its crash
    crashed = runner.run_property(CRASH_OR_WRONG, "float32", backend, examples=4)
    assert not crashed.stopped and {f.check for f in crashed.findings} & {"crash", "values"}, crashed.findings
