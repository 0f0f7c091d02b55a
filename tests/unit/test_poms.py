"""The Maven poms the lab ships cite only files and modules that exist (their comments outlived two moves)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POMS = sorted((ROOT / "lab" / "dispenser_lab" / "servers" / "poms").glob("*/pom.xml"))

_COMMENT = re.compile(r"<!--(.*?)-->", re.DOTALL)
_PATH = re.compile(r"(?<![\w./-])((?:\.\./|[\w.-]+/)[\w./-]*\.(?:py|md|xml))\b")
_DOTTED = re.compile(r"\b(dispenser(?:_lab)?(?:\.\w+)+)")


def _comments(pom: Path) -> str:
    return "\n".join(_COMMENT.findall(pom.read_text(encoding="utf-8")))


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute of one (``pkg.module.function``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def test_there_are_poms() -> None:
    """The lab ships the ZooKeeper, Kafka and Java callers' poms (so the checks below check something)."""
    assert [pom.parent.name for pom in POMS] == ["java-callers", "kafka", "zookeeper"]


@pytest.mark.parametrize("pom", POMS, ids=lambda pom: pom.parent.name)
def test_every_file_a_pom_cites_exists(pom: Path) -> None:
    """A path in a pom's comments is the repository's (from its root) or the pom's own directory's."""
    cited = _PATH.findall(_comments(pom))
    missing = [path for path in cited if not ((ROOT / path).exists() or (pom.parent / path).exists())]
    assert not missing


@pytest.mark.parametrize("pom", POMS, ids=lambda pom: pom.parent.name)
def test_every_module_a_pom_cites_imports(pom: Path) -> None:
    """A dotted name in a pom's comments (``dispenser_lab.servers.kafka``) is a module or one of its names."""
    cited = _DOTTED.findall(_comments(pom))
    assert cited, "the pom names the module that fetches its jars"
    assert [name for name in cited if not _resolves(name)] == []
