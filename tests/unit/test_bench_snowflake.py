"""The in-process snowflake benchmark runs every case and writes its JSON (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from dispenser.cli import main


def test_bench_snowflake_writes_every_case(tmp_path: Path) -> None:
    """`dispenser bench snowflake` measures core and shell at three batch sizes, each issuing IDs."""
    out = tmp_path / "sf.json"
    assert main(["bench", "snowflake", "--duration", "0.1", "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [c["case"] for c in cases] == [
        f"{kind} take({n})" for kind in ("core", "shell") for n in (1, 100, 4096)
    ]
    for case in cases:
        assert case["ids_per_s"] > 0
        assert case["ceiling_ids_per_s"] == 4_096_000
        # No worker beats 4,096 IDs per millisecond; a run of n ms may touch n + 1 milliseconds, hence 5%.
        assert case["share_of_ceiling"] <= 1.05
