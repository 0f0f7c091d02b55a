"""The in-process permuted-tag benchmark runs every case and prints its table (no timing is asserted)."""

from __future__ import annotations

import pytest

from dispenser_lab.bench.permuted_inproc import main


def test_bench_permuted_prints_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    """Plain against permuted at 1, 10 and 100 IDs a request, then FF3-1's cost per ID in both radixes."""
    assert main(["--calls", "12", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    rows = [
        line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "IDs" not in line
    ]
    assert rows == ["1", "10", "100"]
    assert "radix 10, 18 digits" in out
    assert "radix 2, 59 digits" in out
