"""One version, pyproject.toml's: the package, ``dispenser --version`` and a source tree without metadata agree."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest

import dispenser
from dispenser.cli import main

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT_VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


def test_dispenser_version_is_pyprojects(capsys: pytest.CaptureFixture[str]) -> None:
    """``dispenser --version`` prints the version pyproject.toml declares."""
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.split() == ["dispenser", PYPROJECT_VERSION]


def test_the_version_comes_from_the_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed, the version is the distribution's metadata (no second copy to keep in step)."""
    monkeypatch.setattr(dispenser, "version", lambda name: f"9.9.9+{name}")
    assert dispenser._version() == "9.9.9+leaf-dispenser"


def test_a_source_tree_without_metadata_reads_pyproject(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without installed metadata (``PYTHONPATH=.``) the version is read from pyproject.toml beside the package."""

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(dispenser, "version", not_installed)
    assert dispenser._version() == PYPROJECT_VERSION
