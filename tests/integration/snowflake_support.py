"""Helpers for the snowflake end-to-end tests: configs, a shiftable clock, workers, replies and registry reads."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path

from nats.aio.client import Client

from dispenser.adapters.zookeeper.registry import DEFAULT_ROOT, ZkSession, decode_node, parse_worker_node
from dispenser.app import Worker
from dispenser.config import Config, load_config
from dispenser.core.errors import DispenserError
from dispenser.core.snowflake import Decoded, SnowflakeLayout
from dispenser.messages import Reply
from dispenser.ports import SystemClock

from .segment_support import ask

TAG = "order"

FAST: Mapping[str, object] = {
    "report_interval": 0.2,
    "zookeeper_session_timeout": 1.0,
    "zookeeper_connect_timeout": 1.0,
    "peer_check_timeout": 0.1,
}
"""Snowflake settings that keep the tests fast: reservations renewed every 0.2 s, 1 s ZooKeeper sessions."""


class ShiftableClock(SystemClock):
    """The real clock, with a wall clock that a test can move back and forth (``offset_ms``)."""

    def __init__(self, offset_ms: int = 0) -> None:
        self.offset_ms = offset_ms

    def wall_ms(self) -> int:
        """Real Unix milliseconds plus the offset (``monotonic()`` is never shifted)."""
        return super().wall_ms() + self.offset_ms

    def shift(self, ms: int) -> None:
        """Move the wall clock by ``ms`` (negative: back)."""
        self.offset_ms += ms


def real_ms() -> int:
    """Real Unix milliseconds."""
    return SystemClock().wall_ms()


def snowflake_env(
    nats_url: str,
    state_dir: Path,
    *,
    name: str,
    mode: str = "static",
    prefix: str = "leaf",
    **snowflake: object,
) -> dict[str, str]:
    """``DISPENSER_*`` variables for a snowflake-only worker (no segment store) with the fast settings.

    A setting given as None is left out (its default applies).
    """
    env = {
        "DISPENSER_NATS_URL": nats_url,
        "DISPENSER_NATS_SUBJECT_PREFIX": prefix,
        "DISPENSER_SEGMENT_ENABLED": "false",
        "DISPENSER_SNOWFLAKE_ENABLED": "true",
        "DISPENSER_SNOWFLAKE_MODE": mode,
        "DISPENSER_SNOWFLAKE_NAME": name,
        "DISPENSER_SNOWFLAKE_STATE_DIR": str(state_dir),
    }
    settings = {**FAST, **snowflake}
    env |= {
        f"DISPENSER_SNOWFLAKE_{key.upper()}": str(value)
        for key, value in settings.items()
        if value is not None
    }
    return env


def snowflake_config(
    nats_url: str,
    state_dir: Path,
    *,
    name: str,
    mode: str = "static",
    prefix: str = "leaf",
    postgres_dsn: str | None = None,
    **snowflake: object,
) -> Config:
    """A :class:`Config` built from :func:`snowflake_env` the way ``dispenser serve`` builds it."""
    env = snowflake_env(nats_url, state_dir, name=name, mode=mode, prefix=prefix, **snowflake)
    if postgres_dsn is not None:
        env["DISPENSER_POSTGRES_DSN"] = postgres_dsn
    return load_config(environ=env)


async def refused(config: Config, clock: ShiftableClock | None = None) -> DispenserError:
    """Start a worker that is expected to refuse and return the error it raised (a refused start cleans up).

    Raises:
        AssertionError: it started.
    """
    worker = Worker(config, clock=clock)
    try:
        await worker.start()
    except DispenserError as exc:
        return exc
    await worker.stop()
    raise AssertionError("the worker started, but it should have refused")


def worker_id_of(worker: Worker) -> int:
    """The worker ID a running snowflake worker issues under."""
    return worker.snowflake.worker_id


def subject(prefix: str = "leaf", tag: str = TAG) -> str:
    """``<prefix>.snowflake.<tag>``."""
    return f"{prefix}.snowflake.{tag}"


def ranges_of(reply: Reply) -> list[tuple[int, int]]:
    """A successful reply's IDs as inclusive ranges, whichever format it used."""
    assert reply.error is None, reply.error
    if reply.ranges is not None:
        return [(first, last) for first, last in reply.ranges]
    assert reply.ids is not None
    return [(i, i) for i in reply.ids]


