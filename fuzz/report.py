"""``pallascheck report CORPUS``: one HTML page (and its JSON) about a fuzz campaign.

The page answers what a kernel engineer asks after a campaign, top to bottom:

- **Header**: backend, JAX version, when it started, how long it ran, tasks, cases,
  failures by kind and cases per second.
- **Findings**: one row per finding (``findings``: the failures that differ only in
  dtype and check; kind, kernel, dtypes, checks, members, how often, the first
  member's message's first line), oldest first; then each member in full, with the
  replay command to paste into a shell: its worst element, error, bound, budget used, the saved
  case's shapes and config, the whole message.
- **Budget used**: per kernel and dtype, how much of the derived error bound the worst
  check of each case used (error / bound; 1.0 is the bound, above it is a failure).
  Budgets far below 1 mean a loose bound that can hide bugs; infinite budgets (NaN or
  inf where the oracle is finite, or differing bits) are counted separately.
- **Error vs bound**: error / bound against the bound, one panel per dtype and one
  colour per check, on an axis spanning the data (``_band``: never below
  ``BUDGET_FLOOR`` nor above ``BUDGET_CAP``, the bound always inside), exact zeros on
  a marked row; each caption's numbers are its axis'.
- **By device kind**: tasks, cases, failures and budgets used per kind of device the
  workers ran on (a cluster may mix them), and what the arithmetic probe found there:
  the tolerance model holds, or which assumption fails (its bounded checks were not run).
- **Coverage**: which shapes, configs and input kinds each kernel was fuzzed with.
- **Throughput**: cumulative cases over the campaign's seconds (with the moments each
  failure was first seen), and where the search spent its tasks, in words (the
  bandit's arms: which input kinds and configs got tasks and how close they came).

The page is one self-contained file (inline CSS, figures as PNG data URIs, no
scripts, nothing fetched), so it can be attached to a bug or archived with the corpus.
``report.json`` holds the same numbers for scripts and CI (``summarise``).
The corpus may be empty, still being written or cut short by a kill: missing files
and truncated lines are reported on the page, never fatal.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import math
import os
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any, cast

import numpy as np

from pallascheck.fuzz import findings
from pallascheck.fuzz.corpus import CASES, EVENTS, FAILURE_KINDS, FAILURES, headline, probes
from pallascheck.fuzz.corpus import STATE as CAMPAIGN
from pallascheck.oracles import device_arithmetic
from pallascheck.properties import check_kinds

# The JSON's throughput curve and the page's tables stay readable (and the page small)
# for campaigns of a million cases; report.json keeps every distinct coverage value.
THROUGHPUT_POINTS = 500
POINTS_PER_SERIES = 3000  # drawn per row or kernel of a scatter; statistics use all
COVERAGE_ROWS = 20
# Figures sized to be read where they are pasted (a pull request, an issue): 8 in at
# 150 dpi is 1200 px, text of 10 to 12 pt (STYLE) stays readable at that width.
WIDTH_IN, DPI = 8.0, 150
STYLE: dict[str, Any] = {
    "font.size": 11,
    "axes.titlesize": 12,
    "axes.labelsize": 11,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 10,
    "legend.title_fontsize": 10,
}
BUDGET_FLOOR = 1e-3  # error / bound below this is drawn at the figure's floor: far from the bound either way
BUDGET_CAP = 1e4  # and above this at its ceiling: a failure either way
NOT_RECORDED = "not recorded"  # the device kind of a case or failure from before kinds were recorded
MARGIN = 2.0  # a log axis reaches this factor past its data
ZERO_LABEL = "exactly 0"


@dataclasses.dataclass
class _Corpus:
    """What the report needs from a corpus, accumulated line by line (cases.jsonl can
    be large, so per-case records are not kept)."""

    path: str
    campaign: dict[str, Any] | None = None
    present: dict[str, bool] = dataclasses.field(default_factory=dict)
    skipped_lines: Counter = dataclasses.field(default_factory=Counter)
    tasks: int = 0
    outcomes: Counter = dataclasses.field(default_factory=Counter)
    cases: int = 0
    last_t: float = 0.0
    case_times: list[float] = dataclasses.field(default_factory=list)
    budgets: dict[tuple[str, str], list[float]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    error_bound: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    # the same points by (dtype, check), for the figure: a bound means different things per dtype and check
    by_dtype_check: dict[tuple[str, str], list[tuple[float, float]]] = dataclasses.field(
        default_factory=lambda: defaultdict(list)
    )
    shapes: dict[str, Counter] = dataclasses.field(default_factory=lambda: defaultdict(Counter))
    configs: dict[str, Counter] = dataclasses.field(default_factory=lambda: defaultdict(Counter))
    kinds: dict[str, Counter] = dataclasses.field(default_factory=lambda: defaultdict(Counter))
    failures: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    unreadable: list[str] = dataclasses.field(default_factory=list)  # JSON files that do not parse
    # by device kind ("not recorded": a corpus written before kinds were): tasks, and each case's worst budget
    device_tasks: Counter = dataclasses.field(default_factory=Counter)
    device_budgets: dict[str, list[float]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    probes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------- reading


def _records(corpus: _Corpus, name: str) -> Iterator[dict[str, Any]]:
    """The JSON objects of a .jsonl file; a line that does not parse (the last one of a
    killed campaign) is counted and skipped."""
    path = os.path.join(corpus.path, name)
    corpus.present[name] = os.path.isfile(path)
    if not corpus.present[name]:
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict):
                yield record
            else:
                corpus.skipped_lines[name] += 1


def _budget(value: Any) -> float:
    # null is how JSON carries an infinite budget (NaN where the oracle is finite);
    # Python's json also writes a bare NaN, which means the same.
    return math.inf if value is None or math.isnan(value) else float(value)


def _json_file(path: str) -> Any:
    """A JSON file's value, or None if it does not parse. NaN and Infinity in it become
    strings, so they pass through to the strict report.json."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f, parse_constant=str)
    except (OSError, json.JSONDecodeError):
        return None


