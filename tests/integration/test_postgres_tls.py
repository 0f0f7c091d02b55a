"""PostgreSQL over TLS with ``sslmode=verify-full`` against a test CA, on a server that refuses plaintext."""

from __future__ import annotations

import contextlib
import os
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.adapters.postgres.workers import PostgresWorkerRegistry
from dispenser.cli import main
from dispenser.config import redact
from dispenser.core.errors import CoordinatorUnavailable, StoreUnavailable
from dispenser_lab.servers import NatsServer, PostgresServer
from tests.conftest import _running
from tests.integration.segment_support import ask, client, ids_of, running_worker, wait_until
from tests.integration.snowflake_support import snowflake_config, worker_id_of
from tests.integration.tls_support import Pki, make_pki
from tests.secret_values import SECRETS

pytestmark = [pytest.mark.postgres]

PASSWORD = SECRETS["postgres_password"]


def sockets_to(port: int) -> list[str]:
    """This process's TCP sockets to ``port`` on 127.0.0.1, any state (Linux: /proc/net/tcp by inode)."""
    own = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):  # an fd closed meanwhile
            link = os.readlink(fd)
            if link.startswith("socket:["):
                own.add(link[8:-1])
    found = []
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        remote, inode = fields[2], fields[9]
        if inode in own and int(remote.split(":")[1], 16) == port:
            found.append(row)
    return found


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A test CA, a server certificate for 127.0.0.1 and localhost, and an unrelated CA."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_postgres(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[PostgresServer]:
    """A PostgreSQL that accepts only TLS connections with the superuser's password."""
    server = PostgresServer(
        tmp_path_factory.mktemp("postgres-tls") / "data",
        tls_cert=pki.cert,
        tls_key=pki.key,
        password=PASSWORD,
        require_tls=True,
    )
    yield from _running(server)


def with_params(dsn: str, **params: str) -> str:
    return f"{dsn}?{urllib.parse.urlencode(params)}"


def verify_full(server: PostgresServer, ca: Path, database: str = "postgres") -> str:
    return with_params(server.dsn_for(database), sslmode="verify-full", sslrootcert=str(ca))


@pytest.fixture
def tls_dsn(tls_postgres: PostgresServer, pki: Pki, request: pytest.FixtureRequest) -> Iterator[str]:
    """A verify-full DSN of a fresh database of this test's own."""
    name = f"tls_{request.node.name[5:40].lower()}"
    tls_postgres.create_database(name)
    yield verify_full(tls_postgres, pki.ca, name)
    tls_postgres.drop_database(name)


def assert_clean(message: str) -> None:
    """The message names the server, never the password, and is one paragraph (no traceback)."""
    assert PASSWORD not in message
    assert urllib.parse.quote(PASSWORD, safe="") not in message
    assert "Traceback" not in message


async def test_segment_worker_serves_ids_over_verify_full(
    tls_dsn: str, private_nats: NatsServer, tmp_path: Path
) -> None:
    """A worker whose DSN says sslmode=verify-full&sslrootcert=<test CA> connects over TLS and serves IDs."""
    await migrate(tls_dsn)
    async with await PostgresSegmentStore.connect(tls_dsn) as store:
        await store.add_tag("order", 1000)
    conn = await asyncpg.connect(tls_dsn)
    try:
        assert await conn.fetchval("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()") is True
    finally:
        await conn.close()

    config = snowflake_config(
        private_nats.url,
        tmp_path / "state",
        name="tls",
        mode="postgres",
        postgres_dsn=tls_dsn,
        address="10.0.0.1:8080",
    )
    config.segment.enabled = True
    async with client(private_nats.url) as nc, running_worker(config) as worker:
        assert ids_of(await ask(nc, "leaf.segment.order", b'{"count": 5}')) == [1, 2, 3, 4, 5]
        assert len(ids_of(await ask(nc, "leaf.snowflake.order", b'{"count": 3}'))) == 3
        assert worker_id_of(worker) == 0


async def test_postgres_worker_registry_over_verify_full(tls_dsn: str) -> None:
    """The ``postgres`` snowflake worker registry registers and reports over the same verify-full DSN."""
    registry = PostgresWorkerRegistry(tls_dsn, "10.0.0.1:8080", max_worker_id=1023)
    lease = await registry.register()
    await registry.report(1_900_000_000_000)
    await registry.close()
    again = await PostgresWorkerRegistry(tls_dsn, "10.0.0.1:8080", max_worker_id=1023).register()
    assert (again.worker_id, again.high_water_ms) == (lease.worker_id, 1_900_000_000_000)


