"""The library's shape limits (issue 35): no module over 400 lines, at most 5 functions over 50
lines, no class with more than 25 methods in its body."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "ainfer_pd"


def _shape():
    modules, functions, classes = [], [], []
    for p in sorted(PKG.rglob("*.py")):
        src = p.read_text()
        rel = p.relative_to(PKG.parent)
        if len(src.splitlines()) > 400:
            modules.append((str(rel), len(src.splitlines())))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 50:
                    functions.append((f"{rel}:{node.name}", n))
            elif isinstance(node, ast.ClassDef):
                m = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
                if m > 25:
                    classes.append((f"{rel}:{node.name}", m))
    return modules, functions, classes


def test_no_module_over_400_lines_few_long_functions_no_class_over_25_methods():
    modules, functions, classes = _shape()
    assert not modules, modules
    assert len(functions) <= 5, functions
    assert not classes, classes
