"""The kinds of check: one table that the runner, verify's legend and counts, the fuzz
report's colours and the pytest plugin read.

Each per-case kind declares the oracle-side work it needs (``needs``): the runner
starts the union of the selected kinds' needs at once, before any check runs, so a
kind's oracle work is never computed twice nor left out. Adding a kind is this table
plus its body in ``runner._checks`` (docs/layout.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any


@dataclasses.dataclass(frozen=True)
class CheckKind:
    name: str
    legend: str  # what it checks, in verify's legend
    colour: str | None = None  # its colour in the fuzz report's figures (None: not drawn there)
    # oracle-side work the check needs, started before the checks run (runner._checks):
    # "bound" (the implementation bound at the case's config), "probabilistic_bound",
    # "default_bound" (at the backend's default config), "reference_bound" (at config
    # None: xla_reference's), "contract_bound", "exact_gradients", "gradient_bound",
    # "gradient_contract_bound"
    needs: frozenset[str] = frozenset()
    per_case: bool = True  # drawn cases (a property); False: once per spec or booked by the runner
    # whether a spec has this check at all (a KernelSpec -> bool); None: every spec has
    # it, or only its cases can tell (configs_agree runs where a case draws a config
    # other than the default)
    applies: Callable[[Any], bool] | None = None
    # whether its verdict compares with a bound of the tolerance model (or a relation's
    # tolerance): where the probe finds the model's arithmetic does not hold on a device
    # kind (oracles/device_arithmetic.py), such checks are not run there
    bounded: bool = True


def _always(spec: Any) -> bool:
    return True


KINDS: dict[str, CheckKind] = {
    k.name: k
    for k in (
        CheckKind(
            "values",
            "the kernel's output within its derived bound",
            "C0",
            frozenset({"bound", "probabilistic_bound"}),
            applies=_always,
        ),
        CheckKind(
            "reference",
            "xla_reference within the same bound",
            "C1",
            frozenset({"reference_bound", "contract_bound", "exact_gradients"}),
            applies=_always,
        ),
        CheckKind(
            "configs_agree", "configs within their bounds of each other", "C2", frozenset({"bound", "default_bound"})
        ),
        CheckKind(
            "gradients",
            "the VJP within its gradient bound",
            "C3",
            frozenset({"exact_gradients", "gradient_bound"}),
            applies=lambda spec: spec.gradients is not None,
        ),
        CheckKind(
            "contract",
            "the op's accuracy contract",
            "C4",
            frozenset({"contract_bound", "gradient_contract_bound", "exact_gradients"}),
            applies=lambda spec: (
                spec.contract is not None or (spec.gradients is not None and spec.gradients.contract is not None)
            ),
        ),
        CheckKind("deterministic", "bitwise reruns", applies=_always, bounded=False),
        CheckKind("metamorphic", "invariances", "C5", applies=lambda spec: bool(spec.relations)),
        CheckKind("errors", "bad input refused", per_case=False, bounded=False),
        CheckKind("crash", "the kernel raised", per_case=False, bounded=False),
    )
}

# The per-case checks, in the order a case runs them.
CHECKS: tuple[str, ...] = tuple(k.name for k in KINDS.values() if k.per_case)
# The per-case checks that need no tolerance model: what runs on a device kind whose
# arithmetic the model does not describe.
UNBOUNDED: tuple[str, ...] = tuple(name for name in CHECKS if not KINDS[name].bounded)
# The rows a property reports: its checks, and a crash as its own failed row.
REPORTED: tuple[str, ...] = (*CHECKS, "crash")
COLOURS: dict[str, str] = {k.name: k.colour for k in KINDS.values() if k.colour is not None}


def needs(selected: Iterable[str]) -> frozenset[str]:
    """The oracle-side work the ``selected`` checks need together."""
    return frozenset().union(*(KINDS[name].needs for name in selected))


def legend_line() -> str:
    """The kinds, as verify's legend lists them."""
    return ", ".join(f"{k.name} ({k.legend})" for k in KINDS.values())


def expected(spec: Any, selected: Iterable[str]) -> list[str]:
    """Of the ``selected`` per-case checks, those every run of ``spec`` must report: a
    row missing from its tally was not checked (the property stopped at its first
    failing case, or no case reached it), never passed."""
    return [name for name in selected if (applies := KINDS[name].applies) is not None and applies(spec)]
