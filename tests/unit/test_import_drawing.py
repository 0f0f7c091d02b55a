"""docs/imports.md, the drawing of the product's imports, is the code's (python -m dispenser_lab.imports)."""

from __future__ import annotations

from dispenser_lab.imports import PAGE, draw


def test_the_drawing_of_the_imports_is_current() -> None:
    page = draw()
    assert "lab" not in page.split("```mermaid")[1], "the lab is drawn"
    assert "-->" in page
    assert PAGE.read_text() == page, "docs/imports.md is stale: run python -m dispenser_lab.imports"
