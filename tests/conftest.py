"""The suite's options and fixtures (--pallascheck-backend, Hypothesis profiles,
``backend``, ``examples``) come from pallascheck's pytest plugin
(properties/pytest_plugin.py); the suite also takes their short names (--backend,
--examples, --shapes, --case-timeout: ``pytest_plugins`` below).

The order of the items is this suite's schedule for pytest-xdist's ``worksteal``
(pyproject.toml): each worker starts on a contiguous half of the items, and a worker
that runs out steals the last ones queued on the other. The tests whose kernels run
in the interpreters that call back into Python are the longest ones (up to a minute
each on 2 cores, cold: docs/results.md); each half starts with half of them, so that
no worker is left running one of them alone at the end while the other idles. The
modules whose tests share a costly module fixture run first, each whole on the first
worker: alternated between the halves, each worker would make the fixture for itself
(two three-node Ray clusters at once for tests/test_cluster.py), and at the end of a
queue a steal could split them again."""

from __future__ import annotations

import pytest

# --backend, --examples, --shapes, --case-timeout for this suite (the plugin alone
# registers only their --pallascheck- names, which never collide with a project's own)
pytest_plugins = ["pallascheck.properties.pytest_short_options"]

# Test ids naming a kernel that runs in the TPU or Mosaic GPU interpreter: the
# interpreters themselves, JAX's TPU and Mosaic GPU ("_mgpu") kernels, Tokamax's Mosaic
# ones, and the Mosaic GPU broken variants.
CALLBACK_INTERPRETER_IDS = ("tpu_interpret", "mosaic_gpu_interpret", "jax:tpu.", "_mgpu", ":mosaic_")


# The quick tier (``pytest -m quick``, under 90 s on two cores): every module touched
# once (the import graph, the command and its errors, the plugin, verify's verdict and
# output, code paths, the production tier's rules, the tolerance model, the attention
# oracle's chunks, one small case per family and backend), for the inner loop of a change.
QUICK_MODULES = (
    "test_import_graph.py",
    "test_smoke.py",
    "test_verdict.py",
    "test_code_paths.py",
    "test_production_tier.py",
    "test_user_errors.py",
    "test_backends.py",
    "test_tolerance.py",
    "test_attention_chunks.py",
    "test_pytest_plugin.py",
)


# Modules whose tests share a costly module-scoped fixture: a three-node Ray cluster and
# a Redis server (test_cluster), the autotuning result ``tuned`` (test_autotune), the
# docs site built by mkdocs (test_docs), and the user project whose on-disk compile
# cache its commands share (test_user_specs_cli).
SHARED_FIXTURE_MODULES = ("test_cluster.py", "test_autotune.py", "test_docs.py", "test_user_specs_cli.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)
    shared = [item for item in items if item.path.name in SHARED_FIXTURE_MODULES]
    others = [item for item in items if item.path.name not in SHARED_FIXTURE_MODULES]
    long = [item for item in others if any(mark in item.nodeid for mark in CALLBACK_INTERPRETER_IDS)]
    rest = [item for item in others if not any(mark in item.nodeid for mark in CALLBACK_INTERPRETER_IDS)]
    items[:] = shared + long[0::2] + rest[0::2] + long[1::2] + rest[1::2]
