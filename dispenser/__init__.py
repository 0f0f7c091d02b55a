"""Leaf dispenser: unique 64-bit IDs over message brokers, from Postgres segments or snowflake generators."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

__all__ = ["__version__"]

_DISTRIBUTION = "leaf-dispenser"


def _version() -> str:
    """The installed distribution's version: ``pyproject.toml``'s, written once, read from the metadata.

    A source tree run without installing it (``PYTHONPATH=.``) has no metadata: the version is then read
    from the ``pyproject.toml`` beside the package, and ``0+unknown`` if there is none.
    """
    try:
        return version(_DISTRIBUTION)
    except PackageNotFoundError:
        pass
    try:
        with (Path(__file__).resolve().parent.parent / "pyproject.toml").open("rb") as file:
            project = tomllib.load(file).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return "0+unknown"
    found = project.get("version") if project.get("name") == _DISTRIBUTION else None
    return found if isinstance(found, str) else "0+unknown"


__version__ = _version()
"""This release's version (``dispenser --version``, ``leaf_build_info``, the AsyncAPI document's)."""
