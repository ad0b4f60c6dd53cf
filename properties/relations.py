"""Metamorphic relations shared by kernel specs."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from pallascheck.kernels.backends import Backend

from .spec import Case, Relation


def row_permutation(
    rows_of: Sequence[str],
    run: Callable[[Case, Any, Backend], Any],
    bound: Callable[[Case, Any, Backend], np.ndarray],
) -> Relation:
    """f(P x) = P f(x) for kernels whose output rows depend only on the same input
    rows (``rows_of``: the arrays permuted along axis 0). Each side is within its
    bound of the same oracle row, so they agree within twice the bound."""

    def relation(case: Case, config: Any, backend: Backend, out: np.ndarray):
        n = case.arrays[rows_of[0]].shape[0]
        perm = np.random.default_rng(n).permutation(n)
        permuted = Case({k: (v[perm] if k in rows_of else v) for k, v in case.arrays.items()}, case.params)
        lhs = np.asarray(run(permuted, config, backend))
        rhs = np.asarray(out)[perm].astype(np.float64)
        return lhs, rhs, 2.0 * bound(case, config, backend)[perm]

    return Relation("row_permutation", relation)
