"""Smoke test of `dispenser bench http`: every case runs against a real worker and lands in the JSON report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dispenser.cli import main
from dispenser_lab.servers import NatsServer

pytestmark = [pytest.mark.nats, pytest.mark.postgres, pytest.mark.slow]


def test_bench_http_reports_every_case(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A one-second run per case writes the echo, the three dispenser cases and Leaf's forms on 2 processes."""
    path = tmp_path / "bench-http.json"
    status = main(
        [
            "bench",
            "http",
            *("--duration", "1", "--warmup", "0", "--repeat", "1", "--quiet", "--processes", "2"),
            *("--nats-url", nats_server.url, "--postgres-dsn", pg_dsn, "--json", str(path)),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "Leaf's segment form vs a trivial aiohttp handler @64" in out
    report = json.loads(path.read_text())
    cases = report["cases"]
    assert [(c["responder"], c["mode"], c["count"], c["inflight"]) for c in cases] == [
        ("echo", None, 1, 64),
        ("dispenser", "segment", 1, 64),
        ("dispenser", "snowflake", 1, 64),
        ("dispenser", "segment", 100, 64),
        ("dispenser-2", "segment", 1, 64),
        ("dispenser-2", "snowflake", 1, 64),
    ]
    assert "segment, Leaf's form, 2 processes @64: " in out  # the line comparing 2 processes with one
    for case in cases:
        assert case["requests"] > 0, case
        assert case["errors"] == 0, case
        assert case["timeouts"] == 0, case
        if case["responder"] != "echo":
            assert case["ratio_to_echo"] > 0, case
            assert case["ids_per_s"] == pytest.approx(case["requests_per_s"] * case["count"], rel=1e-3)
    assert [t["goal"] for t in report["targets"]] == [">= 90%", ">= 90%"]
