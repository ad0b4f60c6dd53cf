"""The short names of pallascheck's pytest options, for a project that asks for them:
``--backend``, ``--examples``, ``--shapes`` and ``--case-timeout``, each the same option
as its ``--pallascheck-`` name (one dest). Not registered by the plugin itself: a
project whose conftest adds its own ``--backend`` would no longer start. Enable it in
the conftest.py at the top of the tests (pallascheck's own suite does)::

    pytest_plugins = ["pallascheck.properties.pytest_short_options"]

or for one run: ``pytest -p pallascheck.properties.pytest_short_options --backend triton``.
Commands that pallascheck prints use the ``--pallascheck-`` names, which every project
has.
"""

from __future__ import annotations

import pytest

from pallascheck.properties.pytest_plugin import OPTIONS, PREFIX, dest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pallascheck")
    for name, attrs in OPTIONS.items():
        group.addoption(f"--{name}", dest=dest(name), **{**attrs, "help": f"the same as --{PREFIX}{name}"})
