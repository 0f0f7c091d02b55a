"""NATS authentication and per-tag authorisation against a real nats-server.

The worker connects with each supported method, and the permissions documented in docs/security.md are
exactly what the server runs.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import nkeys
import pytest
from nats.errors import TimeoutError as NatsTimeout

from dispenser.adapters.nats.peers import collect_peer_clocks
from dispenser.config import Config, load_config
from dispenser.messages import RateEvent
from dispenser_lab.servers import NatsServer
from tests.secret_values import SECRETS

from .nats_auth_support import auth_config, documented_permissions, make_pki, refused_connection
from .segment_support import ask, ids_of, prepare, request, running_worker

pytestmark = [pytest.mark.nats, pytest.mark.postgres]


@dataclass
class Method:
    """One way to authenticate: the server's configuration, and what the worker and a client present."""

    server_config: str
    server_env: dict[str, str]
    worker: dict[str, str]
    client: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)
    """Files to write into the test's directory first (name → content); ``{dir}`` in values is replaced."""


def _nkey_public(seed: str) -> str:
    public: bytes = nkeys.from_seed(bytearray(seed.encode())).public_key
    return public.decode()


METHODS = {
    "user-password": Method(
        server_config="authorization { user: leaf, password: $LEAF_PASS }",
        server_env={"LEAF_PASS": SECRETS["nats_password"]},
        worker={"user": "leaf", "password": SECRETS["nats_password"]},
        client={"user": "leaf", "password": SECRETS["nats_password"]},
    ),
    "token": Method(
        server_config="authorization { token: $LEAF_TOKEN }",
        server_env={"LEAF_TOKEN": SECRETS["nats_token"]},
        worker={"token": SECRETS["nats_token"]},
        client={"token": SECRETS["nats_token"]},
    ),
    "nkey": Method(
        server_config=f"authorization {{ users = [ {{ nkey: {_nkey_public(SECRETS['nats_nkey_seed'])} }} ] }}",
        server_env={},
        worker={"nkeys_seed": "{dir}/user.nk"},
        client={"nkeys_seed_str": SECRETS["nats_nkey_seed"]},
        files={"user.nk": SECRETS["nats_nkey_seed"] + "\n"},
    ),
}


@pytest.mark.parametrize("method", list(METHODS.values()), ids=list(METHODS))
async def test_worker_serves_with_credentials(method: Method, pg_dsn: str, tmp_path: Path) -> None:
    """The worker connects with user/password, a token or an nkey; a client without them is refused."""
    for name, content in method.files.items():
        (tmp_path / name).write_text(content)
        (tmp_path / name).chmod(0o600)
    worker = {key: value.replace("{dir}", str(tmp_path)) for key, value in method.worker.items()}
    await prepare(pg_dsn, [("order", 100)])
    with NatsServer(tmp_path / "nats", config=method.server_config, env=method.server_env) as server:
        assert "Authorization Violation" in str(await refused_connection(server.url))
        async with running_worker(auth_config(server.url, pg_dsn, **worker)):
            nc = await nats.connect(server.url, **method.client)
            try:
                assert ids_of(await ask(nc, "leaf.segment.order", b'{"count": 3}')) == [1, 2, 3]
            finally:
                await nc.close()


async def test_worker_serves_over_mutual_tls(pg_dsn: str, tmp_path: Path) -> None:
    """The worker connects over TLS with the test CA and a client certificate; without one it is refused."""
    pki = make_pki(tmp_path / "pki")
    tls_block = (
        f'tls {{ cert_file: "{pki.server_cert}", key_file: "{pki.server_key}", ca_file: "{pki.ca}", '
        "verify: true, timeout: 2 }"
    )
    await prepare(pg_dsn, [("order", 100)])
    with NatsServer(tmp_path / "nats", config=tls_block, tls=True) as server:
        assert server.url.startswith("tls://127.0.0.1:")
        no_client_cert = ssl.create_default_context(cafile=str(pki.ca))
        with pytest.raises((OSError, nats.errors.Error)):
            await nats.connect(
                server.url, tls=no_client_cert, allow_reconnect=False, max_reconnect_attempts=0
            )
        config = auth_config(
            server.url,
            pg_dsn,
            tls_ca=str(pki.ca),
            tls_cert=str(pki.client_cert),
            tls_key=str(pki.client_key),
        )
        async with running_worker(config):
            context = ssl.create_default_context(cafile=str(pki.ca))
            context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
            nc = await nats.connect(server.url, tls=context)
            try:
                assert ids_of(await ask(nc, "leaf.segment.order", b'{"count": 2}')) == [1, 2]
            finally:
                await nc.close()