def _shape_key(shapes: Any) -> str:
    if not isinstance(shapes, dict) or not shapes:
        return "(none)"
    return ", ".join(f"{name}={'x'.join(map(str, dims)) or 'scalar'}" for name, dims in shapes.items())


def _config_key(config: Any) -> str:
    if config is None:
        return "default"
    if isinstance(config, dict):
        return ", ".join(f"{k}={v}" for k, v in sorted(config.items()))
    return config if isinstance(config, str) else json.dumps(config)


def _add_case(corpus: _Corpus, case: dict[str, Any]) -> None:
    kernel, dtype = str(case.get("kernel", "?")), str(case.get("dtype", "?"))
    corpus.cases += 1
    corpus.case_times.append(float(case.get("t", 0.0)))
    checks = case.get("checks") or {}
    device = str(case.get("device_kind") or NOT_RECORDED)
    if checks:
        # A case is as bad as its worst check.
        corpus.budgets[(kernel, dtype)].append(max(_budget(c.get("budget")) for c in checks.values()))
        corpus.device_budgets[device].append(corpus.budgets[(kernel, dtype)][-1])
    elif device not in corpus.device_budgets:
        corpus.device_budgets[device] = []
    for name, check in checks.items():
        # Checks that compare bits (deterministic) have no error or bound to plot.
        error, bound = check.get("error"), check.get("bound")
        if error is not None and bound is not None and math.isfinite(error) and math.isfinite(bound):
            corpus.error_bound[kernel].append((float(error), float(bound)))
            corpus.by_dtype_check[(dtype, str(name).split(":")[0])].append((float(error), float(bound)))
    corpus.shapes[kernel][_shape_key(case.get("shapes"))] += 1
    corpus.configs[kernel][_config_key(case.get("config"))] += 1
    corpus.kinds[kernel][str(case.get("kind", "?"))] += 1


def _read_failures(corpus: _Corpus) -> None:
    root = os.path.join(corpus.path, FAILURES)
    corpus.present[FAILURES] = os.path.isdir(root)
    if not corpus.present[FAILURES]:
        return
    for signature in sorted(os.listdir(root)):
        path = os.path.join(root, signature, "failure.json")
        if not os.path.isfile(path):
            continue
        failure = _json_file(path)
        if isinstance(failure, dict):
            failure.setdefault("signature", signature)
            corpus.failures.append(failure)
        else:
            corpus.unreadable.append(os.path.join(FAILURES, signature, "failure.json"))
    # Unknown first-seen times sort last.
    corpus.failures.sort(key=lambda f: (f.get("first_seen_t") is None, f.get("first_seen_t") or 0.0))


def _load(path: str) -> _Corpus:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"corpus directory {path!r} does not exist")
    corpus = _Corpus(os.path.abspath(path))
    campaign_path = os.path.join(path, CAMPAIGN)
    corpus.present[CAMPAIGN] = os.path.isfile(campaign_path)
    if corpus.present[CAMPAIGN]:
        campaign = _json_file(campaign_path)
        if isinstance(campaign, dict):
            corpus.campaign = campaign
        else:
            corpus.unreadable.append(CAMPAIGN)
    for event in _records(corpus, EVENTS):
        corpus.tasks += 1
        corpus.outcomes[str(event.get("outcome", "?"))] += 1
        corpus.device_tasks[str(event.get("device_kind") or NOT_RECORDED)] += 1
        corpus.last_t = max(corpus.last_t, float(event.get("t", 0.0)))
    for case in _records(corpus, CASES):
        _add_case(corpus, case)
    corpus.case_times.sort()
    if corpus.case_times:
        corpus.last_t = max(corpus.last_t, corpus.case_times[-1])
    _read_failures(corpus)
    try:
        corpus.probes = probes(path)
    except (OSError, json.JSONDecodeError, KeyError):
        corpus.unreadable.append("probes/")
    return corpus


# ---------------------------------------------------------------------------- summary


def _finite_or_inf(x: float) -> float | str:
    # Strict JSON has no infinity; the report spells it "inf".
    return x if math.isfinite(x) else "inf"


def _stats(budgets: list[float]) -> dict[str, Any]:
    """count, inf (how many were infinite), median, p90, max. Quantiles are nearest-rank
    over all budgets, infinite ones included, so p90 is "inf" when over 10% are."""
    median, p90 = np.quantile(budgets, [0.5, 0.9], method="inverted_cdf")
    return {
        "count": len(budgets),
        "inf": sum(not math.isfinite(b) for b in budgets),
        "median": _finite_or_inf(float(median)),
        "p90": _finite_or_inf(float(p90)),
        "max": _finite_or_inf(max(budgets)),
    }


def _ratio_stats(points: list[tuple[float, float]]) -> dict[str, Any]:
    """points, zero errors, above the bound, and the median and largest error / bound."""
    ratios = [e / b if b > 0 else (0.0 if e == 0 else math.inf) for e, b in points]
    return {
        "points": len(points),
        "zero_error": sum(e == 0 for e, _ in points),
        "above_bound": sum(e > b for e, b in points),
        "median_budget": _finite_or_inf(float(np.quantile(ratios, 0.5, method="inverted_cdf"))),
        "max_budget": _finite_or_inf(max(ratios)),
    }


