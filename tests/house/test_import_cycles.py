"""No two modules of ntp_nemo import each other, directly or around a longer circle.

An edge A -> B is any import in A that names B: `import B`, `from B import x` (B's namespace is read, so
a submodule importing a name from its own package's `__init__` counts), and `from P import B` where B is
a submodule; imports inside functions count too (a deferred import hides a circle, it does not remove
it); imports under `if TYPE_CHECKING:` do not (they never run), nor those under
`if __name__ == "__main__":` (they run only in a module run as a script, which is then `__main__`, not the
module the others import).  The groups of modules that reach each other (strongly connected components)
must be empty, apart from KNOWN.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "ntp_nemo"

# Circles not yet broken, each with its reason; a circle that disappears must leave this list.
KNOWN: dict[frozenset[str], str] = {}


def _modules(pkg: Path) -> dict[str, Path]:
    out = {}
    for f in pkg.rglob("*.py"):
        parts = list(f.relative_to(pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(stmts: list[ast.stmt]):
    for s in stmts:
        if isinstance(s, ast.If) and ("TYPE_CHECKING" in ast.unparse(s.test)
                                      or ast.unparse(s.test) == "__name__ == '__main__'"):
            continue
        if isinstance(s, (ast.Import, ast.ImportFrom)):
            yield s
            continue
        for child in ast.iter_child_nodes(s):
            if isinstance(child, ast.stmt):
                yield from _imports([child])
            elif isinstance(child, ast.ExceptHandler):
                yield from _imports(child.body)


def import_graph(pkg: Path = PKG) -> dict[str, dict[str, int]]:
    """module -> {module of the same package it imports: line of the first such import}."""
    mods = _modules(pkg)

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    source = ".".join([*base, node.module] if node.module else base)
                else:
                    source = node.module or ""
                named = [source] + [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in mods]
            for name in named:
                target = owner(name)
                if target is not None and target != mod:
                    graph[mod].setdefault(target, node.lineno)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    group.add(m)
                    if m == node:
                        break
                if len(group) > 1:
                    out.append(frozenset(group))
    return out


def _describe(group: frozenset[str], graph: dict[str, dict[str, int]]) -> str:
    edges = [f"{a} (line {graph[a][b]}) -> {b}"
             for a in sorted(group) for b in sorted(group) if b in graph[a]]
    return "; ".join(edges)


def test_no_module_imports_itself_around_a_circle():
    graph = import_graph()
    found = cycles(graph)
    new = [g for g in found if g not in KNOWN]
    assert not new, ("modules that import each other (break the circle: move the shared piece below "
                     "both):\n" + "\n".join(_describe(g, graph) for g in new))
    gone = [sorted(g) for g in KNOWN if g not in found]
    assert not gone, f"circles listed in KNOWN no longer exist; remove them from the list: {gone}"


def test_the_finder_sees_a_circle_through_a_package_and_a_deferred_import(tmp_path):
    """The checker itself, on a package written here: a package re-exporting a submodule that reads the
    package's namespace, and a circle closed by an import inside a function, are both found; imports
    under TYPE_CHECKING and a one-way chain are not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg.a import A\n",
        "a.py": "from pkg import b as _b\nA = 1\n",  # reads pkg's namespace: pkg <-> pkg.a
        "b.py": "def f():\n    from pkg.sub.c import C\n    return C\n",
        "sub/__init__.py": "",
        "sub/c.py": "def g():\n    try:\n        from ..d import D\n    except ImportError:\n        pass\n",
        "d.py": "def h():\n    from pkg.b import f\n",  # b -> sub.c -> d -> b, all deferred
        "e.py": "import pkg.d\n",  # one way
        "f.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg.e"] == {"pkg.d": 1} and graph["pkg.f"] == {}
    assert graph["pkg.sub.c"] == {"pkg.d": 3}  # relative, deferred, inside try
    assert sorted(sorted(g) for g in cycles(graph)) == [["pkg", "pkg.a"], ["pkg.b", "pkg.d", "pkg.sub.c"]]
