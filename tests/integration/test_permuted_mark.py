"""`dispenser tag set --permuted|--no-permuted` on a tag that served plain IDs: real PostgreSQL, real workers.

A worker without the tag's key file serves it plain until its next tag refresh after the mark, then refuses
it (``unavailable``); a worker with the key file serves permuted IDs; the mark taken off, the first serves
plain IDs again. No ID twice, no counter drawn twice (docs/permuted.md, "Setting it up").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import msgspec
import pytest

from dispenser.config import Config, load_config
from dispenser.core.permute import SPAN
from dispenser.messages import Reply
from dispenser.service.permuted import load_permutation
from dispenser_lab.servers import NatsServer

from .segment_support import ask, client, ids_of, running_worker
from .test_permuted import KEY1, cli

pytestmark = [pytest.mark.nats, pytest.mark.postgres]


def worker(nats_url: str, dsn: str, keys: Path) -> Config:
    """A worker with the key files of ``keys``, refreshing its tag list five times a second."""
    env = {
        "DISPENSER_NATS_URL": nats_url,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_HTTP_PORT": "0",
        "DISPENSER_SEGMENT_PERMUTE_KEYS_DIR": str(keys),
        "DISPENSER_SEGMENT_REFRESH_INTERVAL": "0.2",
    }
    return load_config(environ=env)


async def take(url: str, count: int = 5) -> Reply:
    """``count`` IDs of ``order`` from one worker, over Leaf's HTTP API (its batch form): the reply."""
    async with (
        aiohttp.ClientSession(url) as session,
        session.get("/api/segment/get/order", params={"count": str(count)}) as response,
    ):
        return msgspec.json.decode(await response.read(), type=Reply)


async def test_a_plain_tag_marked_then_unmarked_while_workers_serve_it(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain, then refused by the keyless worker and permuted by the keyed one, then plain again: no ID twice."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    assert await cli("migrate") == 0
    assert await cli("tag", "add", "order", "--step", "10") == 0
    keyless, keyed = tmp_path / "none", tmp_path / "keys"
    keyless.mkdir()
    keyed.mkdir()
    (keyed / "order.keys").write_text(f"1 {KEY1}\n")
    plain: list[int] = []
    permuted: list[int] = []
    async with running_worker(worker(nats_server.url, pg_dsn, keyless)) as a:
        assert a.http is not None
        url_a = a.http.url
        plain += (await take(url_a)).ids or []
        assert plain == [1, 2, 3, 4, 5]
        async with client(nats_server.url) as nc:  # the tag remembered as plain on NATS's fast path
            for _ in range(2):
                plain += ids_of(await ask(nc, "leaf.segment.order", b'{"count": 2}'))
            assert plain[5:] == [6, 7, 8, 9]
        assert await cli("tag", "set", "order", "--permuted") == 0
        refused: list[Reply] = []

        async def keyless_refuses() -> bool:
            reply = await take(url_a)
            if reply.error is None:  # not seen the mark yet: plain IDs, harmless (below 10**18)
                plain.extend(reply.ids or [])
                return False
            refused.append(reply)
            return True

        await until(keyless_refuses, what="the keyless worker refuses the marked tag")
        assert refused[0].error is not None
        assert (refused[0].error.code, refused[0].error.retryable) == ("unavailable", True)
        async with client(nats_server.url) as nc:  # and dropped from the fast path: refused there too
            error = (await ask(nc, "leaf.segment.order", b'{"count": 2}')).error
            assert error is not None
            assert error.code == "unavailable"
        async with running_worker(worker(nats_server.url, pg_dsn, keyed)) as b:
            assert b.http is not None
            permuted += (await take(b.http.url)).ids or []
            assert (await take(url_a)).error is not None  # still refused
            assert await cli("tag", "set", "order", "--no-permuted") == 0

            async def keyless_serves() -> bool:
                reply = await take(url_a)
                plain.extend(reply.ids or [])
                return reply.error is None

            await until(keyless_serves, what="the keyless worker serves the unmarked tag")
            permuted += (await take(b.http.url)).ids or []  # the key file still permutes it
    assert len(permuted) == 10
    assert all(i < SPAN for i in plain)
    assert all(SPAN <= i < 2 * SPAN for i in permuted)
    permutation = load_permutation(keyed, "order")
    counters = plain + [permutation.decode(i)[1] for i in permuted]
    assert len(counters) == len(set(counters))  # no counter drawn twice, so no ID twice


async def until(condition: Callable[[], Awaitable[bool]], *, what: str, timeout: float = 10.0) -> None:
    """Ask ``condition`` every 50 ms until it says yes: a test waits for a state, never for a guessed time."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        await asyncio.sleep(0.05)


async def test_tag_set_permuted_refuses_ordered_daily_and_clashing_options(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An ordered tag, a daily tag, no such tag: refused with a reason; nothing is marked."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    assert await cli("migrate") == 0
    assert await cli("tag", "add", "seq", "--step", "10", "--ordered") == 0
    assert await cli("tag", "add", "serial", "--step", "10", "--daily") == 0
    capsys.readouterr()
    assert await cli("tag", "set", "seq", "--permuted") == 1
    assert "is ordered" in capsys.readouterr().err
    assert await cli("tag", "set", "serial", "--permuted") == 1
    assert "daily tag" in capsys.readouterr().err
    assert await cli("tag", "set", "nope", "--permuted") == 1
    assert "nope" in capsys.readouterr().err
    assert await cli("tag", "list") == 0
    assert "[permuted]" not in capsys.readouterr().out
