"""The short soak profile, end to end: real servers, three workers, every fault, no duplicate ID.

It runs ``python -m soak`` (what ``scripts/soak`` runs) in a subprocess, as CI would, and reads
its JSON report. About 80-90 s; it installs Debian's faketime package first if it is missing (as root with
apt-get), and fails with the reason otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# Not in the suite (scripts/test): .ci/run runs them right after it, one at a time
# (scripts/test -n 0 -m 'soak and not manual').
pytestmark = [
    pytest.mark.nats,
    pytest.mark.postgres,
    pytest.mark.zookeeper,
    pytest.mark.slow,
    pytest.mark.soak,
]

SOAK_TIMEOUT_S = 420


def _soak(tmp_path: Path, profile: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], str]:
    """Run ``scripts/soak --profile <profile>`` as CI would; its result, JSON report and output."""
    report_path = tmp_path / "soak.json"
    tmp_path.chmod(0o755)  # PostgreSQL (and Patroni) run as their own user below it when we are root
    done = subprocess.run(
        [
            *(sys.executable, "-m", "dispenser_lab.soak", "--profile", profile, "--seed", "7"),
            *("--json", str(report_path), "--workdir", str(tmp_path / "work"), "--quiet"),
        ],
        capture_output=True,
        text=True,
        timeout=SOAK_TIMEOUT_S,
        check=False,
    )
    output = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-5000:]}"
    assert done.returncode == 0, output
    return done, json.loads(report_path.read_text()), output


def _assert_clean(report: dict[str, Any]) -> None:
    """Passed, enough IDs of both kinds, nothing malformed or non-retryable, 0 duplicates, all workers up."""
    assert report["passed"] is True, report["failures"]
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
    assert all(worker["alive_at_end"] for worker in report["workers"].values())
    assert report["workers_answering_at_end"] == 3


@pytest.mark.timeout(SOAK_TIMEOUT_S + 30)
def test_short_soak_passes(tmp_path: Path) -> None:
    """10 M+ IDs through kill -9, PostgreSQL, ZooKeeper and NATS outages and clock steps: no duplicate."""
    done, report, output = _soak(tmp_path, "short")
    assert report["passed"] is True, output
    _assert_clean(report)
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
    assert "PASS" in done.stdout


# In CI's soak stage since 2026-11-25 (was `manual`: in 1 of 3 suite runs on 2026-11-24 the soak's
# snowflake worker reconnected to a surviving NATS node 52 ms after its node was killed, yet was not heard
# on $SRV.PING or the clock subject for the remaining 4 minutes; cause not found). 5 runs of 5 passed on
# 2026-11-25; a worker silent at the end now writes its threads' stacks to its log (SIGUSR1).
@pytest.mark.ha
@pytest.mark.kafka
@pytest.mark.timeout(SOAK_TIMEOUT_S + 30)
def test_ha_short_soak_passes(tmp_path: Path) -> None:
    """The clustered stack under NATS and Kafka load: every leader killed and rejoined, no duplicate ID.

    The PostgreSQL primary, the busiest NATS node, the ZooKeeper leader and the Kafka partition leader are
    each killed (kill -9) and started again; each failover must find a new leader.
    """
    done, report, _ = _soak(tmp_path, "ha-short")
    _assert_clean(report)
    phases = {phase["fault"]: phase for phase in report["phases"] if phase["fault"]}
    for fault in (
        "kill -9 postgres primary",
        "kill -9 zookeeper leader",
        "kill -9 kafka leader",
    ):
        assert isinstance(phases[fault]["notes"]["failover_s"], float), phases[fault]["notes"]
    assert isinstance(phases["kill -9 nats busiest node"]["notes"]["recovery"], float)
    for server in ("postgres", "nats", "zookeeper", "kafka"):
        assert isinstance(phases[f"rejoin {server}"]["notes"]["rejoined_s"], float)
    assert sum(phase["kafka_requests"] for phase in report["phases"]) > 0
    # Enrichment through the broker kill, the PostgreSQL failover and its own kill -9: exactly once.
    assert "kill -9 enricher" in phases
    enrichment = report["enrichment"]
    assert enrichment["fed"] > 1000, enrichment
    assert (enrichment["twice"], enrichment["missing"], enrichment["misplaced"]) == (0, 0, 0), enrichment
    assert enrichment["enriched"] + enrichment["dead_lettered"] == enrichment["fed"], enrichment
    assert enrichment["caught_up_s"] is not None, enrichment
    assert report["enricher_restarts"] >= 1
    assert "PASS" in done.stdout


@pytest.mark.timeout(SOAK_TIMEOUT_S + 30)
def test_dc_soak_passes(tmp_path: Path) -> None:
    """Two datacenters joined by NATS gateways, the clients in dc-a: dc-a's workers lost twice.

    Killed, restored, frozen (SIGSTOP), restored. dc-b serves dc-a's callers meanwhile; no error reply, no
    duplicate ID.
    """
    _, report, _ = _soak(tmp_path, "dc")
    _assert_clean(report)
    phases = {phase["name"]: phase for phase in report["phases"]}
    for lost in ("dc-a killed", "dc-a frozen"):
        served = phases[lost]["notes"]["served_again_s"]
        assert isinstance(served, float), phases[lost]["notes"]
        assert served < 5.0  # frozen: the servers drop a silent client within 1.5 s (ping settings)
        assert phases[lost]["errors"] == {}  # requests in flight to the lost workers time out; none fails
    for restored in ("dc-a restored", "dc-a restored #2"):
        assert isinstance(phases[restored]["notes"]["recovery"], float)
