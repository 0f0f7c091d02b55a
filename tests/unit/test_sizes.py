"""The size limits of docs/development.md: small modules and functions, in the product and in the lab."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (package, longest module in lines, longest function in lines)
LIMITS = [(ROOT / "dispenser", 600, 80), (ROOT / "lab" / "dispenser_lab", 700, 120)]


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


@pytest.mark.parametrize(("package", "module_limit", "function_limit"), LIMITS, ids=["product", "lab"])
def test_no_module_or_function_over_its_limit(package: Path, module_limit: int, function_limit: int) -> None:
    modules = sorted(package.rglob("*.py"))
    assert modules, package
    over: list[str] = []
    for module in modules:
        text = module.read_text()
        where = module.relative_to(ROOT)
        if (lines := len(text.splitlines())) > module_limit:
            over.append(f"{where}: {lines} lines")
        for function in _functions(ast.parse(text)):
            assert function.end_lineno is not None
            if (length := function.end_lineno - function.lineno + 1) > function_limit:
                over.append(f"{where}:{function.lineno} {function.name}: {length} lines")
    assert over == []
