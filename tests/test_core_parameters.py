"""No function of h2o/core takes more than 8 parameters (``self`` aside, ``*args``/``**kwargs`` one each): a
constructor and a Triton kernel (``@triton.jit``) aside. transformers' attention-function signature
(h2o.core.attention.h2o_attention) fits: its per-layer settings come in ``**kwargs``."""
import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "h2o" / "core"


def width(node: ast.FunctionDef) -> int:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return len(names) - (names[:1] in (["self"], ["cls"])) + (a.vararg is not None) + (a.kwarg is not None)


def test_no_core_function_takes_more_than_eight_parameters():
    wide = []
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name == "__init__":
                continue
            if any("jit" in ast.unparse(d) for d in node.decorator_list):
                continue
            if width(node) > 8:
                wide.append(f"{path.relative_to(CORE)}:{node.lineno} {node.name} ({width(node)})")
    assert not wide, wide


def test_the_count_reads_self_and_star_arguments():
    f = ast.parse("def f(self, a, b, *c, d=1, **e): pass").body[0]
    assert width(f) == 5
