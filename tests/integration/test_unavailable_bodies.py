"""An ``unavailable`` answer does not say where PostgreSQL is; the worker's log does (issue 33, item 8).

With the database down, error bodies carried the DSN's user, host, port and database and the driver's own
words (with a multi-host DSN, the whole cluster's topology) to any caller. The caller now learns what failed;
the log keeps where, with the password masked.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import aiohttp
import msgspec
import pytest

from dispenser.config import load_config
from dispenser.messages import Reply
from dispenser_lab.servers import NatsServer, PostgresServer
from dispenser_lab.servers.process import free_port
from tests.secret_values import SECRETS

from .segment_support import ask, assert_nowhere, client, ids_of, prepare, request, running_worker, whole

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

PASSWORD = SECRETS["whereabouts_postgres_password"]
USER = "whereabouts_probe_user"
DATABASE = "whereabouts_probe_db"


def assert_logged(caplog: pytest.LogCaptureFixture, parts: Iterable[str]) -> None:
    """The worker's log names every one of ``parts``, and never the password."""
    logged = "\n".join(record.getMessage() for record in caplog.records)
    for part in parts:
        assert part in logged, f"{part!r} not in the log:\n{logged}"
    assert PASSWORD not in logged


async def test_an_unreachable_store_answers_unavailable_without_its_whereabouts(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listens at the DSN: ``unavailable`` everywhere, its whereabouts nowhere but in the log.

    NATS (body, headers, ``$SRV.STATS``) and HTTP (Leaf's form and the batch form) answer ``unavailable``
    without the DSN's user, host, port or database; the log has all four.
    """
    caplog.set_level(logging.INFO)
    port = free_port()
    dsn = f"postgresql://{USER}:{PASSWORD}@127.0.0.1:{port}/{DATABASE}"
    whereabouts = [USER, DATABASE, str(port), "127.0.0.1", PASSWORD]
    env = {
        "DISPENSER_NATS_URL": nats_server.url,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_HTTP_PORT": "0",
        "DISPENSER_SEGMENT_FETCH_DEADLINE": "0.5",
    }
    async with running_worker(load_config(environ=env)) as worker, client(nats_server.url) as nc:
        down = await request(nc, "leaf.segment.order", b'{"count": 1}')
        error = msgspec.json.decode(down.data, type=Reply).error
        assert error is not None
        assert (error.code, error.retryable) == ("unavailable", True), error
        assert "details in the worker's log" in error.message
        assert_nowhere(whole(down), "the NATS reply", whereabouts)
        stats = await request(nc, "$SRV.STATS.leaf-dispenser")
        assert b"unavailable" in stats.data
        assert_nowhere(stats.data.decode(), "$SRV.STATS", whereabouts)
        async with aiohttp.ClientSession(worker.http.url) as session:
            for path in ("/api/segment/get/order", "/api/segment/get/order?count=1"):
                async with session.get(path) as response:
                    body = await response.text()
                    assert response.headers.get("Dispenser-Error-Code") == "unavailable", (path, body)
                    assert_nowhere(f"{body} {dict(response.headers)}", f"HTTP {path}", whereabouts)
    assert_logged(caplog, [USER, DATABASE, f"127.0.0.1:{port}"])


async def test_a_stopped_store_answers_unavailable_without_its_whereabouts(
    nats_server: NatsServer, private_postgres: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL stops under a serving worker: the reply does not say where it was; the log does.

    The ``unavailable`` reply names neither its host, port, user nor database.
    """
    caplog.set_level(logging.INFO)
    dsn = private_postgres.create_database(DATABASE)
    await prepare(dsn, [("order", 2)])
    port = dsn.rpartition(":")[2].partition("/")[0]
    whereabouts = [DATABASE, port, "127.0.0.1", "postgres@"]
    env = {
        "DISPENSER_NATS_URL": nats_server.url,
        "DISPENSER_POSTGRES_DSN": dsn,
        "DISPENSER_POSTGRES_COMMAND_TIMEOUT": "0.5",
        "DISPENSER_SEGMENT_FETCH_DEADLINE": "0.5",
        "DISPENSER_RATE_ENABLED": "false",
        "DISPENSER_RATE_ADAPTIVE_STEP": "false",
    }
    async with running_worker(load_config(environ=env)), client(nats_server.url) as nc:
        assert ids_of(await ask(nc, "leaf.segment.order")) == [1]
        private_postgres.stop()
        down = await request(nc, "leaf.segment.order", b'{"count": 10}')
        error = msgspec.json.decode(down.data, type=Reply).error
        assert error is not None
        assert (error.code, error.retryable) == ("unavailable", True), error
        assert_nowhere(whole(down), "the NATS reply", whereabouts)
    assert_logged(caplog, [DATABASE, f"127.0.0.1:{port}"])
