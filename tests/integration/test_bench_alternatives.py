"""Smoke test of `dispenser bench alternatives`: every case runs, the tables print, the JSON has its shape.

No timing is asserted: tiny counts, a loaded machine. What is asserted is what the run is for: every case
issued IDs, and the facts docs/why.md quotes (a cached holder's order and restart gap, key sizes) hold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dispenser.cli import main
from dispenser_lab.servers import NatsServer

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

CASES = [
    "(timer floor: an empty call)",
    "embedded snowflake: SnowflakeState.issue(now, 1)",
    "UUIDv7: uuid_utils.uuid7()",
    "ULID: ulid.ULID()",
    "dispenser: IdClient.next_id",
    "dispenser: IdClient.take(1000)",
    "dispenser: nc.request per ID @1",
    "dispenser: nc.request per ID @4",
    "PostgreSQL nextval, CACHE 1, 1 connection",
    "PostgreSQL nextval, CACHE 1, 4 connections",
    "PostgreSQL nextval x1000 (generate_series), CACHE 1",
    "PostgreSQL nextval, CACHE 1000, 1 connection",
    "PostgreSQL nextval, CACHE 1000, 4 connections",
    "PostgreSQL nextval x1000 (generate_series), CACHE 1000",
]


def test_bench_alternatives_reports_every_case(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny run prints the three tables and writes every case, both holders and three storage rows."""
    path = tmp_path / "bench-alternatives.json"
    status = main(
        [
            "bench",
            "alternatives",
            *("--duration", "0.05", "--warmup", "0.01", "--rows", "2000", "--quiet"),
            *("--nats-url", nats_server.url, "--postgres-dsn", pg_dsn, "--json", str(path)),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    for heading in ("case", "bits", "IDs/s", "p50 µs", "p99 µs", "in time order", "index bytes per row"):
        assert heading in out
    for name in CASES:
        assert name in out

    report = json.loads(path.read_text())
    assert report["schema_version"] == 1
    assert {"date", "cpus", "python", "duration", "warmup", "rows", "wall_s"} <= report["meta"].keys()
    cases = report["cases"]
    assert [c["name"] for c in cases] == CASES
    for case in cases:
        assert case["calls"] > 0, case
        assert case["ids"] > 0, case
        assert case["ids_per_s"] > 0, case
        assert 0 < case["p50_us"] <= case["p99_us"] <= case["max_us"], case
        expected_bits = {"timer": 0, "in-process": 64 if "snowflake" in case["name"] else 128}
        assert case["bits"] == expected_bits.get(case["family"], 64), case
        network = {"timer": "never", "in-process": "never", "postgres": "every call"}
        if case["name"].startswith("dispenser: IdClient"):
            assert case["network"] == "per range", case
        else:
            assert case["network"] == network.get(case["family"], "every call"), case
    batches = [c for c in cases if "take(1000)" in c["name"] or "x1000" in c["name"]]
    assert len(batches) == 3
    for case in batches:
        assert case["ids"] == 1000 * case["calls"], case

    holders = {h["name"]: h for h in report["holders"]}
    sequence = holders["PostgreSQL sequence, CACHE 1000"]
    client = holders["dispenser IdClient (default BufferSettings)"]
    # Each holder serves from its own cached block: B's first ID lies past A's block, A's next inside it.
    for holder in (sequence, client):
        a1, b1, a2 = holder["interleaved"]
        assert a1 < a2 < b1, holder
        assert holder["time_ordered"] is False
    assert sequence["skipped_on_restart"] == 999  # the rest of the closed connection's CACHE 1000 block
    assert client["skipped_on_restart"] > 0  # the rest of the closed client's range

    storage = report["storage"]
    assert [s["key"].split(",")[0] for s in storage] == ["bigint", "uuid", "uuid"]
    for row in storage:
        assert row["rows"] == 2000
        assert row["table_bytes"] > 0
        assert row["index_bytes"] > 0
    # A uuid key takes more room than a bigint one, in the heap and in the index.
    assert storage[1]["table_bytes"] > storage[0]["table_bytes"]
    assert storage[1]["index_bytes"] > storage[0]["index_bytes"]
