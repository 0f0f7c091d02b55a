"""Snowflake IDs end to end over real NATS (static worker IDs): requests, decode, bad input, clock rules."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from dispenser.core.errors import ClockBehindRecorded, ClockDisagreesWithPeers
from dispenser.messages import DecodeReply, Reply
from dispenser_lab.servers import NatsServer

from .segment_support import ask, client, request, running_worker
from .snowflake_support import (
    TAG,
    ShiftableClock,
    assert_disjoint_increasing,
    assert_unique,
    decoded,
    max_timestamp,
    ranges_of,
    real_ms,
    refused,
    snowflake_config,
    subject,
    take,
    worker_id_of,
)

# These tests reuse subject prefixes and worker IDs: each gets a NATS server of its own (private_nats),
# so that a worker outliving another test (its connection not yet noticed dead) cannot answer here.
pytestmark = [pytest.mark.nats]


ADDRESS = "127.0.0.1:7001"


async def test_empty_body_ranges_and_ids(private_nats: NatsServer, tmp_path: Path, zk_namespace: str) -> None:
    """Empty body gets one ID; 5000 as ranges and 100 as ids come back positive, increasing, worker 7."""
    config = snowflake_config(private_nats.url, tmp_path / "state", name=zk_namespace, worker_id=7)
    async with running_worker(config), client(private_nats.url) as nc:
        one = await ask(nc, subject())
        assert one.tag == TAG
        assert one.ids is not None
        assert len(one.ids) == 1
        batch = await ask(nc, subject(), b'{"count": 5000, "format": "ranges"}')
        assert batch.ranges is not None
        assert batch.ids is None
        assert sum(last - first + 1 for first, last in batch.ranges) == 5000
        hundred = await ask(nc, subject(), b'{"count": 100}')
        assert hundred.ids is not None
        assert len(hundred.ids) == 100
        assert hundred.ids == sorted(hundred.ids)
        issued = ranges_of(one) + ranges_of(batch) + ranges_of(hundred)
    assert_disjoint_increasing(issued)
    assert {decoded(last).worker_id for _, last in issued} == {7}
    assert abs(max_timestamp(issued) - real_ms()) < 5000


async def test_decode_returns_worker_and_time(
    private_nats: NatsServer, tmp_path: Path, zk_namespace: str
) -> None:
    """`leaf.snowflake.decode` with {"id": N} answers the worker ID and a time within a second of now."""
    config = snowflake_config(private_nats.url, tmp_path / "state", name=zk_namespace, worker_id=5)
    async with running_worker(config), client(private_nats.url) as nc:
        [(snowflake_id, _)] = await take(nc, subject())
        msg = await request(nc, "leaf.snowflake.decode", f'{{"id": {snowflake_id}}}'.encode())
        reply = msgspec.json.decode(msg.data, type=DecodeReply)
    assert reply.error is None
    assert reply.id == snowflake_id
    assert reply.worker_id == 5
    assert reply.timestamp_ms is not None
    assert abs(reply.timestamp_ms - real_ms()) < 1000
    assert reply.time is not None
    assert reply.time.endswith("Z")
    assert reply.sequence == decoded(snowflake_id).sequence


BAD_DECODES = [
    (b'{"id": -1}', "invalid"),
    (b"{not json", "malformed"),
    (b'{"id": "12"}', "invalid"),
    (b"", "malformed"),
    (str(2**63).join(['{"id": ', "}"]).encode(), "invalid_id"),
]


async def test_decode_of_a_bad_id_is_an_error(
    private_nats: NatsServer, tmp_path: Path, zk_namespace: str
) -> None:
    """Negative, malformed or too wide IDs get an error body; IDs keep being served."""
    config = snowflake_config(private_nats.url, tmp_path / "state", name=zk_namespace, worker_id=5)
    async with running_worker(config), client(private_nats.url) as nc:
        for body, code in BAD_DECODES:
            msg = await request(nc, "leaf.snowflake.decode", body)
            reply = msgspec.json.decode(msg.data, type=DecodeReply)
            assert reply.error is not None, body
            assert reply.error.code == code, (body, reply.error)
            assert reply.error.message
            assert reply.error.retryable is False
            assert reply.worker_id is None
            assert reply.timestamp_ms is None
            await take(nc, subject())


BAD_REQUESTS = [
    (b'{"count": 0}', "invalid_count", "400"),
    (b'{"count": -2}', "invalid_count", "400"),
    (b'{"count": 10001}', "count_too_large", "413"),
    (b'{"count": 1000001, "format": "ranges"}', "count_too_large", "413"),
    (b"{oops", "malformed", "400"),
    (b'{"count": 1, "colour": "red"}', "invalid", "400"),
]


async def test_bad_requests_get_errors_and_the_worker_keeps_serving(
    private_nats: NatsServer, tmp_path: Path, zk_namespace: str
) -> None:
    """Count 0, too large, bad JSON, a bad tag: each gets its error reply and headers; the next request works."""
    config = snowflake_config(private_nats.url, tmp_path / "state", name=zk_namespace, worker_id=1)
    async with running_worker(config), client(private_nats.url) as nc:
        issued: list[tuple[int, int]] = []
        cases = [(subject(), body, code, status) for body, code, status in BAD_REQUESTS]
        cases.append((subject(tag="bad$tag"), b"", "invalid_tag", "400"))
        for subject_, body, code, status in cases:
            msg = await request(nc, subject_, body)
            reply = msgspec.json.decode(msg.data, type=Reply)
            assert reply.error is not None, body
            assert reply.error.code == code, (body, reply.error)
            assert reply.error.retryable is False
            assert reply.ids is None
            assert reply.ranges is None
            assert msg.headers is not None
            assert msg.headers["Nats-Service-Error-Code"] == status
            issued += await take(nc, subject(), 3)
    assert_disjoint_increasing(issued)


async def test_request_id_replays_the_same_ids(
    private_nats: NatsServer, tmp_path: Path, zk_namespace: str
) -> None:
    """A retry with the same request_id gets the same snowflake IDs; another request_id gets new ones."""
    config = snowflake_config(private_nats.url, tmp_path / "state", name=zk_namespace, worker_id=1)
    async with running_worker(config), client(private_nats.url) as nc:
        first = await ask(nc, subject(), b'{"count": 4, "request_id": "r-1"}')
        again = await ask(nc, subject(), b'{"count": 4, "request_id": "r-1"}')
        other = await ask(nc, subject(), b'{"count": 4, "request_id": "r-2"}')
    assert first.ids is not None
    assert again.ids == first.ids
    assert other.ids is not None
    assert min(other.ids) > max(first.ids)


async def test_small_rollback_is_waited_out(
    private_nats: NatsServer, tmp_path: Path, zk_namespace: str
) -> None:
    """The clock going back 3 ms while serving: every request still succeeds and IDs keep increasing."""
    clock = ShiftableClock()
    config = snowflake_config(private_nats.url, tmp_path / "state", name=zk_namespace, worker_id=2)
    issued: list[tuple[int, int]] = []
    seen_behind = 0
    async with running_worker(config, clock), client(private_nats.url) as nc:
        for _ in range(10):
            issued += await take(nc, subject(), 3000, "ranges")
            clock.shift(-3)
            # The worker's next reading is behind the millisecond it last issued in (unless this loop is slow).
            seen_behind += clock.wall_ms() <= max_timestamp(issued)
            issued += await take(nc, subject(), 10)
    assert_disjoint_increasing(issued)
    assert seen_behind >= 1, "the rollback never reached the worker; the test proved nothing"


async def test_large_rollback_is_refused(private_nats: NatsServer, tmp_path: Path, zk_namespace: str) -> None:
    """The clock going back 1 s: `clock_moved_backwards` (retryable, no ID); once it is back, IDs resume above."""
    clock = ShiftableClock()
    config = snowflake_config(private_nats.url, tmp_path / "state", name=zk_namespace, worker_id=2)
    async with running_worker(config, clock), client(private_nats.url) as nc:
        before = await take(nc, subject(), 50)
        clock.shift(-1000)
        for body in (b"", b'{"count": 5000, "format": "ranges"}'):
            msg = await request(nc, subject(), body)
            reply = msgspec.json.decode(msg.data, type=Reply)
            assert reply.error is not None
            assert reply.error.code == "clock_moved_backwards"
            assert reply.error.retryable is True
            assert "backwards" in reply.error.message
            assert reply.ids is None
            assert reply.ranges is None
            assert msg.headers is not None
            assert msg.headers["Nats-Service-Error-Code"] == "503"
        clock.shift(1000)
        after = await take(nc, subject(), 50)
    assert_disjoint_increasing(before + after)


async def test_restart_with_clock_far_behind_is_refused(
    private_nats: NatsServer, tmp_path: Path, zk_namespace: str
) -> None:
    """Stop, move the clock back 60 s, start again: ClockBehindRecorded says how far behind it is."""
    clock = ShiftableClock()
    config = snowflake_config(
        private_nats.url, tmp_path / "state", name=zk_namespace, worker_id=4, address=ADDRESS
    )
    async with running_worker(config, clock), client(private_nats.url) as nc:
        await take(nc, subject(), 100)
    clock.shift(-60_000)
    error = await refused(config, clock)
    assert isinstance(error, ClockBehindRecorded)
    assert 59_000 < error.recorded_ms - error.now_ms < 61_000
    assert "behind the timestamp" in error.message
    assert "refusing to issue IDs" in error.message
    clock.shift(60_000)
    async with running_worker(config, clock), client(private_nats.url) as nc:
        await take(nc, subject())


@pytest.mark.parametrize(("offset_ms", "direction"), [(10_000, "ahead of"), (-10_000, "behind")])
async def test_clock_far_from_peers_is_refused(
    private_nats: NatsServer, tmp_path: Path, zk_namespace: str, offset_ms: int, direction: str
) -> None:
    """A second worker whose clock is 10 s off the running worker's refuses to start, and says so."""
    first = snowflake_config(private_nats.url, tmp_path / "a", name=zk_namespace, prefix="peers", worker_id=1)
    second = snowflake_config(
        private_nats.url, tmp_path / "b", name=zk_namespace, prefix="peers", worker_id=2
    )
    async with running_worker(first):
        error = await refused(second, ShiftableClock(offset_ms))
    assert isinstance(error, ClockDisagreesWithPeers)
    assert 9_000 < abs(error.mean_offset_ms) < 11_000
    assert f"ms {direction} the mean of 1 live peer" in error.message


