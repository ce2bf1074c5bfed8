"""No import circle in h2o/, analysis/ or tools/: every ``import`` of one of their modules, at the top of a file,
inside a function or in an ``if __name__ == "__main__":`` block, is an edge of the module graph, and the graph has
no cycle (strongly connected components of one module only). A ``__main__`` block counts: a module whose command
line lives in another module that imports it back is a circle, however late the import runs."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("h2o", "analysis", "tools")


def module_graph(root: Path = ROOT, folders=FOLDERS) -> dict[str, set[str]]:
    """{module: the modules of ``folders`` it imports}. ``from a.b import c`` is an edge to ``a.b.c`` where that is
    a module, else to ``a.b`` (the module or package whose name is imported)."""
    files = {}
    for f in (p for folder in folders for p in (root / folder).rglob("*.py")):
        parts = f.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in files.items():
        package = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        out = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
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
    (pkg / "e.py").write_text("import sys\nif __name__ == '__main__':\n    from h2o.p.f import main\n")
    (pkg / "f.py").write_text("from h2o.p.e import sys\n")  # closes a circle through e's __main__ block
    graph = module_graph(tmp_path, ("h2o",))
    assert graph["h2o.p.b"] == {"h2o.p.c"} and graph["h2o.p.d"] == {"h2o.p.a"} and graph["h2o.p.e"] == {"h2o.p.f"}
    assert circles(graph) == [["h2o.p.a", "h2o.p.b", "h2o.p.c"], ["h2o.p.e", "h2o.p.f"]]


def test_no_import_circle_in_h2o_analysis_or_tools():
    graph = module_graph()
    assert {"h2o.pipeline.launch", "analysis.tables", "analysis.figures", "tools.parity.kvpress_side"} <= set(graph)
    assert len(graph) > 100 and graph["analysis.tables"] >= {"analysis.methods", "analysis.labels"}
    assert circles(graph) == []
