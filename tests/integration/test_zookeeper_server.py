"""The ZooKeeper test server: jars fetched once, readiness by ``srvr``, restarts on the same port and data."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dispenser_lab.servers import ServerStartError
from dispenser_lab.servers.zookeeper import ZooKeeperServer, default_jar_dir, fetch_zookeeper_jars, srvr
from tests.integration.zk_support import off_loop, plain_client

pytestmark = pytest.mark.zookeeper


def test_fetch_is_skipped_when_the_jars_are_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second fetch finds the stamp and returns at once, without looking for Maven."""
    jars = fetch_zookeeper_jars()
    assert jars == default_jar_dir()
    assert any(jars.glob("zookeeper-3.*.jar"))
    assert any(jars.glob("slf4j-simple-*.jar"))  # so the server logs
    monkeypatch.setenv("PATH", "")  # no mvn to be found
    started = time.monotonic()
    assert fetch_zookeeper_jars() == jars
    assert time.monotonic() - started < 0.5


async def _write_then_read(hosts: str, restart: ZooKeeperServer) -> bytes:
    async with plain_client(hosts) as client:
        await off_loop(client.create, "/kept", b"across restarts")
    restart.kill()
    assert restart.pid is None
    restart.start()
    async with plain_client(hosts) as client:
        data, _ = await off_loop(client.get, "/kept")
    return bytes(data)


async def test_restart_keeps_port_and_data(private_zookeeper: ZooKeeperServer) -> None:
    """Killed and started again, the server serves on the same port with the znodes it had."""
    port = private_zookeeper.port
    assert await _write_then_read(private_zookeeper.hosts, private_zookeeper) == b"across restarts"
    assert private_zookeeper.port == port
    answer = srvr(port)
    assert answer is not None
    assert answer.startswith("Zookeeper version: 3.")


def test_stop_and_context_manager(tmp_path: Path) -> None:
    """The context manager starts a serving server and stops it; srvr then gets no answer."""
    with ZooKeeperServer(tmp_path) as server:
        assert server.pid is not None
        assert server.hosts == f"127.0.0.1:{server.port}"
        assert "Mode: standalone" in (srvr(server.port) or "")
    assert server.pid is None
    assert srvr(server.port) is None
    config = (tmp_path / "zoo.cfg").read_text()
    assert "4lw.commands.whitelist=srvr,ruok,stat" in config
    assert "clientPortAddress=127.0.0.1" in config


def test_a_server_that_cannot_serve_fails_with_its_log(tmp_path: Path) -> None:
    """A broken configuration makes start fail with the reason from ZooKeeper's log, not hang."""
    server = ZooKeeperServer(tmp_path, config={"tickTime": "not-a-number"}, start_timeout=20)
    with pytest.raises(ServerStartError, match=r"tickTime|NumberFormatException|not-a-number"):
        server.start()
    assert server.pid is None