async def take(nc: Client, subject_: str, count: int = 1, fmt: str = "ids") -> list[tuple[int, int]]:
    """Ask for ``count`` IDs and return them as ranges (failing the test on an error reply)."""
    reply = await ask(nc, subject_, f'{{"count": {count}, "format": "{fmt}"}}'.encode())
    ranges = ranges_of(reply)
    assert sum(last - first + 1 for first, last in ranges) == count
    return ranges


def assert_disjoint_increasing(ranges: Iterable[tuple[int, int]]) -> None:
    """Ranges given in issue order are each well-formed, positive, and strictly above the previous ones."""
    previous = 0
    for first, last in ranges:
        assert 0 < first <= last, (first, last)
        assert first > previous, f"range {first}..{last} does not start above {previous}"
        previous = last


def assert_unique(ranges: Iterable[tuple[int, int]]) -> int:
    """No ID appears in two ranges (in any order), none is negative; returns how many IDs there are."""
    ordered = sorted(ranges)
    total = 0
    previous = -1
    for first, last in ordered:
        assert 0 <= first <= last, (first, last)
        assert first > previous, f"range {first}..{last} overlaps an earlier one ending at {previous}"
        previous = last
        total += last - first + 1
    return total


def decoded(snowflake_id: int, layout: SnowflakeLayout | None = None) -> Decoded:
    """The fields of an ID under the default (or given) layout."""
    return (layout or SnowflakeLayout()).decompose(snowflake_id)


def max_timestamp(ranges: Iterable[tuple[int, int]]) -> int:
    """The latest timestamp (Unix ms) among the IDs."""
    return max(decoded(last).timestamp_ms for _, last in ranges)


@contextlib.asynccontextmanager
async def zk_session(hosts: str) -> AsyncIterator[ZkSession]:
    """A ZooKeeper session of the test's own, for reading what the workers wrote."""
    session = ZkSession(hosts, session_timeout=5.0, connect_timeout=5.0, op_timeout=5.0)
    await session.open()
    try:
        yield session
    finally:
        await session.close()


async def worker_node(hosts: str, name: str, address: str) -> tuple[int, int]:
    """``(worker ID, recorded timestamp)`` of an address's persistent node in ``zookeeper`` mode."""
    forever = f"{DEFAULT_ROOT}/{name}/forever"
    async with zk_session(hosts) as zk:
        for child in await zk.children(forever):
            parsed = parse_worker_node(child)
            if parsed is not None and parsed[0] == address:
                path = f"{forever}/{child}"
                found = await zk.get(path)
                assert found is not None, path
                return parsed[1], decode_node(found[0], path).timestamp
    raise AssertionError(f"no worker node for {address} under {forever}")


async def lease_owner(hosts: str, name: str, worker_id: int) -> int | None:
    """The session that holds ``lease/<worker_id>`` in ``zookeeper-lease`` mode (None: free)."""
    async with zk_session(hosts) as zk:
        found = await zk.get(f"{DEFAULT_ROOT}/{name}/lease/{worker_id}")
    return None if found is None else int(found[1].ephemeral_owner)


async def lease_high_water(hosts: str, name: str, worker_id: int) -> int:
    """The recorded high water of a worker ID in ``zookeeper-lease`` mode (0: none)."""
    path = f"{DEFAULT_ROOT}/{name}/high-water/{worker_id}"
    async with zk_session(hosts) as zk:
        found = await zk.get(path)
    return 0 if found is None else decode_node(found[0], path).timestamp
