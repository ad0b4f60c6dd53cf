"""Pairwise coverage of a spec's declared discrete parameters (``spec.Parameter``).

A pair is two values of two different parameters (config "32x16" and causal True);
a checked case meets the pairs of the values it takes. The declared pairs of a run
are every pair of values of every two parameters; ``runner.run_property`` counts
the pairs met and, with ``cover_pairs`` (``verify --cover-pairs``), draws for the
pairs its budgeted draws did not meet, greedily (``runner._draw_covering``), and
reports the ones no draw meets."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Any

from pallascheck.properties.spec import Case, Parameter

# ((parameter, value), (parameter, value)), the parameters in declaration order
Pair = tuple[tuple[str, Hashable], tuple[str, Hashable]]


def declared(parameters: Sequence[Parameter]) -> list[Pair]:
    """Every pair of values of two of ``parameters``, in declaration order."""
    names = [p.name for p in parameters]
    if len(set(names)) != len(names):
        raise ValueError(f"parameters must have distinct names, got {names}")
    return [
        ((a.name, x), (b.name, y))
        for a, b in itertools.combinations(parameters, 2)
        for x, y in itertools.product(a.values, b.values)
    ]


def values_of(parameter: Parameter, case: Case, config: Any) -> set[Hashable]:
    """The values ``case`` under ``config`` takes; a ValueError for one not declared."""
    taken = set(parameter.of(case, config))
    undeclared = taken - set(parameter.values)
    if undeclared:
        raise ValueError(
            f"parameter {parameter.name!r} took {sorted(map(repr, undeclared))}, not among its declared values "
            f"{list(parameter.values)}: every value a case can take must be declared"
        )
    return taken


def met(parameters: Sequence[Parameter], case: Case, config: Any) -> set[Pair]:
    """The pairs that checking ``case`` under ``config`` meets."""
    taken = [(p.name, values_of(p, case, config)) for p in parameters]
    return {
        ((a, x), (b, y)) for (a, xs), (b, ys) in itertools.combinations(taken, 2) for x, y in itertools.product(xs, ys)
    }


def label(pair: Pair) -> str:
    """How a pair is printed and stored: ``config=32x16 & causal=True``."""
    return " & ".join(f"{name}={value}" for name, value in pair)


def pinned_kind(pair: Pair, parameters: Sequence[Parameter]) -> str | None:
    """The element kind a draw for ``pair`` pins: its value of an element-kind parameter."""
    kinds = {p.name for p in parameters if p.element_kind}
    return next((str(value) for name, value in pair if name in kinds), None)
