"""The short soak profile, end to end: real servers, three workers, every fault, no duplicate ID.

It runs ``python -m soak`` (what ``scripts/soak`` runs) in a subprocess, as CI would, and reads
its JSON report. About 80-90 s; it installs Debian's faketime package first if it is missing (as root with
apt-get), and fails with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.nats, pytest.mark.postgres, pytest.mark.zookeeper, pytest.mark.slow]

SOAK_TIMEOUT_S = 420
TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.timeout(SOAK_TIMEOUT_S + 30)
def test_short_soak_passes(tmp_path: Path) -> None:
    """10 M+ IDs through kill -9, PostgreSQL, ZooKeeper and NATS outages and clock steps: no duplicate."""
    report_path = tmp_path / "soak.json"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "soak", "--profile", "short", "--seed", "7"),
            *("--json", str(report_path), "--workdir", str(tmp_path / "work"), "--quiet"),
        ],
        capture_output=True,
        text=True,
        timeout=SOAK_TIMEOUT_S,
        check=False,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(TOOLS), os.environ.get("PYTHONPATH")])),
        },
    )
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-5000:]}"
    assert done.returncode == 0, output
    report = json.loads(report_path.read_text())
    assert report["passed"] is True, output
    assert report["failures"] == []
    totals = report["totals"]
    assert totals["ids_total"] >= 10_000_000
    assert totals["ids"]["segment"] > 0
    assert totals["ids"]["snowflake"] > 0
    assert totals["malformed"] == 0
    assert totals["bad_errors"] == 0
    assert set(report["duplicates"]) == {"segment:soak-a", "segment:soak-b", "snowflake"}
    for name, found in report["duplicates"].items():
        assert found["ids"] == 0, name
        assert found["received"] > 0, name
    faults = {phase["fault"] for phase in report["phases"]}
    assert faults >= {
        "kill -9 segment-1",
        "stop postgres",
        "start postgres",
        "stop zookeeper",
        "start zookeeper",
        "restart nats",
        "clock +1 s",
        "clock -10 ms",
    }
    for phase in report["phases"]:
        assert phase["p50_ms"] is not None, phase["name"]
        if phase["fault"] in ("clock +1 s", "clock -10 ms"):
            assert phase["notes"]["clock_offset_ms"] in (1000, 990)
    assert all(worker["alive_at_end"] for worker in report["workers"].values())
    assert report["workers_answering_at_end"] == 3
    assert "PASS" in done.stdout
