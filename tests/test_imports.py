"""The package's import graph, read from the source (ast over eagle3pipe/*.py, function-level imports included, so a
lazy import that only hides a circle counts as one): it has no circle, and no module reaches for another module's
underscore-private name (``from .train import _x`` or ``draft._x`` after ``from . import draft``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "eagle3pipe"


def package_modules(package: Path = PACKAGE) -> dict[str, ast.Module]:
    """Every module of the package by its name (``train`` for eagle3pipe/train.py), parsed."""
    return {p.stem: ast.parse(p.read_text(), filename=str(p)) for p in sorted(package.glob("*.py"))}


def _target(node: ast.ImportFrom, modules: dict) -> str | None:
    """The package module an ``from X import ...`` reads from (``from . import a`` reads the package itself: None)."""
    if node.level == 1:
        dotted = node.module or ""
    elif node.level == 0 and node.module and node.module.split(".")[0] == PACKAGE.name:
        dotted = node.module[len(PACKAGE.name) + 1:]
    else:
        return None  # another package, or a relative import reaching above eagle3pipe/
    name = dotted.split(".")[0]
    return name if name in modules else None


def import_edges(modules: dict[str, ast.Module]) -> tuple[dict[str, set[str]], list[str]]:
    """({module: the package modules it imports}, ["module: what private name it takes from where", ...])."""
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private: list[str] = []
    for name, tree in modules.items():
        bound: dict[str, str] = {}  # local name: the package module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    parts = a.name.split(".")
                    if parts[0] == PACKAGE.name and len(parts) > 1 and parts[1] in modules:
                        edges[name].add(parts[1])
                        if a.asname:
                            bound[a.asname] = parts[1]
            elif isinstance(node, ast.ImportFrom):
                target = _target(node, modules)
                if target is not None:  # from .train import x
                    edges[name].add(target)
                    private += [f"{name}: {a.name} from {target}" for a in node.names
                                if a.name.startswith("_") and not a.name.startswith("__")]
                elif (node.level == 1 and not node.module) or (node.level == 0 and node.module == PACKAGE.name):
                    for a in node.names:  # from . import draft
                        if a.name in modules:
                            edges[name].add(a.name)
                            bound[a.asname or a.name] = a.name
                        elif a.name.startswith("_"):
                            private.append(f"{name}: {a.name} from the package")
        for node in ast.walk(tree):  # draft._x after ``from . import draft``
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                private.append(f"{name}: {node.attr} of {bound[node.value.id]}")
        edges[name].discard(name)
    return edges, sorted(set(private))


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted: every circle lies
    inside one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_package_import_graph_has_no_circle():
    edges, _ = import_edges(package_modules())
    assert sum(len(t) for t in edges.values()) > 20, "the graph reader found too few imports to be reading them"
    assert import_cycles(edges) == []


def test_no_module_imports_another_modules_private_name():
    _, private = import_edges(package_modules())
    assert private == []


def test_the_graph_reader_sees_lazy_imports_circles_and_private_names(tmp_path, monkeypatch):
    """An independent reference: a tiny package whose only circle runs through a function-level import, and whose
    private names are taken both ways the checks look for."""
    pkg = tmp_path / PACKAGE.name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import run\n")
    (pkg / "b.py").write_text("def run():\n    from .c import _helper\n    return _helper()\n")
    (pkg / "c.py").write_text("from . import a\nfrom eagle3pipe import d\n\ndef _helper():\n    return d._x\n")
    (pkg / "d.py").write_text("import os\nimport eagle3pipe.a as aa\n_x = 1\n")
    edges, private = import_edges(package_modules(pkg))
    assert edges == {"__init__": set(), "a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"a"}}
    assert import_cycles(edges) == [["a", "b", "c", "d"]]
    assert private == ["b: _helper from c", "c: _x of d"]
