"""docs/testing.md's example runs as written: a real worker on real NATS and PostgreSQL hands out IDs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"


def test_the_documented_example_runs() -> None:
    """The Python block in docs/testing.md runs and gets the tag's first three IDs."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1
    namespace: dict[str, object] = {"__name__": "docs_testing_example"}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)  # the example asserts its own result
    assert namespace["ids"] == [1, 2, 3]
