"""No import circle in h2o/: every ``import`` of an h2o module, at the top of a file or inside a function, is an
edge of the module graph, and the graph has no cycle (strongly connected components of one module only). The body
of ``if __name__ == "__main__":`` is no edge: it runs only when the file is the program (``python -m``), and the
module it imports then loads this file again as a module of its own name, not the ``__main__`` one."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def is_main_block(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and [type(c) for c in node.test.comparators] == [ast.Constant]
            and node.test.comparators[0].value == "__main__")


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the h2o modules it imports}. ``from a.b import c`` is an edge to ``a.b.c`` where that is a module,
    else to ``a.b`` (the module or package whose name is imported)."""
    files = {}
    for f in (root / "h2o").rglob("*.py"):
        parts = f.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in files.items():
        package = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        out = set()
        tree = ast.parse(f.read_text(encoding="utf-8"))
        tree.body = [n for n in tree.body if not is_main_block(n)]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from ..y import z
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = {m for m in out if m in files and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_checker_finds_a_circle_and_its_members(tmp_path):
    pkg = tmp_path / "h2o" / "p"
    pkg.mkdir(parents=True)
    (tmp_path / "h2o" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from h2o.p.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")  # inside a function, relative: still an edge
    (pkg / "c.py").write_text("import h2o.p.a\n")
    (pkg / "d.py").write_text("from h2o.p import a\n")  # imports into the circle, not part of it
    (pkg / "e.py").write_text("import sys\nif __name__ == '__main__':\n    from h2o.p.d import main\n")
    graph = module_graph(tmp_path)
    assert graph["h2o.p.b"] == {"h2o.p.c"} and graph["h2o.p.d"] == {"h2o.p.a"} and graph["h2o.p.e"] == set()
    assert circles(graph) == [["h2o.p.a", "h2o.p.b", "h2o.p.c"]]


def test_no_import_circle_in_h2o():
    graph = module_graph()
    assert len(graph) > 50 and "h2o.pipeline.launch" in graph
    assert circles(graph) == []