def _duration(corpus: _Corpus) -> float:
    """The campaign's wall seconds (summed over resumes), else the last timestamp seen."""
    seconds = (corpus.campaign or {}).get("seconds")
    return float(seconds) if seconds is not None else corpus.last_t


def _throughput(times: list[float]) -> list[list[float]]:
    """[t, cases so far] at up to THROUGHPUT_POINTS evenly spaced cases, the last included."""
    if not times:
        return []
    picks = np.unique(np.linspace(0, len(times) - 1, min(len(times), THROUGHPUT_POINTS)).astype(int))
    return [[times[i], int(i) + 1] for i in picks]


def _by_device(corpus: _Corpus) -> dict[str, dict[str, Any]]:
    """Per device kind: tasks, cases, failures by kind, the worst budgets' statistics,
    and its probe's verdict ("holds", the violations, or "not probed")."""
    kinds = set(corpus.device_tasks) | set(corpus.device_budgets) | set(corpus.probes)
    kinds |= {str(f.get("device_kind") or NOT_RECORDED) for f in corpus.failures}
    out = {}
    for kind in sorted(kinds):
        failures = [f for f in corpus.failures if str(f.get("device_kind") or NOT_RECORDED) == kind]
        budgets = corpus.device_budgets.get(kind, [])
        probe = corpus.probes.get(kind)
        verdict: Any = "not probed" if probe is None else list(device_arithmetic.violations(probe)) or "holds"
        out[kind] = {
            "tasks": corpus.device_tasks.get(kind, 0),
            "cases": len(budgets),
            "failures": len(failures),
            "failures_by_kind": {k: sum(f.get("kind") == k for f in failures) for k in FAILURE_KINDS},
            "budget_used": _stats(budgets) if budgets else None,
            "tolerance_model": verdict,
        }
    return out


def _summary(corpus: _Corpus) -> dict[str, Any]:
    campaign = corpus.campaign or {}
    seconds = _duration(corpus)
    by_kernel: dict[str, list[float]] = defaultdict(list)
    for (kernel, _), budgets in corpus.budgets.items():
        by_kernel[kernel].extend(budgets)
    by_kernel_dtype: dict[str, dict[str, Any]] = defaultdict(dict)
    for (kernel, dtype), budgets in sorted(corpus.budgets.items()):
        by_kernel_dtype[kernel][dtype] = _stats(budgets)
    return {
        "corpus": corpus.path,
        "files": {name: corpus.present.get(name, False) for name in (CAMPAIGN, EVENTS, CASES, FAILURES)},
        "skipped_lines": dict(corpus.skipped_lines),
        "campaign": {
            k: campaign.get(k) for k in ("version", "backend", "jax", "started", "seconds", "targeted", "next_seed")
        },
        "totals": {
            "tasks": corpus.tasks,
            "task_outcomes": dict(sorted(corpus.outcomes.items())),
            "cases": corpus.cases,
            "seconds": seconds,
            "cases_per_second": corpus.cases / seconds if seconds > 0 else None,
            "findings": len(findings.group(corpus.failures)),
            "failures": len(corpus.failures),
            "failures_by_kind": {kind: sum(f.get("kind") == kind for f in corpus.failures) for kind in FAILURE_KINDS},
            "failure_occurrences": sum(int(f.get("count", 1)) for f in corpus.failures),
        },
        "by_device_kind": _by_device(corpus),
        "budget_used": {
            "by_kernel": {k: _stats(b) for k, b in sorted(by_kernel.items())},
            "by_kernel_dtype": dict(by_kernel_dtype),
        },
        "error_vs_bound": {
            k: {"points": len(p), "above_bound": sum(e > b for e, b in p)}
            for k, p in sorted(corpus.error_bound.items())
        },
        "error_vs_bound_by_dtype_check": {
            f"{dtype} {check}": _ratio_stats(points) for (dtype, check), points in sorted(corpus.by_dtype_check.items())
        },
        "coverage": {
            kernel: {
                "shapes": dict(corpus.shapes[kernel].most_common()),
                "configs": dict(corpus.configs[kernel].most_common()),
                "kinds": dict(corpus.kinds[kernel].most_common()),
            }
            for kernel in sorted(corpus.shapes)
        },
        "arms": campaign.get("arms") or [],
        "failures": corpus.failures,
        "findings": [
            dict(finding, members=[m.get("signature") for m in finding["members"]])
            for finding in findings.group(corpus.failures)
        ],
        "unreadable": corpus.unreadable,
        "throughput": _throughput(corpus.case_times),
    }


def summarise(corpus: str) -> dict[str, Any]:
    """The report's numbers for the corpus directory ``corpus``, as strict-JSON data.

    Keys: ``campaign`` (backend, jax, started, seconds, ...), ``files`` (which corpus
    files exist), ``skipped_lines`` (unparseable lines per file), ``totals`` (tasks,
    task outcomes, cases, seconds, cases_per_second, findings, failures,
    failures_by_kind, failure_occurrences), ``by_device_kind`` (per kind of device the
    workers ran on: tasks, cases, failures, failures_by_kind, budget_used stats or None,
    and ``tolerance_model``: "holds", the probe's violations, or "not probed"), ``budget_used`` (``by_kernel`` and ``by_kernel_dtype`` stats:
    count, inf, median, p90, max, where a case's budget is its worst check's error /
    bound and an infinite one is written "inf"), ``error_vs_bound`` (points and how many
    exceed their bound, per kernel), ``coverage`` (shape, config and input-kind counts
    per kernel), ``arms`` (campaign.json's), ``failures`` (the failure.json records,
    oldest first), ``findings`` (the failures grouped by ``findings.group``, each with
    its members' signatures), ``unreadable`` (JSON files left out because they do not parse) and
    ``throughput`` ([seconds, cumulative cases] pairs).
    """
    return _summary(_load(corpus))


