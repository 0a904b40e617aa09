"""The library's structure as issue 38 measures it, at a commit or in a work tree.

Prints, for batchq/, producer/ and consumer/ (tracked ``.py`` and ``.lua`` files):
modules, lines (Python and Lua), modules under 80 lines (``__init__.py`` not counted),
import circles among the library's modules (every import, ``TYPE_CHECKING`` ones
included), ``TYPE_CHECKING`` imports in consumer/, consumer/'s import floors (a module
importing nothing of consumer/ is floor 1; each module sits one floor above the highest
it imports; a circle is one floor) and radon's C-or-worse blocks per thousand Python
lines (and D-or-worse blocks). radon is a dev tool, not a dependency: without it that
line says so.

    python bench/structure.py                 # the work tree (run from its root)
    python bench/structure.py e7b98c3 HEAD    # commits, side by side
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path

PACKAGES = ("batchq", "producer", "consumer")
SMALL_LINES = 80
C_RANK = 11  # radon's C rank starts at cyclomatic complexity 11, D at 21
D_RANK = 21


def _tree(rev: str | None, into: Path) -> Path:
    """The library's files at ``rev`` under ``into`` (when ``rev`` is None: the work tree
    the command runs in, so a worktree measures itself)."""
    root = Path.cwd()
    if rev is None:
        return root
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", rev, *PACKAGES], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _files(root: Path, suffix: str) -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((root / package).rglob(f"*{suffix}"))


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(root: Path, path: Path, modules: set[str]) -> set[str]:
    """The library modules ``path`` imports (``from a import b`` counts ``a.b`` where that
    is a module, else ``a``)."""
    name = _module_name(root, path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _floors(graph: dict[str, set[str]], prefix: str) -> int:
    """How many floors the modules under ``prefix`` stand on (a circle is one floor)."""
    inside = {
        m: {d for d in deps if d.startswith(prefix)}
        for m, deps in graph.items()
        if m.startswith(prefix)
    }
    home = {m: m for m in inside}
    for circle in _cycles(inside):
        home.update(dict.fromkeys(circle, circle[0]))
    below: dict[str, set[str]] = {}
    for m, deps in inside.items():
        below.setdefault(home[m], set()).update(home[d] for d in deps if home[d] != home[m])
    floor: dict[str, int] = {}

    def height(node: str) -> int:
        if node not in floor:
            floor[node] = 1 + max((height(d) for d in below[node]), default=0)
        return floor[node]

    return max((height(m) for m in below), default=0)


def _radon(root: Path) -> tuple[int, int] | None:
    try:
        from radon.complexity import cc_visit  # type: ignore[import-untyped]
    except ImportError:
        return None
    c_or_worse = d_or_worse = 0
    for path in _files(root, ".py"):
        for block in cc_visit(path.read_text()):
            c_or_worse += block.complexity >= C_RANK
            d_or_worse += block.complexity >= D_RANK
    return c_or_worse, d_or_worse


def measure(root: Path) -> dict[str, str]:
    """The figures of the library under ``root``, as printable text."""
    py = list(_files(root, ".py"))
    py_lines = {p: len(p.read_text().splitlines()) for p in py}
    lua_lines = sum(len(p.read_text().splitlines()) for p in _files(root, ".lua"))
    modules = {_module_name(root, p) for p in py}
    graph = {_module_name(root, p): _imports(root, p, modules) for p in py}
    circles = _cycles(graph)
    type_checking = sum(
        "if TYPE_CHECKING" in p.read_text()
        for p in py
        if p.relative_to(root).parts[0] == "consumer"
    )
    kloc = sum(py_lines.values()) / 1000
    radon = _radon(root)
    return {
        "modules (.py)": str(len(py)),
        "library lines (py + lua)": f"{sum(py_lines.values()) + lua_lines:,}",
        "python lines": f"{sum(py_lines.values()):,}",
        "lua lines": f"{lua_lines:,}",
        f"modules under {SMALL_LINES} lines": str(
            sum(n < SMALL_LINES for p, n in py_lines.items() if p.name != "__init__.py")
        ),
        "import circles": str(len(circles)),
        "circles": "; ".join(" <-> ".join(c) for c in circles) or "none",
        "consumer TYPE_CHECKING modules": str(type_checking),
        "consumer import floors": str(_floors(graph, "consumer")),
        "radon C+ per kloc": "radon not installed"
        if radon is None
        else f"{radon[0] / kloc:.2f} ({radon[0]} blocks)",
        "radon D+ blocks": "radon not installed" if radon is None else str(radon[1]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="*", help="git revisions (default: the work tree)")
    revs: list[str | None] = list(parser.parse_args().revs) or [None]
    columns = []
    with tempfile.TemporaryDirectory() as scratch:
        for i, rev in enumerate(revs):
            columns.append(measure(_tree(rev, Path(scratch) / str(i))))
    names = [rev or "work tree" for rev in revs]
    width = max(len(k) for k in columns[0])
    print(f"{'':{width}}  " + "  ".join(f"{n:>14}" for n in names))
    for key in columns[0]:
        if key != "circles":
            print(f"{key:{width}}  " + "  ".join(f"{c[key]:>14}" for c in columns))
    for name, column in zip(names, columns, strict=True):
        print(f"circles at {name}: {column['circles']}")


if __name__ == "__main__":
    main()