async def test_clock_near_peers_starts(private_nats: NatsServer, tmp_path: Path, zk_namespace: str) -> None:
    """A second worker whose clock is 1 s ahead starts and serves alongside the first; no ID repeats."""
    first = snowflake_config(private_nats.url, tmp_path / "a", name=zk_namespace, prefix="peers", worker_id=1)
    second = snowflake_config(
        private_nats.url, tmp_path / "b", name=zk_namespace, prefix="peers", worker_id=2
    )
    async with (
        running_worker(first),
        running_worker(second, ShiftableClock(1000)) as other,
        client(private_nats.url) as nc,
    ):
        assert worker_id_of(other) == 2
        issued = await asyncio.gather(*(take(nc, subject("peers"), 2000, "ranges") for _ in range(20)))
    ranges = [r for batch in issued for r in batch]
    assert assert_unique(ranges) == 40_000
    assert {decoded(last).worker_id for _, last in ranges} == {1, 2}


async def test_decode_obeys_the_configured_body_limit_and_msgpack(
    private_nats: NatsServer, tmp_path: Path, zk_namespace: str
) -> None:
    """`limits.max_body_bytes` holds for decode as for IDs; a msgpack request gets a msgpack reply."""
    from dispenser.messages import MSGPACK  # noqa: PLC0415

    config = snowflake_config(private_nats.url, tmp_path / "state", name=zk_namespace, worker_id=5)
    config.limits.max_body_bytes = 64
    async with running_worker(config), client(private_nats.url) as nc:
        big = b'{"id": 1' + b" " * 60 + b"}"
        reply = msgspec.json.decode((await request(nc, "leaf.snowflake.decode", big)).data, type=DecodeReply)
        assert reply.error is not None
        assert reply.error.code == "too_large"
        snowflake_id = ranges_of(await ask(nc, subject()))[0][0]
        packed = await request(
            nc,
            "leaf.snowflake.decode",
            msgspec.msgpack.encode({"id": snowflake_id}),
            headers={"Content-Type": MSGPACK},
        )
        decoded_reply = msgspec.msgpack.decode(packed.data, type=DecodeReply)
        assert decoded_reply.worker_id == 5
