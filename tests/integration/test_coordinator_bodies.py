"""An ``unavailable`` snowflake answer does not say where ZooKeeper is; the worker's log does (issue 33, item 8).

A reservation of the high-water mark that ZooKeeper refused reached the caller with the ZooKeeper hosts and
the znode's path. The caller now learns what failed; the log keeps where.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import aiohttp
import kazoo.security  # type: ignore[import-untyped]  # kazoo has no type hints
import msgspec
import pytest

from dispenser.adapters.zookeeper.registry import DEFAULT_ROOT
from dispenser.config import load_config
from dispenser.messages import Reply
from dispenser_lab.servers import NatsServer, ZooKeeperServer

from .segment_support import assert_nowhere, client, request, running_worker, whole
from .snowflake_support import ranges_of, snowflake_env, subject, worker_id_of, zk_session

pytestmark = [pytest.mark.nats, pytest.mark.zookeeper]


@pytest.mark.parametrize("breakage", ["read-only", "garbage"])
async def test_a_mark_zookeeper_refuses_is_answered_without_its_whereabouts(
    breakage: str,
    *,
    nats_server: NatsServer,
    zookeeper_server: ZooKeeperServer,
    tmp_path: Path,
    zk_namespace: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``zookeeper-lease``: the high-water node refuses the worker's writes (an ACL, or data it cannot read).

    The lease is still good (its node is read, not written), so requests wait for a reservation that cannot
    be made, and get ``unavailable`` at their deadline: over NATS (body, headers) and HTTP (Leaf's form and
    the batch form) without ZooKeeper's host, port or the znode's path; the log has them.
    """
    caplog.set_level(logging.INFO)
    hosts = zookeeper_server.hosts
    prefix = "bodies_" + breakage.replace("-", "_")
    env = snowflake_env(
        nats_server.url,
        tmp_path / "state",
        name=zk_namespace,
        mode="zookeeper-lease",
        prefix=prefix,
        zookeeper_hosts=hosts,
        address="10.0.0.1:8080",
        wait_deadline=0.3,
    )
    env["DISPENSER_HTTP_PORT"] = "0"
    async with running_worker(load_config(environ=env)) as worker, client(nats_server.url) as nc:
        ok = await request(nc, subject(prefix), b'{"count": 1}')
        ranges_of(msgspec.json.decode(ok.data, type=Reply))
        whereabouts = [hosts, hosts.rpartition(":")[2], "127.0.0.1", DEFAULT_ROOT, zk_namespace]
        node = f"{DEFAULT_ROOT}/{zk_namespace}/high-water/{worker_id_of(worker)}"
        async with zk_session(hosts) as zk:
            if breakage == "read-only":
                await zk.call(
                    "making the mark read-only",
                    lambda c: c.set_acls_async(node, kazoo.security.READ_ACL_UNSAFE),
                )
            else:
                found = await zk.get(node)
                assert found is not None
                await zk.set(node, b"not a worker record", found[1].version)
        # The reservation (under a second ahead with the fast settings) runs out, and the renewals fail.
        # A request is then refused at its deadline, with the failed write's error, or (when another try
        # was under way at the deadline) with "took longer than the request may wait": ask until the first.
        deadline = time.monotonic() + 10
        messages: list[str] = []
        while time.monotonic() < deadline and not any("coordinator" in m for m in messages):
            refused = await request(nc, subject(prefix), b'{"count": 1}')
            error = msgspec.json.decode(refused.data, type=Reply).error
            if error is None:
                continue
            assert (error.code, error.retryable) == ("unavailable", True), error
            assert_nowhere(whole(refused), "the NATS reply", whereabouts)
            messages.append(error.message)
        assert any("worker-id coordinator unavailable" in m for m in messages), messages
        async with aiohttp.ClientSession(worker.http.url) as session:
            for path in ("/api/snowflake/get/order", "/api/snowflake/get/order?count=1"):
                async with session.get(path) as response:
                    body = await response.text()
                    assert response.headers.get("Dispenser-Error-Code") == "unavailable", (path, body)
                    assert_nowhere(f"{body} {dict(response.headers)}", f"HTTP {path}", whereabouts)
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert node in logged
    if breakage == "read-only":
        assert hosts in logged
