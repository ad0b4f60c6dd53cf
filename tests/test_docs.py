"""The documentation builds with no warning, its front page reads as written in a real
browser (Chromium, headless), its links resolve, and its Python examples are valid: every block parses, every pallascheck import in it resolves, and
the blocks marked <!-- run --> run as written."""

from __future__ import annotations

import ast
import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHROMIUM = "/usr/bin/chromium"
BLOCK = re.compile(r"(<!-- run -->\n)?```python\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, bool, str]]:
    return [
        (f"{page.relative_to(ROOT)}#{i}", bool(marked), code)
        for page in PAGES
        for i, (marked, code) in enumerate(BLOCK.findall(page.read_text()))
    ]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The docs built with mkdocs, strictly: any warning fails the build."""
    out = tmp_path_factory.mktemp("docs") / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_docs_build_strictly(site) -> None:
    assert (site / "api" / "index.html").read_text().count("attention_like") > 1  # the docstrings are in
    # the front page's set-up steps are one numbered list with their commands inside
    # (a fence that ended the list rendered each step as "1.")
    front = (site / "index.html").read_text()
    steps = re.search(r"<ol>(.*?)</ol>", front, re.S)
    assert steps and steps.group(1).count("<li>") == 2 and "pallascheck verify" in steps.group(1), front[:3000]
    # the top bar holds a handful of entries (22 wrapped to four rows)
    top = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("validation:")[0])["nav"]
    assert len(top) <= 6, top


# What a reader sees, measured in the page as Chromium lays it out at 1280 px: the numbers
# of the page's numbered lists (the set-up steps, its only one) as the browser counts them
# (each <li>'s place in its list, from the list's start), and the rows the top
# navigation's entries sit on.
MEASURE = """
<script>
window.addEventListener("load", () => {
  const lists = [...document.querySelectorAll("[role=main] ol")];
  const numbers = lists.flatMap(ol => [...ol.children].map((li, i) => (ol.start || 1) + i));
  const entries = [...document.querySelectorAll(".navbar-nav > li")].filter(li => li.getClientRects().length);
  const rows = new Set(entries.map(li => Math.round(li.getBoundingClientRect().top)));
  const seen = document.createElement("pre");
  seen.id = "seen";
  seen.textContent = JSON.stringify({numbers, entries: entries.length, rows: rows.size,
                                     width: window.innerWidth});
  document.body.appendChild(seen);
});
</script>
"""


def _chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,900", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="Debian's chromium is not installed (apt-get install chromium; .ci/run does)"
)
def test_front_page_renders_as_written_in_a_browser(site, tmp_path) -> None:
    front = site / "index.html"
    _chromium(f"--user-data-dir={tmp_path / 'shot'}", f"--screenshot={tmp_path / 'front.png'}", front.as_uri())
    assert (tmp_path / "front.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    measured = site / "measured.html"  # beside index.html: its stylesheets and scripts load the same
    measured.write_text(front.read_text().replace("</body>", MEASURE + "</body>"))
    dom = _chromium(
        f"--user-data-dir={tmp_path / 'dom'}", "--virtual-time-budget=5000", "--dump-dom", measured.as_uri()
    ).stdout
    seen = json.loads(html.unescape(re.search(r'<pre id="seen">(.*?)</pre>', dom, re.S).group(1)))
    assert seen["width"] == 1280, seen
    assert seen["numbers"] == [1, 2], seen  # "1. 2.", not "1. 1." (a list ended by its first step's command)
    assert seen["entries"] >= 5 and seen["rows"] == 1, seen  # the top navigation on one row


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
