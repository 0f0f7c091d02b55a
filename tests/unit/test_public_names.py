"""Every module of the product says what it exports: an ``__all__`` naming only what the module binds."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dispenser"


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The module's statements, with those inside top-level ``if``/``try`` blocks (``TYPE_CHECKING`` imports)."""
    statements: list[ast.stmt] = []
    for node in body:
        statements.append(node)
        if isinstance(node, ast.If):
            statements += _top_level(node.body) + _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            statements += _top_level(node.body) + _top_level(node.orelse) + _top_level(node.finalbody)
            for handler in node.handlers:
                statements += _top_level(handler.body)
    return statements


def _bound(statement: ast.stmt) -> set[str]:
    """The names a top-level statement binds."""
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {statement.name}
    if isinstance(statement, ast.Import | ast.ImportFrom):
        return {(alias.asname or alias.name).split(".")[0] for alias in statement.names}
    targets: list[ast.expr] = []
    if isinstance(statement, ast.Assign):
        targets = statement.targets
    elif isinstance(statement, ast.AnnAssign | ast.AugAssign):
        targets = [statement.target]
    return {node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name)}


def _exports(tree: ast.Module) -> list[str] | None:
    """The strings of the module's ``__all__`` (None if it has none)."""
    for statement in tree.body:
        targets = statement.targets if isinstance(statement, ast.Assign) else []
        if isinstance(statement, ast.AnnAssign):
            targets = [statement.target]
        value = getattr(statement, "value", None)
        if value is not None and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in targets
        ):
            assert isinstance(value, ast.List | ast.Tuple), "__all__ is a literal list"
            return [ast.literal_eval(element) for element in value.elts]
    return None


def _modules() -> list[Path]:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 100, "the walk finds the product's modules"
    return modules


def test_every_module_of_the_product_has_an_all() -> None:
    """``__all__`` in every module (a script's may be empty): what is public is said, not guessed."""
    missing = [
        str(module.relative_to(ROOT))
        for module in _modules()
        if _exports(ast.parse(module.read_text())) is None
    ]
    assert missing == []


def test_every_exported_name_is_bound_in_its_module() -> None:
    """A name in ``__all__`` is defined, imported or (in a package) a submodule: no stale export."""
    stale: list[str] = []
    for module in _modules():
        tree = ast.parse(module.read_text())
        bound = {name for statement in _top_level(tree.body) for name in _bound(statement)}
        if module.name == "__init__.py":
            bound |= {child.stem for child in module.parent.glob("*.py")}
            bound |= {child.name for child in module.parent.iterdir() if (child / "__init__.py").is_file()}
        stale += [f"{module.relative_to(ROOT)}: {name}" for name in _exports(tree) or [] if name not in bound]
    assert stale == []
