"""`pallascheck report`: the corpus summary is right and the HTML page is a valid,
self-contained document (checked by a strict parser and, where installed, by a real
browser) — also for a corpus that is empty or was cut short mid-line."""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from pallascheck.cli import report as report_command
from pallascheck.fuzz import report
from pallascheck.fuzz.corpus import headline

CHROMIUM = "/usr/bin/chromium"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
REPLAY_VALUE = "pallascheck replay failures/matmul-bf16-values/case.npz --backend interpret"
REPLAY_HANG = "pallascheck replay failures/softmax-f32-hang/case.npz --timeout 60"
# The corpus's two kinds of device: matmul ran on the first, softmax on the second, whose
# probe found a 22-bit accumulator.
H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"
DEVICE = {"matmul": H100, "softmax": A100}
SHORT_ACCUMULATOR = "the accumulator keeps 22 significand bits, fewer than f32's 24"

# (kernel, dtype, kind, config, shapes, {check: (budget, error, bound)}) per written case.
CASES = [
    (
        "matmul",
        "bfloat16",
        "random",
        {"block_m": 64},
        {"a": [8, 16], "b": [16, 8]},
        {"values": (0.25, 0.5, 2.0), "deterministic": (0.0, None, None)},
    ),
    ("matmul", "bfloat16", "large", {"block_m": 64}, {"a": [8, 16], "b": [16, 8]}, {"values": (0.5, 1.0, 2.0)}),
    ("matmul", "bfloat16", "random", {"block_m": 32}, {"a": [4, 4], "b": [4, 4]}, {"values": (3.0, 6.0, 2.0)}),
    ("matmul", "float32", "random", None, {"a": [8, 16], "b": [16, 8]}, {"values": (None, None, None)}),
    ("softmax", "float32", "masked", "default", {"x": [2, 128]}, {"values": (0.125, 1e-7, 8e-7)}),
    ("softmax", "float32", "random", "default", {"x": [2, 128]}, {"values": (0.0, 0.0, 8e-7)}),
]