class _Collected(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


@pytest.fixture
def dispenser_log() -> Iterator[_Collected]:
    """What the ``dispenser`` loggers say during the test (works with or without pytest's logging plugin)."""
    handler = _Collected()
    logger = logging.getLogger("dispenser")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def _documented_server(workdir: Path) -> NatsServer:
    return NatsServer(
        workdir,
        config=documented_permissions(),
        env={
            "DISPENSER_PASS": SECRETS["nats_dispenser_password"],
            "ORDERS_PASS": SECRETS["nats_orders_password"],
            "OPS_PASS": SECRETS["nats_ops_password"],
        },
    )


def _documented_worker(url: str, dsn: str, state_dir: Path, worker_id: int) -> Config:
    """A worker serving segments and snowflake IDs, with rate events every 0.2 s, as user ``dispenser``."""
    return load_config(
        environ={
            "DISPENSER_NATS_URL": url,
            "DISPENSER_NATS_USER": "dispenser",
            "DISPENSER_NATS_PASSWORD": SECRETS["nats_dispenser_password"],
            "DISPENSER_POSTGRES_DSN": dsn,
            "DISPENSER_SNOWFLAKE_ENABLED": "true",
            "DISPENSER_SNOWFLAKE_WORKER_ID": str(worker_id),
            "DISPENSER_SNOWFLAKE_STATE_DIR": str(state_dir),
            "DISPENSER_SNOWFLAKE_PEER_CHECK_TIMEOUT": "0.3",
            "DISPENSER_SNOWFLAKE_PEER_CHECK_FAILURE": "refuse",
            "DISPENSER_RATE_INTERVAL": "0.2",
        }
    )


async def test_documented_permissions_authorise_per_tag(
    pg_dsn: str, tmp_path: Path, dispenser_log: _Collected
) -> None:
    """docs/security.md's config verbatim: orders gets order IDs only, the workers need nothing more.

    Operators see discovery and rate events but get no IDs; the workers serve, answer discovery, check
    their clocks and publish rates without a single permissions violation.
    """
    await prepare(pg_dsn, [("order", 100), ("user", 100)])
    errors: list[str] = []

    async def error_cb(exc: Exception) -> None:
        errors.append(str(exc))

    with _documented_server(tmp_path / "nats") as server:
        async with (
            running_worker(_documented_worker(server.url, pg_dsn, tmp_path / "a", 1)),
            running_worker(_documented_worker(server.url, pg_dsn, tmp_path / "b", 2)),
        ):
            orders = await nats.connect(
                server.url,
                user="orders",
                password=SECRETS["nats_orders_password"],
                inbox_prefix="_INBOX_orders",
                error_cb=error_cb,
            )
            ops = await nats.connect(server.url, user="ops", password=SECRETS["nats_ops_password"])
            peer = await nats.connect(
                server.url, user="dispenser", password=SECRETS["nats_dispenser_password"]
            )
            try:
                # The order service gets order IDs (a new tag: the reply comes after a segment fetch).
                assert len(ids_of(await ask(orders, "leaf.segment.order", b'{"count": 3}'))) == 3
                # Any other tag, or the snowflake generator, is refused by the server.
                for subject in ("leaf.segment.user", "leaf.snowflake.order"):
                    with pytest.raises(NatsTimeout):
                        await orders.request(subject, b"", timeout=0.5)
                    assert f'nats: permissions violation for publish to "{subject}"' in errors
                assert not orders.is_closed  # a violation is reported, not fatal to the connection

                # Operators: discovery answers from both workers (through allow_responses)...
                inbox = ops.new_inbox()
                pings = await ops.subscribe(inbox)
                await ops.publish("$SRV.PING.leaf-dispenser", b"", reply=inbox)
                answers = [await pings.next_msg(timeout=2) for _ in range(2)]
                assert {msgspec.json.decode(m.data)["name"] for m in answers} == {"leaf-dispenser"}
                info = await request(ops, "$SRV.INFO.leaf-dispenser", b"")
                endpoints = msgspec.json.decode(info.data)["endpoints"]
                assert {e["subject"] for e in endpoints} == {"leaf.segment.>", "leaf.snowflake.>"}
                # ...and the rate events the workers publish (and hear from each other).
                rates = await ops.subscribe("leaf.rate.>")
                event = msgspec.json.decode((await rates.next_msg(timeout=3)).data, type=RateEvent)
                assert event.tag
                # ...but no IDs.
                with pytest.raises(NatsTimeout):
                    await ops.request("leaf.segment.order", b"", timeout=0.5)

                # The snowflake clock check: a peer asking on leaf.snowflake-clock hears both workers.
                heard = await collect_peer_clocks(
                    peer, "leaf.snowflake-clock", lambda: int(time.time() * 1000), 1.0
                )
                assert heard.answered
                assert len(heard.readings) == 2
            finally:
                for nc in (orders, ops, peer):
                    await nc.close()
    # The workers' own log and the server's: no violation by the workers, none unheard.
    assert not [
        line for line in dispenser_log.lines if "Permissions Violation" in line or "NATS error" in line
    ]
    assert not [line for line in dispenser_log.lines if "got no answer at all" in line]
    # nats-server logs each: `"$G/user:orders" - Publish Violation - Subject "leaf.segment.user"`.
    violations = [line for line in server.log_path.read_text().splitlines() if "Violation" in line]
    assert [line.split(" - ", 3)[3] for line in violations] == [
        '"$G/user:orders" - Publish Violation - Subject "leaf.segment.user"',
        '"$G/user:orders" - Publish Violation - Subject "leaf.snowflake.order"',
        '"$G/user:ops" - Publish Violation - Subject "leaf.segment.order"',
    ], violations


async def test_default_inbox_is_refused_to_the_order_service(tmp_path: Path) -> None:
    """The order service must use its own inbox prefix: with the default `_INBOX` its request cannot get a reply."""
    errors: list[str] = []

    async def error_cb(exc: Exception) -> None:
        errors.append(str(exc))

    with _documented_server(tmp_path / "nats") as server:
        nc = await nats.connect(
            server.url, user="orders", password=SECRETS["nats_orders_password"], error_cb=error_cb
        )
        try:
            with pytest.raises((NatsTimeout, nats.errors.NoRespondersError)):
                await nc.request("leaf.segment.order", b"", timeout=0.5)
            assert any(e.startswith("nats: permissions violation for subscription to") for e in errors), (
                errors
            )
        finally:
            await nc.close()
