"""The worker's start and stop against real NATS and PostgreSQL: its parts there, then all released."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from dispenser.adapters.nats.service import NatsIdService
from dispenser.app import NotStarted, Off, PartOff, Worker
from dispenser.core.errors import DispenserError
from dispenser_lab.servers import NatsServer

from .segment_support import ask, client, ids_of, prepare, worker_config

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

_BACKGROUND = {"segment-refresh", "replay-sweep", "rate-events"}


async def test_a_failing_clean_up_step_does_not_leak_the_later_ones(
    nats_server: NatsServer, pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The NATS service's stop (the first clean-up) raises: the error reaches the caller, and yet every later one runs.

    The metrics listener, the background tasks, the NATS connection and the PostgreSQL pool are released.
    """
    await prepare(pg_dsn, [("demo", 100)])
    original = NatsIdService.stop

    async def failing_stop(self: NatsIdService, grace: float = 5.0) -> None:
        await original(self, grace)
        raise RuntimeError("the NATS service failed to stop")

    monkeypatch.setattr(NatsIdService, "stop", failing_stop)
    config = worker_config(nats_server.url, pg_dsn)
    config = msgspec.structs.replace(config, metrics=msgspec.structs.replace(config.metrics, port=0))
    worker = Worker(config)
    await worker.start()
    async with client(nats_server.url) as nc:
        assert ids_of(await ask(nc, "leaf.segment.demo", b'{"count": 2}')) == [1, 2]
    port = worker.metrics.port
    assert {task.get_name() for task in asyncio.all_tasks()} >= _BACKGROUND

    with pytest.raises(RuntimeError, match="the NATS service failed to stop"):
        await worker.stop()

    assert not _BACKGROUND & {task.get_name() for task in asyncio.all_tasks()}
    assert worker.nc.is_closed
    with pytest.raises(DispenserError):
        await worker.postgres.list_tags()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
    await worker.stop()  # a second stop has nothing left to do


async def test_async_with_starts_the_parts_and_stops_them_on_exit(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    """Inside ``async with Worker(config)`` every part exists (one left off says its setting); released on exit."""
    await prepare(pg_dsn, [("demo", 100)])
    worker = Worker(worker_config(nats_server.url, pg_dsn))
    with pytest.raises(NotStarted):
        _ = worker.allocator
    async with worker:
        assert worker.started
        assert list(worker.allocator.tags) == ["demo"]
        assert worker.nc.is_connected
        assert worker.parts.snowflake == Off("snowflake.enabled")
        with pytest.raises(PartOff, match=r"no snowflake generator \(see snowflake\.enabled\)"):
            _ = worker.snowflake
        with pytest.raises(PartOff, match=r"http\.port"):
            _ = worker.http
    assert not worker.started
    assert worker.nc.is_closed
    assert not _BACKGROUND & {task.get_name() for task in asyncio.all_tasks()}
