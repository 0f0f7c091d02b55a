"""The operator's CLI against real servers: migrate, tag add/list/set/remove, check."""

from __future__ import annotations

import asyncio
import re

import pytest

from dispenser.cli import main
from dispenser_lab.servers import KafkaBroker, NatsServer, ZooKeeperServer, free_port

pytestmark = [pytest.mark.nats, pytest.mark.postgres]


async def run(args: list[str]) -> int:
    """`dispenser ARGS` in a thread (the CLI runs its own event loop)."""
    return await asyncio.to_thread(main, args)


async def test_tag_administration(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """migrate, then tag add/list/set/remove do what they say, and mistakes exit 1 with a reason."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    assert await run(["migrate"]) == 0
    assert "applied schema version" in capsys.readouterr().out
    assert await run(["migrate"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert (
        await run(["tag", "add", "order", "--step", "500", "--start", "1000", "--description", "orders"]) == 0
    )
    assert await run(["tag", "add", "order", "--step", "5"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert await run(["tag", "set", "order", "--step", "800"]) == 0
    capsys.readouterr()
    assert await run(["tag", "list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("order"))
    assert row.split()[:3] == ["order", "1000", "800"]
    assert await run(["tag", "remove", "order"]) == 0
    assert await run(["tag", "remove", "order"]) == 1
    assert "unknown tag" in capsys.readouterr().err
    # Removed after handing out nothing (max_id 1000): added again below, refused; --resume starts there.
    assert await run(["tag", "add", "order", "--step", "5"]) == 1
    assert "add it with --start 1000 or above (or --resume)" in capsys.readouterr().err
    assert await run(["tag", "add", "order", "--step", "5", "--resume"]) == 0
    assert "first ID 1000" in capsys.readouterr().out
    assert (
        await run(["tag", "add", "bad tag!", "--step", "5"]) == 2
    )  # refused before connecting, as a usage error


async def test_check_names_what_it_cannot_reach(
    nats_server: NatsServer, pg_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dispenser check` passes with both servers up and names each unreachable one otherwise."""
    monkeypatch.setenv("DISPENSER_NATS_URL", nats_server.url)
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    monkeypatch.setenv("DISPENSER_SNOWFLAKE_ENABLED", "true")
    assert await run(["migrate"]) == 0
    capsys.readouterr()
    assert await run(["check"]) == 0
    out = capsys.readouterr().out
    assert "ok   nats" in out
    assert re.search(r"\(nats-server \d+\.\d+\.\d+[-+.\w]*\)", out), out  # the version the server announced
    assert "ok   postgres" in out
    assert "2080-07-10" in out  # the default layout's last valid date
    monkeypatch.setenv("DISPENSER_NATS_URL", f"nats://127.0.0.1:{free_port()}")
    monkeypatch.setenv("DISPENSER_NATS_CONNECT_TIMEOUT", "1")
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", f"postgresql://postgres@127.0.0.1:{free_port()}/postgres")
    assert await run(["check"]) == 1
    captured = capsys.readouterr()
    assert "FAIL nats" in captured.out
    assert "FAIL postgres" in captured.out
    assert "cannot reach nats, postgres" in captured.err


@pytest.mark.zookeeper
async def test_check_reaches_zookeeper_in_zookeeper_mode(
    nats_server: NatsServer,
    zookeeper_server: ZooKeeperServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In zookeeper mode `dispenser check` asks ZooKeeper too, and names it when it is unreachable."""
    monkeypatch.setenv("DISPENSER_NATS_URL", nats_server.url)
    monkeypatch.setenv("DISPENSER_SEGMENT_ENABLED", "false")
    monkeypatch.setenv("DISPENSER_SNOWFLAKE_ENABLED", "true")
    monkeypatch.setenv("DISPENSER_SNOWFLAKE_MODE", "zookeeper")
    monkeypatch.setenv("DISPENSER_SNOWFLAKE_ZOOKEEPER_HOSTS", zookeeper_server.hosts)
    assert await run(["check"]) == 0
    assert "ok   zookeeper" in capsys.readouterr().out
    monkeypatch.setenv("DISPENSER_SNOWFLAKE_ZOOKEEPER_HOSTS", f"127.0.0.1:{free_port()}")
    assert await run(["check"]) == 1
    assert "cannot reach zookeeper" in capsys.readouterr().err


@pytest.mark.kafka
async def test_check_reaches_kafka_when_enabled(
    kafka_broker: KafkaBroker, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With kafka.enabled `dispenser check` asks the broker (NATS off here), and names it when unreachable."""
    monkeypatch.setenv("DISPENSER_NATS_ENABLED", "false")
    monkeypatch.setenv("DISPENSER_SEGMENT_ENABLED", "false")
    monkeypatch.setenv("DISPENSER_KAFKA_ENABLED", "true")
    monkeypatch.setenv("DISPENSER_KAFKA_BOOTSTRAP_SERVERS", kafka_broker.bootstrap)
    monkeypatch.setenv("DISPENSER_KAFKA_REQUEST_TOPIC", "check-topic-not-created-yet")
    assert await run(["check"]) == 0
    out = capsys.readouterr().out
    assert "ok   kafka" in out
    assert "nats" not in out
    monkeypatch.setenv("DISPENSER_KAFKA_BOOTSTRAP_SERVERS", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("DISPENSER_KAFKA_REQUEST_TIMEOUT_MS", "2000")
    assert await run(["check"]) == 1
    assert "cannot reach kafka" in capsys.readouterr().err


async def test_check_fails_on_a_schema_older_than_the_release(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A database migrated by an older release: `check` says which version it needs (not a late failure)."""
    import asyncpg  # noqa: PLC0415

    from dispenser.adapters.postgres.schema import MIGRATIONS  # noqa: PLC0415

    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    monkeypatch.setenv("DISPENSER_NATS_ENABLED", "false")
    assert await run(["migrate"]) == 0
    latest = MIGRATIONS[-1].version
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute("DELETE FROM dispenser_schema_version WHERE version = $1", latest)
    finally:
        await conn.close()
    capsys.readouterr()
    assert await run(["check"]) == 1
    assert f"this release needs {latest}; run `dispenser migrate`" in capsys.readouterr().out