# ---------------------------------------------------------------------------- figures


def _matplotlib() -> tuple[Any, Any]:
    """matplotlib's Figure and Agg canvas (no pyplot: no global state, no display)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "the fuzz report draws its figures with matplotlib, which is not installed: "
            "pip install 'pallascheck[user]' (or matplotlib alone)"
        ) from err
    return Figure, FigureCanvasAgg


def _style() -> Any:
    """The figures' text sizes (STYLE), for the figure drawn inside it."""
    import matplotlib  # an optional dependency: only where figures are drawn

    return matplotlib.rc_context(cast(Any, STYLE))  # its stubs list the keys as literals


def _png(fig: Any, canvas: Any) -> str:
    buffer = io.BytesIO()
    canvas(fig)  # attaches the Agg canvas that savefig draws on
    fig.savefig(buffer, format="png", bbox_inches="tight")  # tight: long axis labels are not clipped
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


@dataclasses.dataclass(frozen=True)
class _Band:
    """What a log axis of ratios shows: positive values from ``low`` to ``high`` (the
    data with a margin), exact zeros on their own marked row or column at ``zero``
    below ``low``; values past the band are drawn on the edge they passed. The axis
    and its caption both read it, so the caption's numbers are the axis'."""

    low: float
    high: float
    zero: float

    @property
    def limits(self) -> tuple[float, float]:
        return self.zero / MARGIN, self.high

    def text(self) -> str:
        return f"{self.low:.3g} to {self.high:.3g}"


def _band(values: list[float] | np.ndarray) -> _Band:
    """The band of error / bound ratios (or budgets) worth reading: from the smallest
    positive value (not below BUDGET_FLOOR: far from the bound either way) to the
    largest finite one (not above BUDGET_CAP: a failure either way), the bound (1)
    always inside, each end a MARGIN further out."""
    finite = np.asarray([v for v in values if 0 < v < math.inf], dtype=float)
    smallest = max(float(finite.min()), BUDGET_FLOOR) if finite.size else BUDGET_FLOOR
    largest = min(float(finite.max()), BUDGET_CAP) if finite.size else 1.0
    low, high = min(smallest, 1.0) / MARGIN, max(largest, 1.0) * MARGIN
    return _Band(low, high, low / MARGIN**2)


def _zero_strip(ax: Any, band: _Band, axis: str) -> None:
    """Shade the strip of exact zeros below the band and name it on the axis."""
    span, ticks, labels = (
        (ax.axvspan, ax.get_xticks, ax.set_xticks) if axis == "x" else (ax.axhspan, ax.get_yticks, ax.set_yticks)
    )
    span(band.zero / MARGIN, band.low / math.sqrt(MARGIN), color="0.92", zorder=0)
    shown = [t for t in ticks() if band.low <= t <= band.high]
    labels([band.zero, *shown], [ZERO_LABEL, *(f"{t:g}" for t in shown)])


def _budget_axes(corpus: _Corpus) -> tuple[_Band, float]:
    """The budget figure's band and where its infinite budgets are drawn (right of the
    band's end, inside the axis)."""
    band = _band([b for budgets in corpus.budgets.values() for b in budgets])
    return band, band.high / math.sqrt(MARGIN)


