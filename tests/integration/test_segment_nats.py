"""Segment IDs end to end: real NATS, real PostgreSQL, the worker, the CLI and raw nats-py requests."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from dispenser.cli import main
from dispenser.messages import MSGPACK, Reply
from dispenser_lab.servers import NatsServer, PostgresServer

from .segment_support import ask, client, ids_of, prepare, request, running_worker, wait_until, worker_config

pytestmark = [pytest.mark.nats, pytest.mark.postgres]


async def test_raw_request_gets_increasing_unique_ids(nats_server: NatsServer, pg_dsn: str) -> None:
    """`nc.request("leaf.segment.demo", b'{"count": 5}')` returns five increasing IDs from 1."""
    await prepare(pg_dsn, [("demo", 1000)])
    async with running_worker(worker_config(nats_server.url, pg_dsn)), client(nats_server.url) as nc:
        reply = await ask(nc, "leaf.segment.demo", b'{"count": 5}')
        assert reply.tag == "demo"
        assert reply.ids == [1, 2, 3, 4, 5]
        single = await ask(nc, "leaf.segment.demo")
        assert single.ids == [6]


async def test_ranges_span_segments(nats_server: NatsServer, pg_dsn: str) -> None:
    """A ranges request bigger than a segment comes back as ranges covering exactly count IDs."""
    await prepare(pg_dsn, [("big", 100)])
    async with running_worker(worker_config(nats_server.url, pg_dsn)), client(nats_server.url) as nc:
        reply = await ask(nc, "leaf.segment.big", b'{"count": 250, "format": "ranges"}')
        ids = ids_of(reply)
        assert len(ids) == 250
        assert ids == sorted(set(ids))
        assert ids[0] == 1


async def test_cli_get_prints_ids(
    nats_server: NatsServer, pg_dsn: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dispenser get demo 3` prints three IDs, one per line; an unknown tag exits 1 with its message."""
    await prepare(pg_dsn, [("demo", 10)])
    monkeypatch.setenv("DISPENSER_NATS_URL", nats_server.url)
    async with running_worker(worker_config(nats_server.url, pg_dsn)):
        status = await asyncio.to_thread(main, ["get", "demo", "3"])
        out = capsys.readouterr().out
        assert status == 0
        assert [int(line) for line in out.split()] == [1, 2, 3]
        status = await asyncio.to_thread(main, ["get", "nope"])
        err = capsys.readouterr().err
        assert status == 1
        assert "unknown_tag" in err


async def test_new_tag_is_served_without_restart(nats_server: NatsServer, pg_dsn: str) -> None:
    """A tag added while the worker runs is served at once; a removed tag becomes unknown."""
    await prepare(pg_dsn, [])
    config = worker_config(nats_server.url, pg_dsn)
    async with running_worker(config) as worker, client(nats_server.url) as nc:
        assert (await ask(nc, "leaf.segment.late")).error is not None
        await worker.store.add_tag("late", 10, start=500)
        # Unknown tags refresh the list at most once a second: this request, within that second of the
        # miss above, waits for the next lookup (inside its 2 s deadline) and is served, not refused.
        assert (await ask(nc, "leaf.segment.late")).ids == [500]
        await worker.store.remove_tag("late")
        await worker.allocator.refresh()
        reply = await ask(nc, "leaf.segment.late")
        assert reply.error is not None
        assert reply.error.code == "unknown_tag"


BAD_INPUTS = [
    ("leaf.segment.demo", b"{not json", "malformed", 400),
    ("leaf.segment.demo", b'{"count": "five"}', "invalid", 400),
    ("leaf.segment.demo", b'{"count": 1, "colour": "red"}', "invalid", 400),
    ("leaf.segment.demo", b'{"format": "csv"}', "invalid", 400),
    ("leaf.segment.demo", b'{"count": 0}', "invalid_count", 400),
    ("leaf.segment.demo", b'{"count": -3}', "invalid_count", 400),
    ("leaf.segment.demo", b'{"count": 10001}', "count_too_large", 413),
    ("leaf.segment.demo", b'{"count": 1000001, "format": "ranges"}', "count_too_large", 413),
    ("leaf.segment.demo", b'{"count": 1}' + b" " * 5000, "too_large", 413),
    ("leaf.segment.bad$tag", b"", "invalid_tag", 400),
    ("leaf.segment." + "x" * 129, b"", "invalid_tag", 400),
    ("leaf.segment.nosuchtag", b"", "unknown_tag", 404),
]


async def test_every_bad_input_gets_its_error_and_the_worker_keeps_serving(
    nats_server: NatsServer, pg_dsn: str
) -> None:
    """Each bad request gets its code, message and headers; the next good request still succeeds."""
    await prepare(pg_dsn, [("demo", 1000)])
    async with running_worker(worker_config(nats_server.url, pg_dsn)), client(nats_server.url) as nc:
        issued: list[int] = []
        for subject, body, code, status in BAD_INPUTS:
            msg = await request(nc, subject, body)
            reply = msgspec.json.decode(msg.data, type=Reply)
            assert reply.error is not None, (subject, body)
            assert reply.error.code == code, (body, reply.error)
            assert reply.error.message
            assert reply.error.retryable is False
            assert reply.ids is None
            assert msg.headers is not None
            assert msg.headers["Nats-Service-Error-Code"] == str(status)
            assert msg.headers["Nats-Service-Error"] == reply.error.message
            good = await ask(nc, "leaf.segment.demo", b'{"count": 2}')
            issued += ids_of(good)
        assert issued == sorted(set(issued))


