"""Module structure of ``laplace_core/`` and ``pipelines/``, read with ``ast`` (nothing is
imported; ``laplace_core`` never imports ``pipelines``, so no cycle can run between them):

* no module imports another module's ``_private`` names (``from .x import _y``,
  ``from pipelines.x import _y``, ``x._y`` through ``import``-ed module objects is not
  checked), and
* there are no import cycles among its modules, counting every import statement, also
  those inside functions (a lazy import hides a cycle, it does not remove it),
* the packages of ``pipelines/`` import one way: no package-level circle, and each imports
  only from the layers below it in :data:`pipelines.LAYERS` (the README's architecture block
  and docs/design.md show that order),
* no file is longer than :data:`MAX_LINES`, and
* no string or comment refers to anything outside the repository (the founding design
  notes now live in ``docs/design.md``).
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("laplace_core", "pipelines")
MAX_LINES = 500
#: what a reference outside the repository looks like: a path up out of it, the founding
#: design file by its old name, or an absolute path of the machine the code was written on
OUTSIDE = re.compile(r"\.\./shared|shared/DESIGN|DESIGN §|DESIGN\.md|ENVIRONMENT\.md|/work/")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules(package: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _resolve(current: str, is_pkg: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = current.split(".") if is_pkg else current.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(name: str, path: Path, known: set[str]):
    """``(target module, imported names)`` of every import in the file whose target is in ``known``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    yield a.name, ()
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, is_pkg, node.level, node.module)
            names = tuple(a.name for a in node.names)
            # "from . import storage": the names may be submodules
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
            if subs:
                for s in subs:
                    yield s, ()
                names = tuple(n for n in names if f"{target}.{n}" not in known)
            if target in known and (names or not subs):
                yield target, names


def _graph(package: str):
    mods = _modules(package)
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private: list[str] = []
    for name, path in mods.items():
        for target, names in _imports(name, path, known):
            if target == name:
                continue
            edges[name].add(target)
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    private.append(f"{name} imports {target}.{n}")
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_private_cross_module_imports(package):
    _, private = _graph(package)
    assert private == [], "\n".join(private)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package):
    edges, _ = _graph(package)
    assert _cycles(edges) == []


def test_the_checker_sees_a_cycle_and_a_private_import(tmp_path, monkeypatch):
    """The checker itself: a two-module cycle and a private import are found."""
    pkg = tmp_path / "demo_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import _hidden\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    edges, private = _graph("demo_pkg")
    assert private == ["demo_pkg.a imports demo_pkg.b._hidden"]
    assert _cycles(edges) == [["demo_pkg.a", "demo_pkg.b"]]


def _package_edges(package: str) -> dict[str, set[str]]:
    """The module graph collapsed to the package's direct children (subpackages and
    top-level modules): ``a -> b`` when any module under ``a`` imports one under ``b``."""
    edges, _ = _graph(package)

    def child(mod: str) -> str:
        parts = mod.split(".")
        return parts[1] if len(parts) > 1 else ""

    out: dict[str, set[str]] = {}
    for src, targets in edges.items():
        if child(src):
            out.setdefault(child(src), set()).update(t for t in map(child, targets) if t and t != child(src))
    return out


def _layer_violations(edges: dict[str, set[str]], layers) -> list[str]:
    rank = {name: i for i, layer in enumerate(layers) for name in layer}
    bad = [f"{src}: not in any layer" for src in sorted(edges) if src not in rank]
    for src in sorted(edges):
        for dst in sorted(edges[src]):
            if src in rank and rank.get(dst, -1) >= rank[src]:
                bad.append(f"{src} imports {dst} (layer {rank.get(dst)} >= {rank[src]})")
    return bad


def test_the_pipelines_packages_import_one_way():
    """No circle among ``pipelines/``'s packages, and every import goes down the layers."""
    from pipelines import LAYERS

    edges = _package_edges("pipelines")
    assert _cycles(edges) == []
    assert _layer_violations(edges, LAYERS) == []


def test_the_package_checker_sees_a_planted_circle(tmp_path, monkeypatch):
    """Two packages that import each other (one lazily, inside a function) form a circle
    and break the layering, though no two modules form a cycle."""
    root = tmp_path / "demo_pkg"
    for sub in ("low", "high"):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "low" / "a.py").write_text("def f():\n    from demo_pkg.high import b\n")
    (root / "high" / "b.py").write_text("from demo_pkg.low import c\n")
    (root / "low" / "c.py").write_text("x = 1\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _cycles(_graph("demo_pkg")[0]) == []
    edges = _package_edges("demo_pkg")
    assert _cycles(edges) == [["high", "low"]]
    assert _layer_violations(edges, (("low",), ("high",))) == ["low imports high (layer 1 >= 0)"]


def _texts(path: Path):
    """Every string constant (docstrings included, read with ``ast``) and every comment."""
    src = path.read_text()
    for node in ast.walk(ast.parse(src, filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def _outside_references(package: str) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{line}: {OUTSIDE.search(text).group(0)}"
            for p in _modules(package).values() for line, text in _texts(p) if OUTSIDE.search(text)]


@pytest.mark.parametrize("package", PACKAGES)
def test_files_are_short(package):
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _modules(package).values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert long == [], "\n".join(long)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_reference_outside_the_repository(package):
    found = _outside_references(package)
    assert found == [], "\n".join(found)


def test_the_checker_sees_an_outside_reference(tmp_path, monkeypatch):
    pkg = tmp_path / "demo_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""See DESIGN §1."""\nx = 1  # ../shared/papers\n')
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert _outside_references("demo_pkg") == ["demo_pkg/__init__.py:1: DESIGN §", "demo_pkg/__init__.py:2: ../shared"]
