"""The JSON Schemas in schemas/ are generated from the msgspec Structs and must not drift."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dispenser.cli import main
from dispenser.messages import json_schemas

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


@pytest.mark.parametrize("name", sorted(json_schemas()))
def test_schema_file_matches_the_code(name: str) -> None:
    """Each schema file equals what the code generates (run `dispenser schemas` after changing messages)."""
    assert json.loads((SCHEMAS / name).read_text()) == json_schemas()[name]


def test_schemas_check_reports_drift(tmp_path: Path) -> None:
    """`dispenser schemas --check` fails on a stale file and passes once regenerated."""
    target = ["--dir", str(tmp_path), "--asyncapi", str(tmp_path / "asyncapi.yaml")]
    assert main(["schemas", *target]) == 0
    stale = tmp_path / "reply.schema.json"
    stale.write_text("{}\n")
    assert main(["schemas", *target, "--check"]) == 1
    assert main(["schemas", *target]) == 0
    assert main(["schemas", *target, "--check"]) == 0


def test_the_repository_is_up_to_date() -> None:
    """`dispenser schemas --check` passes on the repository itself (schemas/ and docs/asyncapi.yaml)."""
    root = SCHEMAS.parent
    assert (
        main(
            ["schemas", "--dir", str(SCHEMAS), "--asyncapi", str(root / "docs" / "asyncapi.yaml"), "--check"]
        )
        == 0
    )


def test_the_checkout_is_found_from_a_subdirectory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without paths, `dispenser schemas` works on the checkout it runs in, from any of its directories."""
    monkeypatch.chdir(SCHEMAS.parent / "docs")
    assert main(["schemas", "--check"]) == 0


def test_schemas_refuses_to_write_outside_a_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Outside a checkout (an installed wheel's user), nothing is written unless both paths are given."""
    monkeypatch.chdir(tmp_path)
    assert main(["schemas"]) == 2
    assert "this is none" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert main(["schemas", "--dir", "s"]) == 2
    assert list(tmp_path.iterdir()) == []
