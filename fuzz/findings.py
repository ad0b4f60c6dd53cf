"""Findings: the failures of a campaign grouped by the bug they most likely share.

The corpus keeps one record per signature (``corpus.signature``: kernel, dtype, check,
failure kind, worst-element pattern), so one bug found by two checks in two dtypes is
four records, each with its own saved case and replay command. A finding groups the
records whose signatures differ only in dtype and check:

- the checks of one case: a wrong result fails ``values`` and ``contract`` (and
  ``configs_agree``, ``gradients`` ...) at the same element; a campaign retires each
  check where it failed, so they come from separate tasks, and are grouped by where
  they failed, not by the task that found them;
- the same cause across dtypes: the same kernel failing the same way (the same
  ``corpus.worst_pattern``: output, finite or not, the last-index axes) in float32
  and bfloat16.

So the key is (kernel, failure kind, pattern): a value failure's pattern is its worst
element's, a crash's its first line with numbers blanked, and a kernel's hangs (and
its out-of-memory deaths) are one finding each. Two bugs of one kernel that fail at
elements of different patterns stay apart; two that share one are listed as one
finding with every member, each keeping its replay command, so nothing is lost.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def key(failure: dict[str, Any]) -> tuple[str, str, str]:
    """What the members of one finding share: kernel, failure kind and pattern."""
    # a record without a pattern (written before patterns were stored) stays on its own
    pattern = failure.get("pattern") or failure.get("signature") or "-"
    return (str(failure.get("kernel", "?")), str(failure.get("kind", "?")), str(pattern))


def group(failures: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The findings of ``failures`` (failure records, as the corpus stores them), in the
    order of their first member; each: ``kernel``, ``kind``, ``pattern``, ``dtypes`` and
    ``checks`` (sorted), ``count`` (occurrences over the members), ``first_seen_t`` and
    ``members`` (the records, in the order given)."""
    found: dict[tuple[str, str, str], dict[str, Any]] = {}
    for failure in failures:
        kernel, kind, pattern = key(failure)
        finding = found.setdefault(
            (kernel, kind, pattern), {"kernel": kernel, "kind": kind, "pattern": pattern, "members": []}
        )
        finding["members"].append(failure)
    for finding in found.values():
        members = finding["members"]
        finding["dtypes"] = sorted({str(m.get("dtype", "?")) for m in members})
        finding["checks"] = sorted({str(m.get("check", "?")) for m in members})
        finding["count"] = sum(int(m.get("count", 1)) for m in members)
        seen = [m["first_seen_t"] for m in members if isinstance(m.get("first_seen_t"), (int, float))]
        finding["first_seen_t"] = min(seen) if seen else None
    return list(found.values())


def title(finding: dict[str, Any]) -> str:
    """One line naming a finding: kind, kernel, its dtypes and checks."""
    return (
        f"[{finding['kind']}] {finding['kernel']} {', '.join(finding['dtypes'])} [{', '.join(finding['checks'])}]"
        f" ({len(finding['members'])} failure{'s' if len(finding['members']) != 1 else ''})"
    )
