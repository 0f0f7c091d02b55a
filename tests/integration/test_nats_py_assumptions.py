"""What the NATS adapter assumes of nats-py's public API, checked against the installed version and a real server.

pyproject.toml pins nats-py below the next minor release nobody has tested. Before raising that bound, run
this module: a failure here names the assumption that broke, instead of a worker that silently drops the
requests in flight on SIGTERM or sends error replies without their headers.
"""

from __future__ import annotations

import asyncio
import inspect
from importlib.metadata import version

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.request import ERROR_CODE_HEADER as NATS_MICRO_ERROR_CODE_HEADER
from nats.micro.request import ERROR_HEADER as NATS_MICRO_ERROR_HEADER
from nats.nuid import NUID

from dispenser.adapters.nats.micro import ERROR_CODE_HEADER, ERROR_HEADER
from dispenser_lab.servers import NatsServer

from .segment_support import client, no_responders_soon, request, wait_until

pytestmark = [pytest.mark.nats]

TESTED = (2, 16)
"""The newest nats-py minor release this module passed with (pyproject.toml: ``<2.17``)."""


def test_installed_nats_py_is_a_tested_release() -> None:
    """The installed nats-py is within pyproject's bound: at most the minor release tested here."""
    major, minor = (int(part) for part in version("nats-py").split(".")[:2])
    assert (major, minor) <= TESTED, f"nats-py {version('nats-py')}: re-run this module, then raise TESTED"


def test_error_headers_are_the_ones_nats_micro_uses() -> None:
    """Our ADR-32 error header names are nats.micro's (and so every NATS services client's)."""
    assert (ERROR_HEADER, ERROR_CODE_HEADER) == (NATS_MICRO_ERROR_HEADER, NATS_MICRO_ERROR_CODE_HEADER)
    assert (ERROR_HEADER, ERROR_CODE_HEADER) == ("Nats-Service-Error", "Nats-Service-Error-Code")


def test_public_signatures_we_call() -> None:
    """subscribe(queue=, cb=), publish(headers=), respond, drain, unsubscribe: there, and coroutines."""
    subscribe = inspect.signature(Client.subscribe).parameters
    assert {"subject", "queue", "cb"} <= subscribe.keys()
    assert {"subject", "payload", "reply", "headers"} <= inspect.signature(Client.publish).parameters.keys()
    for method in (Client.subscribe, Client.publish, Client.flush, Msg.respond, Subscription.drain):
        assert inspect.iscoroutinefunction(method), method
    assert inspect.iscoroutinefunction(Subscription.unsubscribe)
    assert isinstance(inspect.getattr_static(Client, "connected_server_version"), property)


def test_nuid_makes_subject_safe_unique_ids() -> None:
    """nats.nuid.NUID (the instance id of a micro service) gives 22 base-62 characters, never twice."""
    nuid = NUID()
    ids = {nuid.next().decode() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 22 and i.isalnum() for i in ids)


async def test_connected_server_version_is_public_and_parsed(nats_server: NatsServer) -> None:
    """`connected_server_version` gives the server's version as major/minor/patch (`dispenser check`)."""
    async with client(nats_server.url) as nc:
        server = nc.connected_server_version
        assert (server.major, server.minor) >= (2, 0)
        assert isinstance(server.patch, int)
        assert isinstance(server.prerelease, str)


async def test_headers_travel_both_ways_and_respond_answers_the_reply_subject(
    nats_server: NatsServer,
) -> None:
    """publish(headers=) arrives as msg.headers; msg.respond reaches the requester (copying its headers)."""
    async with client(nats_server.url) as server_side, client(nats_server.url) as requester:

        async def answer(msg: Msg) -> None:
            if msg.subject.endswith("error"):
                await server_side.publish(
                    msg.reply, b"no", headers={ERROR_HEADER: "bad", ERROR_CODE_HEADER: "400"}
                )
            else:
                await msg.respond(b"yes")

        await server_side.subscribe("assume.>", queue="q", cb=answer)
        await server_side.flush()
        # request() retries the server's early "no responders" (see segment_support.request)
        error = await request(requester, "assume.error", b"", timeout=5)
        assert error.headers == {ERROR_HEADER: "bad", ERROR_CODE_HEADER: "400"}
        ok = await request(requester, "assume.ok", b"", timeout=5, headers={"Content-Type": "x"})
        assert ok.data == b"yes"
        # respond() sends the request's own headers back: why the ID endpoints publish their replies
        # with explicit headers instead (discovery replies, like nats.micro's, use respond).
        assert ok.headers == {"Content-Type": "x"}


async def test_drain_runs_the_callback_for_every_delivered_message_then_stops(
    nats_server: NatsServer,
) -> None:
    """Subscription.drain(): no new messages, but each one already delivered still reaches the callback."""
    async with client(nats_server.url) as server_side, client(nats_server.url) as requester:
        answered: list[bytes] = []

        async def slow(msg: Msg) -> None:
            await asyncio.sleep(0.01)  # so that most requests are still queued when the drain starts
            answered.append(msg.data)
            await msg.respond(msg.data)

        sub = await server_side.subscribe("assume.drain", queue="q", cb=slow)
        await server_side.flush()
        await request(requester, "assume.drain", b"-1")  # the server routes to the new subscription now
        answered.clear()
        requests = [
            asyncio.ensure_future(requester.request("assume.drain", str(i).encode(), timeout=5))
            for i in range(50)
        ]
        await requester.flush()
        await wait_until(lambda: sub.delivered == 51, what="every request delivered to the subscription")
        assert len(answered) < 50
        await sub.drain()  # type: ignore[no-untyped-call]  # nats-py leaves drain() unannotated
        assert len(answered) == 50  # drain() returned only once the queue was empty
        replies = await asyncio.gather(*requests)
        assert sorted(int(r.data) for r in replies) == list(range(50))
        await no_responders_soon(requester, "assume.drain")


async def test_nats_connect_is_the_public_entry_point(nats_server: NatsServer) -> None:
    """`nats.connect` returns a connected Client (what `dispenser.adapters.nats.service.connect` wraps)."""
    nc = await nats.connect(nats_server.url)
    try:
        assert isinstance(nc, Client)
        assert nc.is_connected
    finally:
        await nc.close()
