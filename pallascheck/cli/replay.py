"""``pallascheck replay``: re-run the check that failed on a saved case."""

from __future__ import annotations

import argparse
import os
import shlex
import zipfile
from typing import Any

from pallascheck.cli._common import UsageError, add_backend_option, at_least, available_backend
from pallascheck.fuzz import import_path, targets, verify
from pallascheck.kernels.backends import get_backend
from pallascheck.properties import check_kinds, checks, runner
from pallascheck.properties.spec import Case

SAVED_BY = "a .npz saved by verify (under --failures, default .pallascheck/failures/) or fuzz (CORPUS/failures/)"


def _saved_case(path: str) -> tuple[Case, dict[str, Any]]:
    """The case saved at ``path`` and its failure record; a UsageError where there is none."""
    if not os.path.isfile(path):
        raise UsageError(f"replay FILE {path!r}: no such file; give {SAVED_BY}")
    try:
        case = Case.load(path)
        meta: dict[str, Any] = dict(case.params)["__failure__"]
        if not {"kernel", "dtype", "backend", "check", "config"} <= set(meta):  # what every saved case records
            raise KeyError("__failure__")
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile):
        raise UsageError(f"replay FILE {path!r} is not a saved case: give {SAVED_BY}") from None
    return Case(case.arrays, {k: v for k, v in case.params.items() if k != "__failure__"}), meta


def run(args: argparse.Namespace) -> int:
    import_path.add_paths(args.path or ())
    case, meta = _saved_case(args.file)
    try:  # the case's kernel: a MODULE:NAME that does not import says which --path to add
        targets.check_names([meta["kernel"]], option="the case's kernel")
    except ValueError as err:
        raise UsageError(str(err)) from None
    spec = targets.resolve(meta["kernel"])
    backend = available_backend(args.backend or meta["backend"])
    config_type = type(spec.default_config_for(get_backend(meta["backend"])))
    config = config_type(**meta["config"]) if isinstance(meta["config"], dict) else meta["config"]
    # The check that failed is the one replayed (a crash, hang or oom: every check), so
    # that the header and the verdict speak of the same check.
    selected = (meta["check"],) if meta["check"] in check_kinds.CHECKS else check_kinds.CHECKS
    print(
        f"replaying {meta['kernel']} {meta['dtype']} [{meta['check']}] on {backend}: {case.describe()}; config={config}"
    )
    if meta.get("paths"):
        print(f"code paths this case reaches: {'; '.join(meta['paths'])}")
    if meta.get("pairs"):
        print(f"parameter pairs this case meets: {'; '.join(meta['pairs'])}")
    if meta["check"] in ("hang", "crash", "oom"):
        print(
            f"this case was saved when its worker was lost or the kernel raised ({meta['check']}): {meta['message']}",
            flush=True,
        )
    # the command that runs this replay again, as given: its --path and --backend kept
    again = f"pallascheck replay {shlex.quote(args.file)}{verify.path_arguments(args.path or ())}" + (
        f" --backend {args.backend}" if args.backend else ""
    )
    context = checks.Context(kernel=spec.name, dtype=meta["dtype"], backend=str(backend), replay=again)
    failed = 0
    for run in range(args.repeat):
        if args.repeat > 1:
            print(f"run {run + 1} of {args.repeat}:", flush=True)
        failed += not _replay_once(spec, case, config, backend, context, selected)
    if args.repeat > 1:
        verdict = (
            "it fails every time"
            if failed == args.repeat
            else "it never fails"
            if not failed
            else "intermittent: the same case, config and program pass and fail (state kept between calls, "
            "a race, or the hardware)"
        )
        print(f"failed {failed} of {args.repeat} runs in this process: {verdict}")
    return 1 if failed else 0


def _replay_once(
    spec: Any, case: Case, config: Any, backend: Any, context: checks.Context, selected: tuple[str, ...]
) -> bool:
    """One check of the replayed case, its verdict printed; returns whether it passed."""
    try:
        tally = runner.check_case(spec, case, config, backend, context=context, selected=selected)
    except checks.CheckFailure as failure:
        print(f"FAIL [{runner.failed_check(failure)}]\n{failure}")
        return False
    except Exception as crash:  # noqa: BLE001 - the kernel raised: the finding a crash case records
        print(f"FAIL [crash]\n  {type(crash).__name__}: {crash}")
        return False
    print("PASS: " + ", ".join(f"{k} (budget {verify.fmt_budget(o.budget_used)})" for k, o in tally.outcomes.items()))
    return True


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``pallascheck replay``."""
    replay = sub.add_parser("replay", help="re-run the check that failed on a saved case")
    replay.add_argument("file", metavar="FILE", help="a saved case (.npz) from verify's --failures or a fuzz corpus")
    add_backend_option(replay, default="the backend the case was saved on")
    replay.add_argument("--path", action="append", help="a directory to import a MODULE:NAME kernel from")
    replay.add_argument(
        "--repeat",
        type=at_least(1),
        default=1,
        help="check the case this many times in one process and say whether it fails every time "
        "(a failure that comes and goes is intermittent)",
    )
    replay.set_defaults(func=run)
