"""Smoke tests of `dispenser bench nats` and `bench client`, local and against a deployment. No timing assertions."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.cli import main
from dispenser_lab.servers import NatsServer

from .segment_support import prepare, running_worker, worker_config

pytestmark = [pytest.mark.nats, pytest.mark.postgres]


def test_bench_nats_reports_every_case(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny run writes every case with positive rates, splits the switch-over run, and prints targets."""
    path = tmp_path / "bench-nats.json"
    status = main(
        [
            "bench",
            "nats",
            *(
                "--duration",
                "0.3",
                "--warmup",
                "0.1",
                "--min-switches",
                "1",
                "--quiet",
                "--daily",
                "--permuted",
            ),
            *("--processes", "2"),
            *("--nats-url", nats_server.url, "--postgres-dsn", pg_dsn, "--subject-prefix", "benchtest"),
            *("--json", str(path)),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "targets" in out

    report = json.loads(path.read_text())
    cases = report["cases"]
    seen = {(c["responder"], c["kind"], c["format"], c["count"], c["inflight"]) for c in cases}
    expected = {
        (responder, "throughput", fmt, count, inflight)
        for responder in ("echo", "dispenser")
        for fmt, count in (("ids", 1), ("ids", 100), ("ranges", 10_000))
        for inflight in (1, 64)
    }
    expected |= {
        ("dispenser", kind, "ids", 10, inflight) for kind in ("reference", "switch") for inflight in (1, 64)
    }
    # The echo answering with a body as large as the dispenser's reply of 100 IDs.
    expected |= {("echo", "sized", "ids", 100, inflight) for inflight in (1, 64)}
    # --daily: the plain tag and a daily one side by side (two cases per key).
    expected |= {("dispenser", "daily", "ids", 1, inflight) for inflight in (1, 64)}
    # --permuted: the plain tag and a permuted one side by side (two cases per key).
    expected |= {("dispenser", "permuted", "ids", 1, inflight) for inflight in (1, 64)}
    # --processes 2: the throughput bodies on one worker and on two processes (two cases per key).
    expected |= {
        ("dispenser", "processes", fmt, count, inflight)
        for fmt, count in (("ids", 1), ("ids", 100), ("ranges", 10_000))
        for inflight in (1, 64)
    }
    assert seen == expected
    assert len(cases) == len(expected) + 2 + 6 + 2
    assert "segment ids/1 @64, 2 processes: " in out
    assert [c["name"].rsplit(" ", 1)[1] for c in cases if c["kind"] == "daily"] == ["plain", "daily"] * 2
    assert "daily @64:" in out
    permuted = [c["name"].rsplit(" ", 1)[1] for c in cases if c["kind"] == "permuted"]
    assert permuted == ["plain", "permuted"] * 2
    assert "permuted ids/1 @64:" in out
    for case in cases:
        assert case["requests"] > 0, case
        assert case["requests_per_s"] > 0, case
        assert case["errors"] == 0, case
        assert case["p50_ms"] > 0, case
        if case["responder"] == "dispenser":
            assert case["ids_per_s"] == pytest.approx(case["requests_per_s"] * case["count"], rel=1e-3)
        if case["kind"] == "throughput" and case["responder"] == "dispenser":
            assert case["ratio_to_echo"] > 0, case
            assert case["reply_bytes"] > 0, case
        if case["kind"] == "sized":
            assert case["reply_bytes"] > 1000, case
    switches = [c for c in cases if c["kind"] == "switch"]
    for case in switches:
        assert case["switch_requests"] + case["steady_requests"] == case["requests"], case
    # A segment of 1,000 IDs at 10 per request: every 100th reply lands on a switch-over.
    assert sum(c["switch_requests"] for c in switches) > 0
    assert {t["name"] for t in report["targets"]} >= {"rate vs echo, ids/1 @64", "IDs/s, ids/100 @64"}


def test_bench_client_reports_every_case(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny `dispenser bench client` run measures every case, the ratios, and judges the six targets.

    A permuted tag beside the plain one: next_id timed call by call, then from the buffer against the plain tag.
    """
    path = tmp_path / "bench-client.json"
    status = main(
        [
            "bench",
            "client",
            *("--duration", "0.2", "--warmup", "0.05", "--quiet"),
            *("--nats-url", nats_server.url, "--postgres-dsn", pg_dsn, "--json", str(path)),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "targets:" in out
    report = json.loads(path.read_text())
    names = [c["name"] for c in report["cases"]]
    assert names == [
        "nc.request per ID @1",
        "nc.request per ID @64",
        "IdClient.next_id",
        "IdClient.take(1000)",
        "IdClient.next_id, permuted tag",
        "BlockingIdClient.next_id x1 threads",
        "BlockingIdClient.next_id x4 threads",
    ]
    for case in report["cases"]:
        assert case["ids_per_s"] > 0
    requests = {c["name"]: c["requests_per_million_ids"] for c in report["cases"]}
    assert requests["nc.request per ID @1"] == 1_000_000
    assert requests["IdClient.next_id"] < 1_000
    assert len(report["targets"]) == 6
    permuted = report["permuted_vs_plain"]
    assert permuted["rounds"] == 5
    assert permuted["permuted_calls_per_s"] > 0
    assert permuted["ratio"] == pytest.approx(
        permuted["permuted_calls_per_s"] / permuted["plain_calls_per_s"]
    )
    ratio = report["next_id_vs_await"]
    assert ratio["rounds"] == 9
    assert ratio["bare_calls_per_s"] > 0
    assert ratio["next_id_calls_per_s"] > 0
    assert ratio["ratio"] == pytest.approx(ratio["next_id_calls_per_s"] / ratio["bare_calls_per_s"])


async def test_bench_measures_a_deployment_by_url_on_its_tags(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--tag` and `--create-tag` start nothing: the cases run against the worker already serving the URL.

    The worker runs in this event loop; the bench, in a thread (it runs a loop of its own), finds it at
    `--nats-url`. `bench nats --tag` takes IDs from an existing tag, `bench client --create-tag` adds its tag
    to the deployment's database and removes it after.
    """
    await prepare(pg_dsn, [("deployed", 1_000_000)])
    nats_json, client_json = tmp_path / "nats.json", tmp_path / "client.json"
    async with running_worker(worker_config(nats_server.url, pg_dsn)):
        nats_status = await asyncio.to_thread(
            main,
            [
                *("bench", "nats", "--duration", "0.2", "--warmup", "0.05", "--inflight", "1", "--quiet"),
                *("--nats-url", nats_server.url, "--tag", "deployed", "--json", str(nats_json)),
            ],
        )
        client_status = await asyncio.to_thread(
            main,
            [
                *("bench", "client", "--duration", "0.1", "--warmup", "0.02", "--quiet"),
                *("--nats-url", nats_server.url, "--postgres-dsn", pg_dsn, "--create-tag", "bench-made"),
                *("--json", str(client_json)),
            ],
        )
        async with await PostgresSegmentStore.connect(pg_dsn) as store:
            tags = await store.list_tags()
    out = capsys.readouterr().out
    assert (nats_status, client_status) == (0, 0), out

    nats_report = json.loads(nats_json.read_text())
    assert nats_report["settings"]["servers"] == "a deployment"
    assert nats_report["deployment"] == {"tag": "deployed", "created": False}
    cases = nats_report["cases"]
    # No echo of ours on an operator's NATS, no switch-over tag: the dispenser's throughput only.
    assert {(c["responder"], c["kind"], c["count"]) for c in cases} == {
        ("dispenser", "throughput", count) for count in (1, 100, 10_000)
    }
    assert all(c["requests"] > 0 and c["errors"] == 0 for c in cases), cases

    client_report = json.loads(client_json.read_text())
    assert client_report["meta"]["deployment"] == {"tag": "bench-made", "created": True}
    assert len(client_report["cases"]) == 6
    assert all(c["ids_per_s"] > 0 for c in client_report["cases"])
    # Other clients' requests reach a deployment's workers too: not counted rather than wrong.
    assert all(c["requests_per_million_ids"] is None for c in client_report["cases"])
    assert "bench-made" not in {tag.tag for tag in tags}
    assert "deployed" in {tag.tag for tag in tags}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "nats", "--tag", "t"], "--nats-url"),
        (["bench", "client", "--create-tag", "t", "--nats-url", "nats://127.0.0.1:9"], "--postgres-dsn"),
        (["bench", "client", "--local", "--tag", "t"], "not allowed with"),
        (
            ["bench", "nats", "--tag", "t", "--nats-url", "nats://127.0.0.1:9", "--profile-worker", "p"],
            "worker",
        ),
    ],
)
def test_bench_deployment_options_that_do_not_add_up_are_usage_errors(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A deployment needs its URL (and a database for a tag to create); --local excludes a tag."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err
