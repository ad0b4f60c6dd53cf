"""Where ``MODULE:NAME`` spec modules are imported from (``--path``, and the current
directory). Apart from ``targets``, which imports the registry and with it every
kernel: a worker process sets its import path before anything imports a kernel (a
mutation worker must install its mutant first)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def add_paths(paths: Sequence[str]) -> None:
    """Put ``paths`` first on ``sys.path`` (once each), where ``module:NAME`` targets live,
    and the current directory last, so that a spec module beside the user imports
    without --path (after the installed packages: a file there shadows none of them)."""
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
