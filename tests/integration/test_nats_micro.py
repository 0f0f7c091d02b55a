"""Our NATS micro service (ADR-32) against nats-py's own nats.micro: same subjects, same JSON, graceful drain."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import ServiceInfo, ServicePing, ServiceStats

from dispenser.adapters.nats.micro import Endpoint, MicroService
from dispenser_lab.servers import NatsServer

from .segment_support import client, no_responders_soon, request, wait_until

pytestmark = [pytest.mark.nats]


def _shape(value: Any) -> Any:
    """Keys (in order) and value types of a JSON document, values left out."""
    if isinstance(value, dict):
        return [(key, _shape(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


def _echo(endpoint: Endpoint) -> Any:
    async def handle(msg: Msg) -> None:
        endpoint.num_requests += 1
        endpoint.processing_time += 1000
        if msg.data == b"fail":
            endpoint.count_error("boom: failed")
        await msg.respond(msg.data)

    return handle


async def _ours(nc: Client, name: str) -> MicroService:
    service = MicroService(nc, name=name, version="1.2.3", description="ours")
    await service.add_endpoint("ep", f"{name}.ep.>", "q", _echo, metadata={"k": "v"})
    await service.start()
    return service


async def test_discovery_json_has_nats_micro_s_shape(nats_server: NatsServer) -> None:
    """PING, INFO and STATS: the keys, key order and value types of nats.micro's replies, parsed by it."""
    async with (
        client(nats_server.url) as theirs_nc,
        client(nats_server.url) as ours_nc,
        client(nats_server.url) as nc,
    ):

        async def handler(request: Request) -> None:
            await request.respond(request.data)

        theirs = await add_service(
            theirs_nc, name="theirs", version="1.2.3", description="theirs", queue_group="q"
        )
        await theirs.add_endpoint(name="ep", subject="theirs.ep.>", handler=handler, metadata={"k": "v"})
        ours = await _ours(ours_nc, "ours")
        for name in ("theirs", "ours"):
            await request(nc, f"{name}.ep.x", b"fail")
        try:
            for verb in ("PING", "INFO", "STATS"):
                mine = json.loads((await request(nc, f"$SRV.{verb}.ours")).data)
                reference = json.loads((await request(nc, f"$SRV.{verb}.theirs")).data)
                assert _shape(mine) == _shape(reference), verb
            ServicePing.from_dict(json.loads((await request(nc, "$SRV.PING.ours")).data))
            info = ServiceInfo.from_dict(json.loads((await request(nc, "$SRV.INFO.ours")).data))
            assert (info.id, info.description) == (ours.id, "ours")
            assert [(e.name, e.subject, e.queue_group, e.metadata) for e in info.endpoints] == [
                ("ep", "ours.ep.>", "q", {"k": "v"})
            ]
            stats = ServiceStats.from_dict(json.loads((await request(nc, "$SRV.STATS.ours")).data))
            assert stats.type == "io.nats.micro.v1.stats_response"
            (endpoint,) = stats.endpoints
            assert (endpoint.num_requests, endpoint.num_errors, endpoint.last_error) == (1, 1, "boom: failed")
            assert (endpoint.processing_time, endpoint.average_processing_time) == (1000, 1000)
        finally:
            await theirs.stop()
            await ours.stop()


async def _answered_by(nc: Client, subject: str, service_id: str, timeout: float = 10.0) -> None:
    """Publish to ``subject`` (a discovery subject every service answers) until ``service_id`` answers.

    Other services may answer too (each answer is decoded); there is no waiting for silence, which would
    be a guess. A "no responders" status is sent again, as in ``segment_support.request``.
    """
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subject, b"", reply=inbox)
        async with asyncio.timeout(timeout):
            while True:
                msg = await sub.next_msg(timeout=timeout)
                if not msg.data and msg.headers and msg.headers.get("Status") == "503":
                    await nc.publish(subject, b"", reply=inbox)
                    continue
                if json.loads(msg.data)["id"] == service_id:
                    return
    except TimeoutError:
        raise AssertionError(f"{subject}: no answer from {service_id} within {timeout:g} s") from None
    finally:
        await sub.unsubscribe()


async def test_every_control_subject_answers(nats_server: NatsServer) -> None:
    """$SRV.<verb>, $SRV.<verb>.<name> and $SRV.<verb>.<name>.<id> all answer, for each verb."""
    async with client(nats_server.url) as ours_nc, client(nats_server.url) as nc:
        ours = await _ours(ours_nc, "every")
        try:
            for verb in ("PING", "INFO", "STATS"):
                for subject in (f"$SRV.{verb}", f"$SRV.{verb}.every", f"$SRV.{verb}.every.{ours.id}"):
                    await _answered_by(nc, subject, ours.id)
            assert not (await request(nc, f"$SRV.PING.every.{ours.id}")).headers
        finally:
            await ours.stop()


async def test_drain_answers_delivered_requests_and_takes_no_new_ones(nats_server: NatsServer) -> None:
    """drain_endpoints(): requests already delivered are answered; then nobody answers; discovery stays."""
    async with client(nats_server.url) as ours_nc, client(nats_server.url) as nc:

        def slow(endpoint: Endpoint) -> Any:
            async def handle(msg: Msg) -> None:
                endpoint.num_requests += 1
                await asyncio.sleep(0.01)
                await msg.respond(msg.data)

            return handle

        service = MicroService(ours_nc, name="drain", version="0.0.1")
        endpoint = await service.add_endpoint("ep", "drain.ep", "q", slow)
        await service.start()
        await request(nc, "drain.ep", b"-1")  # the server routes to the new subscription now
        pending = [asyncio.ensure_future(nc.request("drain.ep", b"%d" % i, timeout=5)) for i in range(40)]
        await nc.flush()
        await wait_until(lambda: endpoint.delivered == 41, what="every request delivered to the endpoint")
        await service.drain_endpoints()
        replies = await asyncio.gather(*pending)
        assert sorted(int(r.data) for r in replies) == list(range(40))
        await no_responders_soon(nc, "drain.ep")
        assert json.loads((await request(nc, "$SRV.PING.drain")).data)["name"] == "drain"
        await service.stop()
        await no_responders_soon(nc, "$SRV.PING.drain")


def test_names_and_versions_are_checked_as_nats_micro_does() -> None:
    """A name that is not a subject token, or a version that is not semver, is refused at once."""
    nc = Client()  # never connected: nothing is sent before start()
    for name in ("leaf dispenser", "leaf.dispenser", ""):
        with pytest.raises(ValueError, match="invalid service name"):
            MicroService(nc, name=name, version="1.0.0")
    with pytest.raises(ValueError, match="invalid service version"):
        MicroService(nc, name="ok", version="1.0")
    assert MicroService(nc, name="ok-_1", version="1.0.0-rc.1+b5").version == "1.0.0-rc.1+b5"
    with pytest.raises(ValueError, match="invalid endpoint name"):
        Endpoint(nc, "a.b", "a.b", "q", None)