def _write_corpus(root) -> None:
    campaign = {
        "version": 1,
        "backend": "interpret",
        "jax": "0.12.0",
        "started": 1.7e9,
        "seconds": 12.0,
        "targeted": False,
        "arms": [
            {
                "kernel": "matmul",
                "dtype": "bfloat16",
                "level": "kind",
                "option": "random",
                "pulls": 3,
                "best_budget": 3.0,
                "mean_reward": 0.4,
                "retired": True,
            },
            {
                "kernel": "softmax",
                "dtype": "float32",
                "level": "slot",
                "option": 1,
                "pulls": 1,
                "best_budget": 0.125,
                "mean_reward": 0.1,
                "retired": True,
            },
        ],
        "next_seed": 7,
    }
    (root / "campaign.json").write_text(json.dumps(campaign))
    events = [
        {
            "t": 2.0,
            "kernel": "matmul",
            "dtype": "bfloat16",
            "kind": "random",
            "config_slot": 0,
            "seed": 1,
            "cases": 3,
            "seconds": 1.5,
            "best_budget": {"values": 3.0},
            "outcome": "value",
            "signature": "matmul-bf16-values",
            "device_kind": H100,
        },
        {
            "t": 9.0,
            "kernel": "softmax",
            "dtype": "float32",
            "kind": "masked",
            "config_slot": 1,
            "seed": 2,
            "cases": 2,
            "seconds": 6.0,
            "best_budget": {"values": None},
            "outcome": "hang",
            "signature": "softmax-f32-hang",
            "device_kind": A100,
        },
    ]
    # The campaign was killed while appending a third event.
    (root / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"t": 11.5, "kern')
    lines = []
    for t, (kernel, dtype, kind, config, shapes, checks) in enumerate(CASES):
        lines.append(
            json.dumps(
                {
                    "t": float(t + 1),
                    "kernel": kernel,
                    "dtype": dtype,
                    "device_kind": DEVICE[kernel],
                    "kind": kind,
                    "config": config,
                    "shapes": shapes,
                    "checks": {name: {"budget": b, "error": e, "bound": bd} for name, (b, e, bd) in checks.items()},
                }
            )
        )
    (root / "cases.jsonl").write_text("\n".join(lines) + "\n")
    failures = [
        {
            "signature": "softmax-f32-hang",
            "kernel": "softmax",
            "dtype": "float32",
            "check": "values",
            "kind": "hang",
            "message": "no result in 60 s\n(worker killed)",
            "replay": REPLAY_HANG,
            "first_seen_t": 9.0,
            "count": 1,
            "minimised": False,
            "shapes": {"x": [2, 128]},
            "config": "default",
            "backend": "interpret",
        },
        {
            "signature": "matmul-bf16-values",
            "kernel": "matmul",
            "dtype": "bfloat16",
            "check": "values",
            "kind": "value",
            "message": "matmul <bfloat16>: error 6 > bound 2 at (1, 3)\nconfig ...",
            "replay": REPLAY_VALUE,
            "first_seen_t": 2.0,
            "count": 3,
            "minimised": True,
            "shapes": {"a": [4, 4], "b": [4, 4]},
            "config": {"block_m": 32},
            "backend": "interpret",
            "input_kind": "random",
            "config_slot": 1,
            "budget": 3.0,
            "worst": {"output": "out", "index": [1, 3], "shape": [4, 4], "error": 6.0, "bound": 2.0},
        },
    ]
    for failure in failures:
        directory = root / "failures" / failure["signature"]
        directory.mkdir(parents=True)
        (directory / "failure.json").write_text(json.dumps(dict(failure, device_kind=DEVICE[failure["kernel"]])))
    (root / "probes").mkdir()
    for name, kind, violations in (("h100", H100, []), ("a100", A100, [SHORT_ACCUMULATOR])):
        probe = {"device_kind": kind, "violations": {"xla": [], "pallas": violations}, "paths": {}}
        (root / "probes" / f"{name}.json").write_text(json.dumps(probe))


class _StrictPage(HTMLParser):
    """Fails on any non-void tag closed out of order or left open; collects images,
    table rows and every attribute value."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []
        self.starts: list[str] = []
        self.images: list[str] = []
        self.rows: list[list[str]] = []
        self.attributes: list[str] = []
        self._cells: list[str] | None = None

    def handle_starttag(self, tag, attrs) -> None:
        self.starts.append(tag)
        self.attributes += [value or "" for _, value in attrs]
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        if tag == "tr":
            self._cells = []
        if tag in ("td", "th") and self._cells is not None:
            self._cells.append("")
        if tag not in VOID:
            self.open.append(tag)

    def handle_startendtag(self, tag, attrs) -> None:
        assert tag in VOID, f"<{tag}/> is not a void element"
        self.handle_starttag(tag, attrs)

    def handle_endtag(self, tag) -> None:
        assert tag not in VOID, f"</{tag}> closes a void element"
        assert self.open and self.open[-1] == tag, f"</{tag}> closes <{self.open[-1] if self.open else None}>"
        self.open.pop()
        if tag == "tr":
            self.rows.append(self._cells or [])
            self._cells = None

    def handle_data(self, data) -> None:
        if self._cells:
            self._cells[-1] += data


def _parse(path: str) -> tuple[_StrictPage, str]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    page = _StrictPage()
    page.feed(text)
    page.close()
    assert page.open == [], f"left open: {page.open}"
    assert page.starts.count("html") == 1 and page.starts[0] == "html"
    assert text.startswith("<!DOCTYPE html>")
    return page, text


@pytest.fixture
def corpus(tmp_path) -> str:
    _write_corpus(tmp_path)
    return str(tmp_path)


def test_summary_counts_what_the_corpus_holds(corpus) -> None:
    summary = report.summarise(corpus)
    totals = summary["totals"]
    assert totals["cases"] == len(CASES) and totals["tasks"] == 2
    assert summary["skipped_lines"] == {"events.jsonl": 1}
    assert totals["task_outcomes"] == {"hang": 1, "value": 1}
    assert totals["failures_by_kind"] == {"value": 1, "crash": 0, "hang": 1, "oom": 0}
    assert totals["failure_occurrences"] == 4
    assert totals["cases_per_second"] == pytest.approx(len(CASES) / 12.0)
    assert [f["kind"] for f in summary["failures"]] == ["value", "hang"]  # oldest first

    matmul_bf16 = summary["budget_used"]["by_kernel_dtype"]["matmul"]["bfloat16"]
    assert matmul_bf16 == {"count": 3, "inf": 0, "median": 0.5, "p90": 3.0, "max": 3.0}
    # A null budget is infinite: counted, and the maximum of its kernel.
    assert summary["budget_used"]["by_kernel_dtype"]["matmul"]["float32"]["inf"] == 1
    assert summary["budget_used"]["by_kernel"]["matmul"] == {
        "count": 4,
        "inf": 1,
        "median": 0.5,
        "p90": "inf",
        "max": "inf",
    }
    assert summary["budget_used"]["by_kernel"]["softmax"]["max"] == 0.125
    # by device kind: matmul's task, cases and failure on the H100; softmax's on the A100,
    # whose probe found the model's accumulator does not hold there
    no_failures = {"value": 0, "crash": 0, "hang": 0, "oom": 0}
    assert summary["by_device_kind"] == {
        A100: {
            "tasks": 1,
            "cases": 2,
            "failures": 1,
            "failures_by_kind": dict(no_failures, hang=1),
            "budget_used": {"count": 2, "inf": 0, "median": 0.0, "p90": 0.125, "max": 0.125},
            "tolerance_model": [f"pallas: {SHORT_ACCUMULATOR}"],
        },
        H100: {
            "tasks": 1,
            "cases": 4,
            "failures": 1,
            "failures_by_kind": dict(no_failures, value=1),
            "budget_used": {"count": 4, "inf": 1, "median": 0.5, "p90": "inf", "max": "inf"},
            "tolerance_model": "holds",
        },
    }

    # Checks without an error (bit comparisons, the NaN case) are not points.
    assert summary["error_vs_bound"] == {
        "matmul": {"points": 3, "above_bound": 1},
        "softmax": {"points": 2, "above_bound": 0},
    }
    assert summary["error_vs_bound_by_dtype_check"] == {
        "bfloat16 values": {"points": 3, "zero_error": 0, "above_bound": 1, "median_budget": 0.5, "max_budget": 3.0},
        "float32 values": {"points": 2, "zero_error": 1, "above_bound": 0, "median_budget": 0.0, "max_budget": 0.125},
    }
    coverage = summary["coverage"]["matmul"]
    assert coverage["shapes"] == {"a=8x16, b=16x8": 3, "a=4x4, b=4x4": 1}
    assert coverage["configs"] == {"block_m=64": 2, "block_m=32": 1, "default": 1}
    assert coverage["kinds"] == {"random": 3, "large": 1}
    assert summary["throughput"][-1] == [6.0, len(CASES)]


def test_page_is_valid_self_contained_html(corpus, tmp_path) -> None:
    out = str(tmp_path / "out")
    html_path, json_path = report.write(corpus, out)
    assert (html_path, json_path) == (os.path.join(out, "report.html"), os.path.join(out, "report.json"))
    with open(json_path) as f:
        assert json.load(f)["totals"]["cases"] == len(CASES)
    page, text = _parse(html_path)

    assert not re.search(r"https?://", text, re.IGNORECASE)
    assert "<script" not in text.lower()
    assert len(page.images) == 3  # budget, error vs bound, throughput
    for src in page.images:
        prefix = "data:image/png;base64,"
        assert src.startswith(prefix)
        assert base64.b64decode(src[len(prefix) :], validate=True).startswith(PNG_SIGNATURE)
    assert os.path.getsize(html_path) < 400_000

    failure_rows = [row for row in page.rows if row and row[0] in ("value", "hang")]
    assert [row[:6] for row in failure_rows] == [  # kind, kernel, dtypes, checks, failures, seen
        ["value", "matmul", "bfloat16", "values", "1", "3"],
        ["hang", "softmax", "float32", "values", "1", "1"],
    ]
    assert [row[-1] for row in failure_rows] == ["#1", "#2"]  # links to each failure in full
    assert (
        failure_rows[0][-2] == "matmul <bfloat16>: error 6 > bound 2 at (1, 3)"
    )  # first line, unescaped by the parser
    assert "&lt;bfloat16&gt;" in text
    # each failure in full on the page: worst element, error, bound, budget, shapes, config, replay
    value = text[text.index('id="finding-1"') : text.index('id="finding-2"')]
    for shown in (
        "out[1, 3] of shape (4, 4)",
        "<dd>6</dd>",
        "<dd>2</dd>",
        "<dd>3</dd>",
        "a=4x4, b=4x4",
        "block_m=32",
        "random, 1",
        REPLAY_VALUE,
    ):
        assert shown in value, shown
    assert "not recorded" in text[text.index('id="finding-2"') :] and REPLAY_HANG in text
    # the bandit in words
    assert "inputs of kind \u201crandom\u201d" in text and "config #1 of the kernel&#x27;s config space" in text
    assert "Bandit" not in text and "slot None" not in text

    header = {row[0]: row[1] for row in page.rows if len(row) == 2}
    assert header["backend"] == "interpret" and header["jax"] == "0.12.0"
    assert header["cases"] == str(len(CASES)) and header["duration"] == "0m 12s"
    assert header["last new failure"] == "at 0m 09s, 0m 03s before the end"
    assert "events.jsonl: 1 line(s) that do not parse were skipped" in text
    assert ["matmul", "bfloat16", "3", "0", "0.5", "3", "3"] in page.rows  # the budget table
    # the device kinds' table: the A100's probe says why its bounded checks did not run
    assert [
        A100,
        "1",
        "2",
        "1 (hang 1)",
        "0",
        "0.125",
        f"does not hold, bounded checks not run: pallas: {SHORT_ACCUMULATOR}",
    ] in page.rows
    assert [H100, "1", "4", "1 (value 1)", "0.5", "inf", "holds"] in page.rows


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed (apt-get install chromium)"
)
def test_page_renders_in_chromium(corpus, tmp_path) -> None:
    html_path, _ = report.write(corpus)
    dom = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            f"file://{os.path.abspath(html_path)}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert dom.count('<tr class="failure">') == 2 and dom.count('<div class="finding"') == 2
    assert REPLAY_VALUE in dom and REPLAY_HANG in dom
    assert dom.count('<img src="data:image/png;base64,') == 3


def test_empty_corpus_still_gets_a_page(tmp_path) -> None:
    html_path, json_path = report.write(str(tmp_path))
    page, text = _parse(html_path)
    assert page.images == []
    assert "No cases were recorded." in text and "No failures were recorded." in text
    assert "campaign.json is missing." in text
    with open(json_path) as f:
        summary = json.load(f)
    assert summary["totals"]["cases"] == 0 and summary["totals"]["cases_per_second"] is None
    assert summary["files"] == {"campaign.json": False, "events.jsonl": False, "cases.jsonl": False, "failures": False}


def test_command_prints_both_paths_and_names_a_missing_corpus(corpus, tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser(prog="pallascheck")
    report_command.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", corpus, "--out", str(tmp_path / "out")])
    assert args.func(args) == 0
    assert capsys.readouterr().out.split() == [
        str(tmp_path / "out" / "report.html"),
        str(tmp_path / "out" / "report.json"),
    ]
    missing = parser.parse_args(["report", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="CORPUS .*nowhere.* is not a directory"):
        missing.func(missing)


def test_missing_matplotlib_names_the_extra(corpus, monkeypatch) -> None:
    # None in sys.modules makes the import fail, as if matplotlib were not installed.
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=re.escape("pip install 'pallascheck[user]'")):
        report.write(corpus)
    assert not os.path.exists(os.path.join(corpus, "report.html"))


def test_headline_is_what_went_wrong() -> None:
    message = "[values] kernel=matmul dtype=bfloat16 backend=interpret\n  out: worst element (1, 3): error=6"
    assert headline(message) == "out: worst element (1, 3): error=6"
    assert headline("RuntimeError: boom\nmore") == "RuntimeError: boom" and headline("") == ""


def _failure(signature: str, dtype: str, check: str, pattern: str, t: float) -> dict:
    return {
        "signature": signature,
        "kernel": "my_gelu",
        "dtype": dtype,
        "check": check,
        "kind": "value",
        "pattern": pattern,
        "message": f"[{check}] kernel=my_gelu\n  out: worst element (0,): error=2e-3 bound=8e-4",
        "replay": f"pallascheck replay failures/{signature}/case.npz --path .",
        "first_seen_t": t,
        "count": 1,
    }


def test_one_bug_in_two_checks_and_two_dtypes_is_one_finding_with_its_members(tmp_path) -> None:
    # values and contract of one wrong result, in float32 and bfloat16: four signatures,
    # one finding; a failure at another element pattern is a finding of its own
    members = [
        _failure(f"value-{check}-{dtype}", dtype, check, "out:finite:.", t)
        for t, (dtype, check) in enumerate(
            [("float32", "values"), ("float32", "contract"), ("bfloat16", "values"), ("bfloat16", "contract")], 1
        )
    ]
    other = _failure("value-values-float32-last", "float32", "values", "out:finite:L", 9.0)
    for failure in [*members, other]:
        directory = tmp_path / "failures" / failure["signature"]
        directory.mkdir(parents=True)
        (directory / "failure.json").write_text(json.dumps(failure))
    summary = report.summarise(str(tmp_path))
    assert summary["totals"]["findings"] == 2 and summary["totals"]["failures"] == 5
    first, second = summary["findings"]
    assert first["members"] == [m["signature"] for m in members] and second["members"] == [other["signature"]]
    assert first["dtypes"] == ["bfloat16", "float32"] and first["checks"] == ["contract", "values"]
    html_path, _ = report.write(str(tmp_path))
    page, text = _parse(html_path)
    (row, row_other) = [r for r in page.rows if r and r[0] == "value"]
    assert row[:5] == ["value", "my_gelu", "bfloat16, float32", "contract, values", "4"]
    assert row[-1] == "#1 #2 #3 #4" and row_other[-1] == "#5"
    assert text.count("<h3>Finding ") == 2
    for failure in [*members, other]:  # every member keeps its replay command on the page
        assert failure["replay"] in text
    header = {r[0]: r[1] for r in page.rows if len(r) == 2}
    assert header["failures"].startswith("2 finding(s) of 5 distinct failure(s)")


def _png_size(src: str) -> tuple[int, int]:
    data = base64.b64decode(src.split(",", 1)[1])
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _caption_numbers(caption: str, after: str) -> tuple[float, float]:
    low, high = re.search(re.escape(after) + r" (\S+) to (\S+?)[:;,]? ", caption).groups()
    return float(low), float(high)


def test_figures_are_sized_for_a_pull_request_in_the_band_of_their_data(corpus) -> None:
    loaded = report._load(corpus)
    mpl = report._matplotlib()
    # the corpus' budgets run 0 .. 3 (and one inf); its error / bound shares 0 .. 3
    fig = report._budget_fig(loaded, mpl)
    (ax,) = fig.axes
    band, _ = report._budget_axes(loaded)
    assert ax.get_xlim() == pytest.approx(band.limits)
    assert band.high == pytest.approx(3.0 * report.MARGIN) and band.low == pytest.approx(0.125 / report.MARGIN)
    assert _caption_numbers(report._budget_caption(loaded), "drawn from") == pytest.approx(
        (band.low, band.high), rel=1e-2
    )
    assert report.ZERO_LABEL in [t.get_text() for t in ax.get_xticklabels()]
    assert all(t.get_fontsize() >= 10 for t in ax.get_xticklabels() + ax.get_yticklabels())

    fig = report._error_bound_fig(loaded, mpl)
    band, (low, high) = report._error_bound_axes(loaded)
    caption = report._error_bound_caption(loaded)
    assert _caption_numbers(caption, "drawn from") == pytest.approx((band.low, band.high), rel=1e-2)
    assert _caption_numbers(caption, "Bounds from") == pytest.approx((low, high), rel=1e-2)
    # the data's shares: 0.125 .. 3 among the positive ones, one exact zero (softmax f32)
    assert (band.low, band.high) == pytest.approx((0.125 / report.MARGIN, 3.0 * report.MARGIN))
    zeros_drawn = 0
    for ax in fig.axes:
        assert ax.get_ylim() == pytest.approx(band.limits) and ax.get_xlim() == pytest.approx((low, high))
        assert all(t.get_fontsize() >= 10 for t in ax.get_xticklabels() + ax.get_yticklabels())
        assert all(t.get_fontsize() >= 10 for legend in [ax.get_legend()] for t in legend.get_texts())
        zeros_drawn += sum(
            int((c.get_offsets()[:, 1] == band.zero).sum()) for c in ax.collections if len(c.get_offsets())
        )
    assert zeros_drawn == 1  # the exact result, on its row, not at the floor
    assert report.ZERO_LABEL in [t.get_text() for t in fig.axes[0].get_yticklabels()]  # the panels share the y axis

    page_images = _parse(report.write(corpus)[0])[0].images
    assert all(1000 <= _png_size(src)[0] <= 1500 for src in page_images)  # about 1200 px wide