def _budget_fig(corpus: _Corpus, mpl: tuple[Any, Any]) -> Any:
    Figure, _ = mpl
    rows = sorted(corpus.budgets)
    band, inf_at = _budget_axes(corpus)
    with _style():
        fig = Figure(figsize=(WIDTH_IN, 1.6 + 0.45 * len(rows)), dpi=DPI)
        ax = fig.add_subplot()
        jitter = np.random.default_rng(0)
        for y, key in enumerate(rows):
            budgets = np.array(corpus.budgets[key])
            finite = budgets[np.isfinite(budgets)]
            shown = np.where(finite == 0, band.zero, np.clip(finite, band.low, inf_at))
            shown = shown[:: max(1, shown.size // POINTS_PER_SERIES)]
            if shown.size:
                ax.scatter(
                    shown, y + jitter.uniform(-0.2, 0.2, shown.size), s=10, alpha=0.3, color="tab:blue", zorder=1
                )
            positive = np.clip(finite[finite > 0], band.low, inf_at)
            if positive.size:
                # The box drawn by hand (boxplot's orientation argument differs across matplotlib
                # versions), over the points: quartiles, median and the full range of the nonzero ones.
                q1, median, q3 = np.quantile(positive, [0.25, 0.5, 0.75])
                ax.hlines(y, positive.min(), positive.max(), color="black", linewidth=1, zorder=2)
                ax.barh(y, q3 - q1, left=q1, height=0.5, fill=False, edgecolor="black", linewidth=1.2, zorder=2)
                ax.vlines(median, y - 0.25, y + 0.25, color="black", linewidth=2.5, zorder=2)
            infinite = int((~np.isfinite(budgets)).sum())
            if infinite:
                ax.scatter([inf_at], [y], marker=">", color="tab:red", s=40)
                ax.annotate(
                    f"{infinite} inf",
                    (inf_at, y),
                    xytext=(-4, 8),
                    textcoords="offset points",
                    ha="right",
                    color="tab:red",
                )
        ax.axvline(1.0, color="tab:red", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlim(*band.limits)
        _zero_strip(ax, band, "x")
        ax.set_yticks(range(len(rows)), [f"{k} {d}" for k, d in rows])
        ax.set_ylim(-0.7, len(rows) - 0.3)
        ax.invert_yaxis()
        ax.set_xlabel(f"budget used = error / bound, worst check per case ({band.text()}; dashed: the bound)")
        fig.tight_layout()
    return fig


def _budget_figure(corpus: _Corpus, mpl: tuple[Any, Any]) -> str:
    return _png(_budget_fig(corpus, mpl), mpl[1])


def _error_bound_axes(corpus: _Corpus) -> tuple[_Band, tuple[float, float]]:
    """The error / bound figure's band (y) and bound range (x: the middle 90% of the
    bounds, a MARGIN further out each way; a bound far outside it is drawn on the edge)."""
    points = [p for points in corpus.by_dtype_check.values() for p in points if p[1] > 0]
    band = _band([e / b for e, b in points])
    bounds = np.array([b for _, b in points])
    low, high = np.quantile(bounds, [0.05, 0.95]) if bounds.size else (1e-8, 1.0)
    return band, (float(low) / MARGIN, float(high) * MARGIN)


def _error_bound_fig(corpus: _Corpus, mpl: tuple[Any, Any]) -> Any:
    """One panel per dtype: error / bound against the bound, one colour per check, on
    ``_error_bound_axes``: points outside are drawn on the edge they passed (triangles),
    exact zeros on the marked row below the band."""
    Figure, _ = mpl
    dtypes = sorted({dtype for dtype, _ in corpus.by_dtype_check})
    band, (low, high) = _error_bound_axes(corpus)
    with _style():
        fig = Figure(figsize=(WIDTH_IN, 5.2), dpi=DPI)
        axes = fig.subplots(1, len(dtypes), sharey=True, squeeze=False)[0]
        for ax, dtype in zip(axes, dtypes):
            for (d, check), points in sorted(corpus.by_dtype_check.items()):
                if d != dtype:
                    continue
                stride = max(1, len(points) // POINTS_PER_SERIES)
                error, bound = (np.array(v) for v in zip(*points[::stride]))
                keep = bound > 0
                ratio, x = error[keep] / bound[keep], np.clip(bound[keep], low, high)
                colour = check_kinds.COLOURS.get(check, "C7")
                zeros = int((error == 0).sum())
                sideways = (bound[keep] < low) | (bound[keep] > high)
                below, above = (ratio > 0) & (ratio < band.low), ratio > band.high
                inside = (ratio > 0) & ~below & ~above
                ax.scatter(
                    x[inside & ~sideways],
                    ratio[inside & ~sideways],
                    s=14,
                    alpha=0.5,
                    color=colour,
                    label=f"{check} ({len(points)}{f', {zeros} exact' if zeros else ''})",
                )
                ax.scatter(x[inside & sideways], ratio[inside & sideways], s=18, marker=">", alpha=0.5, color=colour)
                ax.scatter(x[below], np.full(below.sum(), band.low), s=18, marker="v", alpha=0.5, color=colour)
                ax.scatter(x[above], np.full(above.sum(), band.high), s=22, marker="^", color=colour)
                ax.scatter(
                    x[ratio == 0],
                    np.full(int((ratio == 0).sum()), band.zero),
                    s=18,
                    marker="o",
                    facecolors="none",
                    edgecolors=colour,
                )
            ax.axhline(1.0, color="tab:red", linestyle="--", linewidth=1)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(low, high)
            ax.set_ylim(*band.limits)
            _zero_strip(ax, band, "y")
            ax.set_title(dtype)
            ax.set_xlabel("bound")
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=1, title="check (cases)", frameon=False)
        axes[0].set_ylabel("error / bound (dashed: the bound)")
        fig.tight_layout()
    return fig


def _error_bound_figure(corpus: _Corpus, mpl: tuple[Any, Any]) -> str:
    return _png(_error_bound_fig(corpus, mpl), mpl[1])


def _throughput_figure(corpus: _Corpus, mpl: tuple[Any, Any]) -> str:
    Figure, canvas = mpl
    with _style():
        fig = Figure(figsize=(WIDTH_IN, 3.6), dpi=DPI)
        ax = fig.add_subplot()
        _throughput_plot(ax, corpus)
        fig.tight_layout()
    return _png(fig, canvas)


def _throughput_plot(ax: Any, corpus: _Corpus) -> None:
    t, cumulative = zip(*_throughput(corpus.case_times))
    ax.step(t, cumulative, where="post", color="tab:blue", label="cases checked")
    colours = dict(zip(FAILURE_KINDS, ("tab:red", "tab:purple", "tab:orange", "tab:brown")))
    for kind in FAILURE_KINDS:
        seen = [
            f["first_seen_t"] for f in corpus.failures if f.get("kind") == kind and f.get("first_seen_t") is not None
        ]
        for i, first in enumerate(seen):
            ax.axvline(
                first,
                color=colours[kind],
                linewidth=1,
                linestyle=":",
                label=f"{kind} failure first seen" if i == 0 else None,
            )
    ax.set_xlabel("seconds since the campaign started")
    ax.set_ylabel("cumulative cases")
    ax.legend(loc="upper left")


# ---------------------------------------------------------------------------- HTML


class _Html(str):
    """Markup built here from escaped parts; every other cell is escaped."""


def _e(value: Any) -> str:
    return value if isinstance(value, _Html) else html.escape(str(value))


def _num(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def _table(headers: list[str], rows: list[list[Any]], cls: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    tr = f'<tr class="{_e(cls)}">' if cls else "<tr>"
    body = "".join(tr + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _img(src: str, alt: str) -> str:
    return f'<img src="{src}" alt="{_e(alt)}">'


def _empty(text: str) -> str:
    return f'<p class="empty">{_e(text)}</p>'


def _duration_text(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    h, m = divmod(minutes, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def _header(summary: dict[str, Any]) -> str:
    campaign, totals = summary["campaign"], summary["totals"]
    started = campaign.get("started")
    outcomes = ", ".join(f"{k} {v}" for k, v in totals["task_outcomes"].items()) or "none"
    failures = ", ".join(f"{k} {v}" for k, v in totals["failures_by_kind"].items())
    rows = [
        ["backend", campaign.get("backend") or "unknown"],
        ["jax", campaign.get("jax") or "unknown"],
        ["started", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if started else "unknown"],
        ["duration", _duration_text(totals["seconds"])],
        [
            "targeted",
            {True: "yes", False: "no", None: "unknown"}.get(campaign.get("targeted"), campaign.get("targeted")),
        ],
        ["tasks", f"{totals['tasks']} ({outcomes})"],
        ["cases", totals["cases"]],
        ["cases / s", _num(totals["cases_per_second"])],
        [
            "failures",
            f"{totals['findings']} finding(s) of {totals['failures']} distinct failure(s) ({failures}); "
            f"seen {totals['failure_occurrences']} times",
        ],
        # AFL++'s "last saved crash": a search still finding new failures near its end is not done
        ["last new failure", _last_new(summary)],
    ]
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    # No failures/ folder is the normal case, not worth a note.
    notes = [f"{name} is missing." for name, present in summary["files"].items() if not present and name != FAILURES]
    notes += [
        f"{name}: {n} line(s) that do not parse were skipped (a campaign killed mid-write)."
        for name, n in summary["skipped_lines"].items()
    ]
    notes += [f"{path} does not parse and is left out." for path in summary["unreadable"]]
    if not totals["cases"]:
        notes.append("No cases were recorded.")
    note_html = "".join(f"<li>{_e(n)}</li>" for n in notes)
    return (
        f"<header><h1>pallascheck fuzz report</h1><p>corpus <code>{_e(summary['corpus'])}</code></p>"
        f'<table class="meta"><tbody>{body}</tbody></table>'
        + (f'<ul class="notes">{note_html}</ul>' if notes else "")
        + "</header>"
    )


def _last_new(summary: dict[str, Any]) -> str:
    seen = [f["first_seen_t"] for f in summary["failures"] if isinstance(f.get("first_seen_t"), (int, float))]
    if not seen:
        return "none"
    gap = summary["totals"]["seconds"] - max(seen)
    return f"at {_duration_text(max(seen))}, {_duration_text(max(gap, 0.0))} before the end"


def _failures_section(summary: dict[str, Any]) -> str:
    failures = summary["failures"]
    if not failures:
        return '<section id="failures"><h2>Findings</h2>' + _empty("No failures were recorded.") + "</section>"
    grouped = findings.group(failures)
    number = {id(f): i for i, f in enumerate((m for g in grouped for m in g["members"]), 1)}
    rows = [
        [
            g["kind"],
            g["kernel"],
            ", ".join(g["dtypes"]),
            ", ".join(g["checks"]),
            len(g["members"]),
            g["count"],
            _num(g["first_seen_t"]),
            headline(str(g["members"][0].get("message") or "")),
            _Html(" ".join(f'<a href="#finding-{number[id(m)]}">#{number[id(m)]}</a>' for m in g["members"])),
        ]
        for g in grouped
    ]
    headers = ["kind", "kernel", "dtypes", "checks", "failures", "seen", "first seen (s)", "what went wrong", "members"]
    return (
        '<section id="failures"><h2>Findings</h2><p>One row per finding, oldest first: the failures whose '
        "signatures differ only in dtype and check (the same kernel failing the same way: the same failure "
        "kind and worst-element pattern), most likely one bug. Below the table, each finding's members in "
        "full, each with the command that replays its saved case.</p>"
        + _table(headers, rows, cls="failure")
        + "".join(
            f'<div class="group"><h3>Finding {k}: {_e(findings.title(g))}</h3>'
            + "".join(_finding(number[id(m)], m) for m in g["members"])
            + "</div>"
            for k, g in enumerate(grouped, 1)
        )
        + "</section>"
    )


_DETAIL = re.compile(r"error=(\S+) bound=(\S+) \(budget used (\S+)\)")


def _finding(number: int, failure: dict[str, Any]) -> str:
    """One failure in full: where its check was worst (output, element, error, bound,
    budget), the shapes and config of its saved case, its message and replay command."""
    worst = failure.get("worst") or {}
    error, bound, budget = worst.get("error"), worst.get("bound"), failure.get("budget")
    parsed = _DETAIL.search(str(failure.get("message") or ""))
    if not worst and parsed:  # a record written before the worst element was stored
        error, bound, budget = (float(v) for v in parsed.groups())
    if worst:
        index = ", ".join(map(str, worst.get("index") or []))
        where = f"{worst.get('output', 'out')}[{index}] of shape {_shape_text(worst.get('shape'))}"
        budget_text = "inf (non-finite, or differing where exactness is promised)" if budget is None else _num(budget)
    else:
        where, budget_text = "not recorded", _num(budget)
    items = [
        ("worst element", where),
        ("error", _num(error)),
        ("bound", _num(bound)),
        ("budget used (error / bound)", budget_text),
        ("shapes", _shape_key(failure.get("shapes")) if failure.get("shapes") else "not recorded"),
        ("config", _config_key(failure.get("config")) if "config" in failure else "not recorded"),
        (
            "input kind, config slot",
            f"{failure.get('input_kind', '?')}, "
            f"{'drawn' if failure.get('config_slot') is None else failure['config_slot']}",
        ),
        ("seen", f"{failure.get('count', 1)} time(s), first at {_num(failure.get('first_seen_t'))} s"),
    ]
    rows = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in items)
    title = (
        f"{number}. {failure.get('kind', '?')} failure: {failure.get('kernel', '?')} {failure.get('dtype', '?')} "
        f"[{failure.get('check', '?')}]"
    )
    return (
        f'<div class="finding" id="finding-{number}"><h4>{_e(title)}</h4><dl>{rows}</dl>'
        f"<pre>{_e(str(failure.get('message') or '').strip())}</pre>"
        f"<p>replay: <code>{_e(failure.get('replay') or '')}</code></p></div>"
    )


def _shape_text(shape: Any) -> str:
    return "(" + ", ".join(map(str, shape or [])) + ")"


def _budget_caption(corpus: _Corpus) -> str:
    band, _ = _budget_axes(corpus)
    return (
        f"Per case, the worst check's error / bound, drawn from {band.text()}: above 1 (dashed) is a failure; "
        "far below 1 is a loose bound that can hide bugs. Budgets past either end are drawn on it; exact "
        f"results (error 0) on the grey column \u201c{ZERO_LABEL}\u201d. Infinite budgets (NaN or inf where "
        "the oracle is finite, differing bits) are counted apart, at the right edge (\u25b6)."
    )


def _budget_section(summary: dict[str, Any], corpus: _Corpus, mpl: tuple[Any, Any]) -> str:
    head = '<section id="budget"><h2>Budget used</h2>'
    if not corpus.budgets:
        return head + _empty("No cases were recorded.") + "</section>"
    rows = [
        [kernel, dtype, s["count"], s["inf"], _num(s["median"]), _num(s["p90"]), _num(s["max"])]
        for kernel, dtypes in summary["budget_used"]["by_kernel_dtype"].items()
        for dtype, s in dtypes.items()
    ]
    table = _table(["kernel", "dtype", "cases", "inf", "median", "p90", "max"], rows)
    return (
        head
        + f"<p>{_e(_budget_caption(corpus))}</p>"
        + _img(_budget_figure(corpus, mpl), "budget used per kernel and dtype")
        + table
        + "</section>"
    )


def _error_bound_caption(corpus: _Corpus) -> str:
    band, (low, high) = _error_bound_axes(corpus)
    return (
        "Each case's worst error as a share of its bound, by dtype (one panel each) and check (one colour "
        f"each), drawn from {band.text()}: above the dashed line (1) a case failed; near it the bound is "
        "tight. Shares past either end are drawn on it (\u25bc, \u25b2); exact results (error 0) on the grey "
        f"row \u201c{ZERO_LABEL}\u201d. Bounds from {low:.3g} to {high:.3g} (the middle 90%, {MARGIN:g} times "
        "wider each way); those outside are drawn on the side edge (\u25b6)."
    )


def _error_bound_section(summary: dict[str, Any], corpus: _Corpus, mpl: tuple[Any, Any]) -> str:
    head = '<section id="error-bound"><h2>Error vs bound</h2>'
    if not corpus.error_bound:
        return head + _empty("No checks with an error and a bound were recorded.") + "</section>"
    rows = [
        [
            key.split(" ", 1)[0],
            key.split(" ", 1)[1],
            s["points"],
            s["zero_error"],
            _num(s["median_budget"]),
            _num(s["max_budget"]),
            s["above_bound"],
        ]
        for key, s in summary["error_vs_bound_by_dtype_check"].items()
    ]
    return (
        head
        + f"<p>{_e(_error_bound_caption(corpus))}</p>"
        + _img(_error_bound_figure(corpus, mpl), "error / bound against bound, by dtype and check")
        + _table(["dtype", "check", "cases", "exact", "median error / bound", "max", "above the bound"], rows)
        + "</section>"
    )


def _device_section(summary: dict[str, Any]) -> str:
    head = (
        '<section id="devices"><h2>By device kind</h2><p>What ran on each kind of device (a cluster may mix '
        "them), and what the arithmetic probe run there found: where the tolerance model's assumptions do not "
        "hold, the checks against a bound were not run on that kind (only the bitwise reruns were).</p>"
    )
    kinds = summary["by_device_kind"]
    if not kinds:
        return head + _empty("No tasks were recorded.") + "</section>"
    rows = [
        [
            kind,
            d["tasks"],
            d["cases"],
            f"{d['failures']} ({', '.join(f'{k} {n}' for k, n in d['failures_by_kind'].items() if n) or 'none'})",
            _num((d["budget_used"] or {}).get("median")),
            _num((d["budget_used"] or {}).get("max")),
            d["tolerance_model"]
            if isinstance(d["tolerance_model"], str)
            else "does not hold, bounded checks not run: " + "; ".join(d["tolerance_model"]),
        ]
        for kind, d in kinds.items()
    ]
    headers = ["device kind", "tasks", "cases", "failures", "median budget", "max budget", "tolerance model (probe)"]
    return head + _table(headers, rows) + "</section>"


def _counts_table(title: str, counts: dict[str, int]) -> str:
    rows: list[list[Any]] = [[value, n] for value, n in list(counts.items())[:COVERAGE_ROWS]]
    if len(counts) > COVERAGE_ROWS:
        rows.append([f"… {len(counts) - COVERAGE_ROWS} more (all in report.json)", ""])
    return _table([title, "cases"], rows)


def _coverage_section(summary: dict[str, Any]) -> str:
    head = '<section id="coverage"><h2>Coverage</h2><p>What each kernel was fuzzed with, most frequent first.</p>'
    if not summary["coverage"]:
        return head + _empty("No cases were recorded.") + "</section>"
    kernels = "".join(
        f'<h3>{_e(kernel)}</h3><div class="row">'
        + _counts_table("shapes", c["shapes"])
        + _counts_table("config", c["configs"])
        + _counts_table("input kind", c["kinds"])
        + "</div>"
        for kernel, c in summary["coverage"].items()
    )
    return head + kernels + "</section>"


def _throughput_section(summary: dict[str, Any], corpus: _Corpus, mpl: tuple[Any, Any]) -> str:
    head = '<section id="throughput"><h2>Throughput</h2>'
    figure = (
        _img(_throughput_figure(corpus, mpl), "cumulative cases over the campaign")
        if corpus.case_times
        else _empty("No cases were recorded.")
    )
    return head + figure + "</section>" + _search_section(summary)


def _choice(arm: dict[str, Any]) -> str:
    """An arm of the bandit in words."""
    option = arm.get("option")
    if arm.get("level") == "kind":
        return "inputs of any kind (unpinned draws)" if option == "any" else f"inputs of kind \u201c{option}\u201d"
    return "a config drawn at random" if option is None else f"config #{option} of the kernel's config space"


def _search_section(summary: dict[str, Any]) -> str:
    """Where a targeted campaign spent its tasks, in words (the bandit's arms)."""
    arms = summary["arms"]
    intro = (
        '<section id="search"><h2>Where the search spent its time</h2><p>Each task checks one kernel in one dtype. A targeted '
        "campaign then chooses the kind of inputs and the config, preferring the choices whose cases came "
        "closest to their error bound so far while still trying each now and then (the UCB1 rule). Below, "
        "per kernel and dtype: how many tasks each choice got, the highest share of the bound it reached "
        "(capped at 1: a failure) and its average. \u201cdone\u201d: no more tasks there, because every check had "
        "failed or the kernel crashed or hung.</p>"
    )
    if not arms:
        return intro + _empty("No choices recorded (campaign.json is missing or has none).") + "</section>"
    rows = [
        [
            a.get("kernel"),
            a.get("dtype"),
            _choice(a),
            a.get("pulls"),
            _num(a.get("best_budget")),
            _num(a.get("mean_reward")),
            "done" if a.get("retired") else "open",
        ]
        for a in sorted(arms, key=lambda a: (str(a.get("kernel")), str(a.get("dtype")), -(a.get("pulls") or 0)))
        if a.get("pulls")
    ]
    untried = sum(not a.get("pulls") for a in arms)
    note = _empty(f"{untried} other choice(s) got no task.") if untried else ""
    return (
        intro
        + _table(
            ["kernel", "dtype", "tasks went to", "tasks", "best share of the bound", "average", "kernel x dtype"], rows
        )
        + note
        + "</section>"
    )


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em auto;max-width:1200px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;margin-top:1.6em}h3{font-size:1.05em;margin:1em 0 .3em}h4{font-size:1em;margin:.5em 0 .2em}
table{border-collapse:collapse;margin:.5em 0;font-size:13px}
th,td{border:1px solid #ddd;padding:2px 6px;text-align:left;vertical-align:top}
thead th{background:#f3f3f3}
table.meta th{background:#f3f3f3;width:8em}
code{font:12px ui-monospace,monospace;overflow-wrap:anywhere;background:#f6f6f6}
tr.failure td:first-child{font-weight:bold;color:#b00}
.row{display:flex;flex-wrap:wrap;gap:1em;align-items:flex-start}
.empty{color:#666;font-style:italic}.notes{color:#8a5a00}
.finding{border-left:4px solid #b00;padding:.2em .8em;margin:1em 0;background:#fdf6f6}
.finding dl{display:grid;grid-template-columns:max-content auto;gap:1px 1em;margin:.3em 0}
.finding dt{color:#555}.finding dd{margin:0;font-family:ui-monospace,monospace;font-size:13px}
pre{font:12px ui-monospace,monospace;white-space:pre-wrap;background:#f6f6f6;padding:.4em;margin:.3em 0}
img{max-width:100%;display:block}
"""


def _page(summary: dict[str, Any], corpus: _Corpus, mpl: tuple[Any, Any]) -> str:
    title = f"pallascheck fuzz report: {os.path.basename(corpus.path)}"
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        + _header(summary)
        + _failures_section(summary)
        + _budget_section(summary, corpus, mpl)
        + _error_bound_section(summary, corpus, mpl)
        + _device_section(summary)
        + _coverage_section(summary)
        + _throughput_section(summary, corpus, mpl)
        + "</body></html>\n"
    )


def _replace(path: str, text: str) -> None:
    # Written beside and renamed over: a page refreshed while a running campaign's
    # report is regenerated is never half a file.
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write(corpus: str, out: str | None = None) -> tuple[str, str]:
    """Write ``report.html`` and ``report.json`` for the corpus directory ``corpus``
    into ``out`` (default: the corpus itself); return (html path, json path)."""
    mpl = _matplotlib()  # before anything is written
    loaded = _load(corpus)
    summary = _summary(loaded)
    out = corpus if out is None else out
    os.makedirs(out, exist_ok=True)
    html_path, json_path = os.path.join(out, "report.html"), os.path.join(out, "report.json")
    _replace(json_path, json.dumps(summary, indent=1, allow_nan=False) + "\n")
    _replace(html_path, _page(summary, loaded, mpl))
    return html_path, json_path