async def test_request_id_returns_the_same_ids(nats_server: NatsServer, pg_dsn: str) -> None:
    """A retry with the same request_id gets the same IDs; a new request_id gets new ones."""
    await prepare(pg_dsn, [("demo", 1000)])
    async with running_worker(worker_config(nats_server.url, pg_dsn)), client(nats_server.url) as nc:
        first = await ask(nc, "leaf.segment.demo", b'{"count": 3, "request_id": "r-1"}')
        again = await ask(nc, "leaf.segment.demo", b'{"count": 3, "request_id": "r-1"}')
        other = await ask(nc, "leaf.segment.demo", b'{"count": 3, "request_id": "r-2"}')
        assert first.ids == again.ids == [1, 2, 3]
        assert other.ids == [4, 5, 6]
        assert again.request_id == "r-1"
        clash = await ask(nc, "leaf.segment.demo", b'{"count": 4, "request_id": "r-1"}')
        assert clash.error is not None
        assert clash.error.code == "invalid"


async def test_msgpack_request_gets_msgpack_reply(nats_server: NatsServer, pg_dsn: str) -> None:
    """With Content-Type application/msgpack, the request is read and the reply written as msgpack."""
    await prepare(pg_dsn, [("demo", 1000)])
    async with running_worker(worker_config(nats_server.url, pg_dsn)), client(nats_server.url) as nc:
        body = msgspec.msgpack.encode({"count": 2})
        msg = await nc.request("leaf.segment.demo", body, timeout=5, headers={"Content-Type": MSGPACK})
        reply = msgspec.msgpack.decode(msg.data, type=Reply)
        assert reply.ids == [1, 2]


async def test_service_discovery(nats_server: NatsServer, pg_dsn: str) -> None:
    """$SRV.PING, $SRV.INFO and $SRV.STATS answer with the service, its segment endpoint and its counts."""
    await prepare(pg_dsn, [("demo", 1000)])
    async with running_worker(worker_config(nats_server.url, pg_dsn)), client(nats_server.url) as nc:
        await ask(nc, "leaf.segment.demo")
        ping = json.loads((await nc.request("$SRV.PING.leaf-dispenser", b"", timeout=5)).data)
        assert ping["name"] == "leaf-dispenser"
        info = json.loads((await nc.request("$SRV.INFO.leaf-dispenser", b"", timeout=5)).data)
        endpoint = info["endpoints"][0]
        assert (endpoint["subject"], endpoint["queue_group"]) == ("leaf.segment.>", "leaf")
        await ask(nc, "leaf.segment.nosuchtag")
        stats = json.loads((await nc.request("$SRV.STATS.leaf-dispenser", b"", timeout=5)).data)
        segment = stats["endpoints"][0]
        assert segment["num_requests"] == 2
        assert segment["num_errors"] == 1
        assert segment["last_error"].startswith("unknown_tag")
        assert segment["processing_time"] > 0


async def test_postgres_outage_is_survived(nats_server: NatsServer, private_postgres: PostgresServer) -> None:
    """PostgreSQL stopped: the buffer keeps answering, then `unavailable`; back: segments resume."""
    dsn = private_postgres.dsn
    await prepare(dsn, [("demo", 50)])
    config = worker_config(nats_server.url, dsn, fetch_deadline=0.5, retry_max=0.2)
    issued: list[int] = []
    async with running_worker(config) as worker, client(nats_server.url) as nc:
        issued += ids_of(await ask(nc, "leaf.segment.demo", b'{"count": 10}'))
        demo = worker.allocator.tags["demo"]
        await wait_until(lambda: bool(demo.stats().next), what="the prefetch of the second segment")
        await asyncio.to_thread(private_postgres.stop)
        served_while_down = 0
        while True:
            reply = await ask(nc, "leaf.segment.demo", b'{"count": 7}')
            if reply.error is not None:
                break
            served_while_down += 7
            issued += ids_of(reply)
        assert reply.error.code == "unavailable"
        assert reply.error.retryable is True
        assert served_while_down >= 50  # the prefetched segment was served from memory
        await asyncio.to_thread(private_postgres.start)
        for _ in range(50):
            reply = await ask(nc, "leaf.segment.demo", b'{"count": 7}')
            if reply.error is None:
                break
            await asyncio.sleep(0.2)
        issued += ids_of(reply)
    assert issued == sorted(set(issued))


async def test_periodic_refresh_drops_removed_tags(nats_server: NatsServer, pg_dsn: str) -> None:
    """With no request to trigger it, the periodic refresh notices a removed tag (and a changed step)."""
    await prepare(pg_dsn, [("demo", 10), ("gone", 10)])
    config = worker_config(nats_server.url, pg_dsn, refresh_interval=0.2)
    async with running_worker(config) as worker, client(nats_server.url) as nc:
        assert (await ask(nc, "leaf.segment.gone")).ids == [1]
        # The step first: a refresh that sees the tag gone has then seen the new step too.
        await worker.store.set_step("demo", 25)
        await worker.store.remove_tag("gone")
        allocator = worker.allocator
        await wait_until(lambda: allocator.get("gone") is None, what="the refresh dropping the removed tag")
        assert worker.allocator.tags["demo"].step == 25
        reply = await ask(nc, "leaf.segment.gone")
        assert reply.error is not None
        assert reply.error.code == "unknown_tag"
