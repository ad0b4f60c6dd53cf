"""The package's imports point down and form no cycle (docs/layout.md).

The graph is read from the source folders laid out as installed (pyproject.toml's
package-dir), imports inside functions included: a cycle hidden behind a
function-level import is still a cycle.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The layers, top to bottom: the face (API and command) over fuzz and bench (which never
# import each other), over properties, over oracles, over kernels.
LAYERS = {"cli": 4, "specs": 4, "__main__": 4, "fuzz": 3, "bench": 3, "properties": 2, "oracles": 1, "kernels": 0}
# Function-level imports of the package's own modules, each with why it cannot be at the top.
DEFERRED = {
    # `import pallascheck.kernels` runs pallascheck/__init__.py: the autotuner (and with it
    # the properties and oracles) loads on first use of pallascheck.autotune
    ("pallascheck", "pallascheck.bench.autotune"): "the face stays light for `import pallascheck.kernels`",
    **{
        ("pallascheck", f"pallascheck.bench.gate.{m}"): "the face stays light for `import pallascheck.kernels`"
        for m in ("judge", "task", "verdict")
    },
    # the console script is imported again by every worker process multiprocessing
    # spawns: the subcommands (and every kernel with them) load on first use
    ("pallascheck.cli", "pallascheck.cli.command"): "spawned workers re-import the console script",
    # pytest is an optional dependency of building and checking specs
    ("pallascheck.specs", "pallascheck.properties.pytest_plugin"): "pytest is optional",
    # the pytest plugin loads in every pytest session of the environment: JAX and the
    # harness load with the first test that uses pallascheck, or the option that needs them
    ("pallascheck.properties.pytest_plugin", "pallascheck.kernels.backends"): "JAX loads with a backend's first use",
    ("pallascheck.properties.pytest_plugin", "pallascheck.properties.runner"): "the harness loads with a spec test",
    ("pallascheck.properties.pytest_plugin", "pallascheck.properties.watchdog"): "the harness loads with a spec test",
    ("pallascheck.properties.pytest_plugin", "pallascheck.properties.production"): "the harness loads with a spec test",
    (
        "pallascheck.properties.pytest_plugin",
        "pallascheck.properties.device.compilation",
    ): "only a session that opts in (--pallascheck-session) sets up compilation",
    # a mutation worker puts its import hook first, then imports the spec: the kernel
    # module must not be imported before the hook, so nothing that imports it may be
    **{
        ("pallascheck.fuzz.mutation.worker", m): "after the mutant's import hook"
        for m in (
            "pallascheck.kernels.backends",
            "pallascheck.properties.runner",
            "pallascheck.properties.spec",
            "pallascheck.fuzz.targets",
        )
    },
    # a fuzz worker sets CUDA_VISIBLE_DEVICES and the user's --path before importing the
    # harness (and the user's kernels with it)
    **{
        ("pallascheck.fuzz.workers", m): "in the worker, after its device and --path are set"
        for m in (
            "pallascheck.properties.device.compilation",
            "pallascheck.properties.device.identity",
            "pallascheck.fuzz.import_path",
            "pallascheck.fuzz.targets",
            "pallascheck.kernels.backends",
            "pallascheck.properties.runner",
            "pallascheck.properties.strategies",
            "pallascheck.properties.spec",
        )
    },
}


def _modules() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = config["package-dir"]
    modules = {}
    for package in config["packages"]:
        top = max((p for p in folders if package == p or package.startswith(p + ".")), key=len)
        folder = ROOT / folders[top] / package[len(top) + 1 :].replace(".", "/")
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges() -> list[tuple[str, str, bool]]:
    """(importer, imported, at module level) for every import of a pallascheck module."""
    edges = []
    for name, path in MODULES.items():
        package = name if path.stem == "__init__" else name.rpartition(".")[0]

        def visit(node: ast.AST, top: bool, name: str = name, package: str = package) -> None:
            for child in ast.iter_child_nodes(node):
                targets: list[str] = []
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = package
                    for _ in range(child.level - 1):
                        base = base.rpartition(".")[0]
                    module = (base + ("." + child.module if child.module else "")) if child.level else child.module
                    targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in child.names]
                in_type_checking = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
                for target in targets:
                    resolved = _resolve(target) if target and target.startswith("pallascheck") else None
                    if resolved and resolved != name:
                        edges.append((name, resolved, top))
                if not in_type_checking:
                    visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text()), True)
    return edges


EDGES = _edges()


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1]] if len(parts) > 1 else 4


def test_the_graph_covers_every_installed_module() -> None:
    assert {"pallascheck.cli.verify", "pallascheck.properties.registry", "pallascheck.kernels.attention"} <= set(
        MODULES
    )
    assert len(EDGES) > 300, len(EDGES)


def test_every_import_points_down() -> None:
    upward = sorted({(a, b) for a, b, _ in EDGES if _layer(b) > _layer(a)})
    assert not upward, upward
    sideways = sorted(
        {(a, b) for a, b, _ in EDGES if _layer(a) == _layer(b) == 3 and a.split(".")[1] != b.split(".")[1]}
    )
    assert not sideways, f"fuzz and bench never import each other: {sideways}"


def test_the_registry_sits_above_the_families_and_a_spec_is_data() -> None:
    below_registry = [
        a
        for a, b, _ in EDGES
        if b == "pallascheck.properties.registry"
        and a.startswith("pallascheck.properties.")
        and a != "pallascheck.properties.pytest_plugin"
    ]
    assert not below_registry, below_registry
    assert not [b for a, b, _ in EDGES if a == "pallascheck.properties.spec" and ".properties." in b]


def test_no_kernel_module_imports_an_oracle() -> None:
    assert not [(a, b) for a, b, _ in EDGES if ".kernels." in a and ".oracles." in b]


def test_the_installed_package_never_imports_the_checkout() -> None:
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("studies", "tests", "broken"):
                pytest.fail(f"{name} imports {node.module}, which is not installed")


def test_function_level_imports_are_the_listed_deferred_ones() -> None:
    deferred = sorted({(a, b) for a, b, top in EDGES if not top} - set(DEFERRED))
    assert not deferred, f"import these at the top of the module (or add the reason to DEFERRED): {deferred}"
    stale = sorted(set(DEFERRED) - {(a, b) for a, b, top in EDGES if not top})
    assert not stale, stale


def test_there_is_no_cycle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for a, b, _ in EDGES:
        graph[a].add(b)
    # Tarjan's strongly connected components, iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    assert not cycles, cycles