async def test_localhost_matches_the_certificate_name(tls_postgres: PostgresServer, pki: Pki) -> None:
    """verify-full checks the host name too: ``localhost`` is in the certificate's names."""
    dsn = verify_full(tls_postgres, pki.ca).replace("@127.0.0.1:", "@localhost:")
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()") is True
    finally:
        await conn.close()


async def test_wrong_ca_fails_with_a_clear_error(tls_postgres: PostgresServer, pki: Pki) -> None:
    """Trusting another CA: a short 'certificate verify failed' error naming the server, without the password."""
    dsn = verify_full(tls_postgres, pki.other_ca)
    with pytest.raises(StoreUnavailable) as caught:
        await PostgresSegmentStore.connect(dsn, connect_timeout=5)
    message = str(caught.value)  # what the log and the operator see; a caller gets .message, without where
    assert "certificate verify failed" in message
    assert redact(dsn) in message
    assert_clean(message)
    assert "SSLCertVerificationError" in caught.value.message
    assert redact(dsn) not in caught.value.message
    assert_clean(caught.value.message)
    with pytest.raises(CoordinatorUnavailable) as registry_error:
        await PostgresWorkerRegistry(dsn, "10.0.0.1:8080", max_worker_id=1023).register()
    assert "certificate verify failed" in str(registry_error.value)
    assert_clean(str(registry_error.value))


async def test_plaintext_connection_is_refused(tls_postgres: PostgresServer) -> None:
    """sslmode=disable against a server that requires TLS: refused by pg_hba ('no encryption')."""
    dsn = with_params(tls_postgres.dsn, sslmode="disable")
    with pytest.raises(StoreUnavailable) as caught:
        await PostgresSegmentStore.connect(dsn, connect_timeout=5)
    assert "no encryption" in str(caught.value)
    assert_clean(str(caught.value))


async def test_wrong_password_is_refused_without_echo(tls_postgres: PostgresServer, pki: Pki) -> None:
    """A wrong password: 'password authentication failed', and neither password in the message."""
    wrong = SECRETS["postgres_password"][::-1]
    dsn = verify_full(tls_postgres, pki.ca).replace(urllib.parse.quote(PASSWORD, safe=""), wrong)
    with pytest.raises(StoreUnavailable) as caught:
        await PostgresSegmentStore.connect(dsn, connect_timeout=5)
    # asyncpg closes the refused TLS connection in the background: wait until this process holds no
    # socket to the server any more, before this test's event loop closes (uvloop refuses to close a loop
    # with a live handle, EBUSY; seen once on a loaded machine).
    await wait_until(lambda: not sockets_to(tls_postgres.port), what="the refused connection closed")
    assert "password authentication failed" in str(caught.value)
    assert wrong not in str(caught.value)
    assert_clean(str(caught.value))
    assert wrong not in caught.value.message
    server_log = tls_postgres.log_path.read_text(errors="replace")
    assert "password authentication failed" in server_log
    assert PASSWORD not in server_log
    assert wrong not in server_log


@pytest.mark.parametrize("command", ["serve", "check", "migrate"])
def test_cli_with_the_wrong_ca_exits_with_one_line(
    command: str,
    tls_postgres: PostgresServer,
    pki: Pki,
    *,
    private_nats: NatsServer,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``dispenser serve/check/migrate`` trusting the wrong CA exit 1 with one error line, no traceback."""
    monkeypatch.setenv("DISPENSER_POSTGRES_DSN", verify_full(tls_postgres, pki.other_ca))
    monkeypatch.setenv("DISPENSER_NATS_URL", private_nats.url)
    assert main([command]) == 1
    output = capsys.readouterr()
    text = output.out + output.err
    assert len([line for line in text.splitlines() if "certificate verify failed" in line]) == 1, text
    assert_clean(text)


def test_redact_masks_the_password_of_a_tls_dsn(tls_postgres: PostgresServer, pki: Pki) -> None:
    """redact() hides the password and keeps the TLS settings an operator needs to see."""
    dsn = verify_full(tls_postgres, pki.ca)
    shown = redact(dsn)
    assert PASSWORD not in shown
    assert shown.startswith("postgresql://postgres:***@127.0.0.1:")
    assert "sslmode=verify-full" in shown
    assert f"sslrootcert={urllib.parse.quote(str(pki.ca), safe='')}" in shown
