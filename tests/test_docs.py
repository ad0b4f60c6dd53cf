"""The documentation builds with no warning, its links resolve, and its Python
examples are valid: every block parses, every pallascheck import in it resolves, and
the blocks marked <!-- run --> run as written."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- run -->\n)?```python\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, bool, str]]:
    return [
        (f"{page.relative_to(ROOT)}#{i}", bool(marked), code)
        for page in PAGES
        for i, (marked, code) in enumerate(BLOCK.findall(page.read_text()))
    ]


def test_docs_build_strictly(tmp_path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "api" / "index.html").read_text().count("attention_like") > 1  # the docstrings are in
    # the front page's set-up steps are one numbered list with their commands inside
    # (a fence that ended the list rendered each step as "1.")
    front = (tmp_path / "site" / "index.html").read_text()
    steps = re.search(r"<ol>(.*?)</ol>", front, re.S)
    assert steps and steps.group(1).count("<li>") == 2 and "pallascheck verify" in steps.group(1), front[:3000]
    # the top bar holds a handful of entries (22 wrapped to four rows)
    top = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("validation:")[0])["nav"]
    assert len(top) <= 6, top


def test_readme_links_resolve() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text()):
        if "://" not in target:
            assert (ROOT / target).exists(), target


@pytest.mark.parametrize("name,run,code", _blocks(), ids=[b[0] for b in _blocks()])
def test_python_example(name, run, code) -> None:
    tree = ast.parse(code, filename=name)
    imports = [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and "pallascheck" in ast.unparse(node)
    ]
    namespace: dict = {}
    exec(compile(ast.Module(imports, []), name, "exec"), namespace)  # the names it imports exist
    if run:
        exec(compile(tree, name, "exec"), namespace)


def test_some_example_is_run() -> None:
    assert any(run for _, run, _ in _blocks()), "no example is marked <!-- run -->"
