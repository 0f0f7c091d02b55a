"""Permuted tags end to end: real NATS and PostgreSQL, a worker with a key file, Leaf's HTTP API, a rotation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from dispenser.cli import main
from dispenser.config import Config, load_config
from dispenser.core.permute import SPAN
from dispenser.service.permuted import load_permutation
from dispenser_lab.servers import NatsServer
from tests.secret_values import SECRETS

from .segment_support import ask, client, ids_of, running_worker

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

KEY1 = SECRETS["permute_key"]  # the suite's log check fails the run if a key reaches a log line
KEY2 = SECRETS["permute_key_rotated"]


def config(nats_url: str, dsn: str, keys: Path) -> Config:
    env = {
        "DISPENSER_NATS_URL": nats_url,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_HTTP_PORT": "0",
        "DISPENSER_SEGMENT_PERMUTE_KEYS_DIR": str(keys),
    }
    return load_config(environ=env)


async def cli(*args: str) -> int:
    return await asyncio.to_thread(main, list(args))


async def permuted_and_plain(monkeypatch: pytest.MonkeyPatch, dsn: str, keys: Path) -> None:
    """The CLI pointed at ``dsn`` and ``keys``; the schema migrated; tags ``order`` (permuted) and ``plain``, step 50."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", dsn)
    monkeypatch.setenv("DISPENSER_SEGMENT_PERMUTE_KEYS_DIR", str(keys))
    assert await cli("migrate") == 0
    assert await cli("tag", "add", "order", "--step", "50", "--permuted") == 0
    assert await cli("tag", "add", "plain", "--step", "50") == 0


async def take_everywhere(nats_url: str, dsn: str, keys: Path, run: int) -> tuple[list[int], list[int]]:
    """The permuted tag's IDs over NATS (ids, ranges, a request_id and its retry) and Leaf's HTTP API; plain's."""
    got: list[int] = []
    async with running_worker(config(nats_url, dsn, keys)) as worker, client(nats_url) as nc:
        got += ids_of(await ask(nc, "leaf.segment.order", b'{"count": 20}'))
        got += ids_of(await ask(nc, "leaf.segment.order", b'{"count": 5, "format": "ranges"}'))
        assert worker.http is not None
        async with aiohttp.ClientSession(worker.http.url) as session:
            for _ in range(3):
                async with session.get("/api/segment/get/order") as response:
                    assert response.status == 200
                    got.append(int(await response.text()))
        # A request with a request_id: the recorded answer is the permuted one, and a retry gets it again.
        again = b'{"count": 15, "request_id": "r-%d"}' % run
        retried = ids_of(await ask(nc, "leaf.segment.order", again))
        assert ids_of(await ask(nc, "leaf.segment.order", again)) == retried
        got += retried
        plain = ids_of(await ask(nc, "leaf.segment.plain", b'{"count": 3}'))
    return got, plain


async def test_a_permuted_tag_over_nats_and_http_then_a_key_rotation(
    nats_server: NatsServer,
    pg_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """IDs unique, not increasing, decodable with `decode --tag`; after a rotation, epoch 2's, none repeated."""
    await permuted_and_plain(monkeypatch, pg_dsn, tmp_path)
    assert await cli("tag", "list") == 0
    listed = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "[permuted]" in listed["order"]
    assert "[permuted]" not in listed["plain"]
    assert await cli("tag", "set", "order", "--ordered") == 1  # in no order by design: never an ordered tag
    assert "is permuted" in capsys.readouterr().err
    assert await cli("tag", "add", "both", "--step", "5", "--permuted", "--daily") == 1
    assert "neither --daily nor --ordered" in capsys.readouterr().err
    keys = tmp_path / "order.keys"
    keys.write_text(f"1 {KEY1}\n")

    first, plain = await take_everywhere(nats_server.url, pg_dsn, tmp_path, 1)
    assert plain == [1, 2, 3]  # a plain tag beside it is untouched
    assert len(first) == len(set(first)) == 43
    assert first != sorted(first)
    assert all(SPAN <= i < 2 * SPAN for i in first)  # epoch 1: the first digit
    capsys.readouterr()
    assert await cli("decode", "--tag", "order", str(first[0])) == 0
    out = capsys.readouterr().out
    assert "key epoch: 1" in out
    assert "counter:   1\n" in out

    keys.write_text(f"1 {KEY1}\n2 {KEY2}\n")  # the rotation: a new epoch's key, then a restart
    second, _ = await take_everywhere(nats_server.url, pg_dsn, tmp_path, 2)
    assert all(2 * SPAN <= i < 3 * SPAN for i in second)
    assert not set(first) & set(second)
    decoded = load_permutation(tmp_path, "order")
    counters = [decoded.decode(i)[1] for i in first + second]
    assert len(counters) == len(set(counters))  # one counter per ID, across the rotation: none drawn twice
    assert await cli("decode", "--tag", "order", str(first[-1])) == 0  # old IDs still decode
    assert "key epoch: 1" in capsys.readouterr().out


async def test_decode_without_the_key_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`decode --tag` without the tag's key file (or the setting) says so, and prints no counter."""
    monkeypatch.delenv("DISPENSER_SEGMENT_PERMUTE_KEYS_DIR", raising=False)
    assert await cli("decode", "--tag", "order", str(SPAN + 5)) == 1
    assert "permute_keys_dir is not set" in capsys.readouterr().err
    monkeypatch.setenv("DISPENSER_SEGMENT_PERMUTE_KEYS_DIR", str(tmp_path))
    assert await cli("decode", "--tag", "order", str(SPAN + 5)) == 1
    assert "no key file" in capsys.readouterr().err


async def test_a_worker_without_the_key_file_refuses_a_marked_tag_never_plain(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tag add --permuted` while a worker without its key runs: unavailable over NATS and HTTP, no plain ID."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", pg_dsn)
    assert await cli("migrate") == 0
    async with (
        running_worker(config(nats_server.url, pg_dsn, tmp_path)) as worker,
        client(nats_server.url) as nc,
    ):
        assert (
            await cli("tag", "add", "order", "--step", "50", "--permuted") == 0
        )  # learnt at its first request
        for body in (
            b'{"count": 2}',
            b'{"count": 2, "format": "ranges"}',
            b'{"count": 2, "request_id": "r"}',
        ):
            reply = await ask(nc, "leaf.segment.order", body)
            assert reply.error is not None
            assert (reply.error.code, reply.error.retryable) == ("unavailable", True)
            assert "no key file" in reply.error.message
        assert worker.http is not None
        async with (
            aiohttp.ClientSession(worker.http.url) as session,
            session.get("/api/segment/get/order") as response,
        ):
            assert response.status >= 500
            assert response.headers["Dispenser-Error-Code"] == "unavailable"
