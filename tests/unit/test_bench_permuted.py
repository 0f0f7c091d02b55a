"""The in-process permuted-tag benchmark runs every case, prints its tables and writes them (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dispenser.service.dispatch import MAX_PERMUTED_IDS
from dispenser_lab.bench.permuted_inproc import main


def test_bench_permuted_prints_every_case(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The cipher before (ff3, both radixes) and now (one by one, batches), then plain against permuted requests."""
    report = tmp_path / "permuted.json"
    assert main(["--calls", "12", "--repeat", "1", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    cells = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    assert cells[0] == "the cipher"
    assert cells[1:5] == [
        "ff3 package, radix 10, one by one (before)",
        "ff3 package, radix 2 (59 digits), one by one",
        "encode, one by one",
        "decode, one by one",
    ]
    assert cells[5:9] == ["ids, 10 at once", "ids, 100 at once", "ids, 1,000 at once", "ids, 10,000 at once"]
    assert cells[9] == "IDs a request"
    assert cells[10:] == ["1", "10", "100", "1,000", f"{MAX_PERMUTED_IDS:,}"]
    assert "load average before:" in out
    assert "load average after:" in out
    written = json.loads(report.read_text())
    assert [row["case"] for row in written["cipher"]] == cells[1:9]
    assert [row["ids_a_request"] for row in written["requests"]] == [1, 10, 100, 1000, MAX_PERMUTED_IDS]
    assert written["loadavg_before"]
    assert written["loadavg_after"]
