"""NATS: serving IDs as a NATS micro service (ADR-32).

Each generator is one endpoint (``<prefix>.segment.>``, ``<prefix>.snowflake.>``) in one queue group, on
:mod:`dispenser.adapters.nats.micro`. The handler answers the common case inline and moves only requests
that must wait into tasks of their own: ``docs/protocol.md`` ("Subjects").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from nats.aio.client import Client
from nats.aio.msg import Msg

from dispenser import __version__
from dispenser.adapters.nats.micro import CONTENT_TYPE, Endpoint, MicroService, is_msgpack, reply_headers
from dispenser.adapters.nats.ordered import OrderedRoute
from dispenser.config import NatsConfig
from dispenser.core.errors import DispenserError
from dispenser.messages import IdRequest, id_subject
from dispenser.service.answering import Answer, Answerer

__all__ = ["CONTENT_TYPE", "NatsIdService"]

log = logging.getLogger(__name__)

_SILENT_SERVER = 2.0
"""Seconds a stop waits for the server to acknowledge a drain before it counts the server as silent."""

SpecialHandler = Callable[[bytes, bool], Awaitable[Answer]] | OrderedRoute
"""A tag with a handler of its own (``leaf.snowflake.decode``): body and msgpack flag in, answer out; or an
ordered tag's route, which takes the whole message (docs/ordered.md)."""


class NatsIdService:
    """The dispenser's NATS face: one micro service (ADR-32), one endpoint per generator."""

    def __init__(
        self,
        nc: Client,
        config: NatsConfig,
        dispatchers: Mapping[str, Answerer],
        special_tags: Mapping[str, Mapping[str, SpecialHandler]] | None = None,
    ) -> None:
        """Prepare the service.

        Args:
            nc: a connected client.
            config: subjects, queue group and service name.
            dispatchers: by generator kind (``segment``, ``snowflake``): served on
                ``<prefix>.<kind>.<tag>``.
            special_tags: by kind, tags answered by their own handler instead of the dispatcher
                (``leaf.snowflake.decode``): one subscription per kind, so one reply per request. The
                handler gets the body and whether it is msgpack (``Content-Type``), and answers in kind.
        """
        self._nc = nc
        self._config = config
        self._dispatchers = dispatchers
        self._special = special_tags or {}
        self._service: MicroService | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._left: set[str] = set()
        self._leaving: set[asyncio.Task[None]] = set()

    @property
    def service(self) -> MicroService:
        """The micro service (for its id, info and stats)."""
        if self._service is None:
            raise RuntimeError("service not started")
        return self._service

    async def start(self) -> None:
        """Subscribe every endpoint, then answer discovery requests."""
        config = self._config
        service = MicroService(
            self._nc,
            name=config.service_name,
            version=__version__,
            description="Unique 64-bit IDs (Leaf segment and snowflake)",
            metadata={"datacenter": config.datacenter} if config.datacenter else None,
        )
        self._service = service
        for kind, dispatcher in self._dispatchers.items():
            if kind in self._left:
                continue
            prefix = id_subject(config.subject_prefix, kind, "")
            special = self._special.get(kind, {})
            await service.add_endpoint(
                kind,
                prefix + ">",
                config.queue_group,
                functools.partial(self._id_handler, prefix, dispatcher, special),
                metadata={"format": "json|msgpack", "subject": prefix + "<tag>"},
            )
            if kind in self._left:  # left while subscribing
                self.leave(kind)
        # Discovery last: an instance lists only endpoints that already take requests.
        await service.start()

    def _id_handler(
        self,
        prefix: str,
        dispatcher: Answerer,
        special: Mapping[str, SpecialHandler],
        endpoint: Endpoint,
    ) -> Callable[[Msg], Awaitable[None]]:
        cut = len(prefix)
        publish = self._nc.publish
        reply_now = dispatcher.reply_now
        clock = time.perf_counter_ns

        async def handle(msg: Msg) -> None:
            # The endpoint's STATS are counted here rather than in a wrapper: one coroutine per request.
            started = clock()
            endpoint.num_requests += 1
            try:
                tag = msg.subject[cut:]
                if msg.headers is None and tag not in special:
                    # The hot path: a JSON body and a tag seen before, IDs at hand: the reply in one call.
                    now = reply_now(tag, msg.data)
                    if isinstance(now, bytes):
                        if msg.reply:
                            await publish(msg.reply, now)
                        return
                    if now is not None:
                        await self._settle(msg, dispatcher, tag, now, msgpack=False, endpoint=endpoint)
                        return
                await self._answer(msg, dispatcher, tag, special, endpoint)
            except Exception as exc:  # never expected: every failure is already an error reply
                log.exception("unexpected failure in the %s endpoint", endpoint.name)
                endpoint.count_error(repr(exc))
            finally:
                endpoint.processing_time += clock() - started

        return handle

    async def _answer(
        self,
        msg: Msg,
        dispatcher: Answerer,
        tag: str,
        special: Mapping[str, SpecialHandler],
        endpoint: Endpoint,
    ) -> None:
        """The round of a request the hot path did not answer: msgpack, a new body or tag, a special tag."""
        msgpack = is_msgpack(msg)
        if tag in special:
            handler = special[tag]
            if isinstance(handler, OrderedRoute):
                await handler.route(msg)
                return
            await self._respond(msg, await handler(msg.data, msgpack), msgpack, endpoint)
            return
        try:
            request = dispatcher.decode(tag, msg.data, msgpack)
        except DispenserError as exc:
            await self._respond(msg, dispatcher.error(tag, exc, msgpack), msgpack, endpoint)
            return
        now = dispatcher.answer_now(tag, request, msgpack) or request
        await self._settle(msg, dispatcher, tag, now, msgpack=msgpack, endpoint=endpoint)

    async def _settle(
        self,
        msg: Msg,
        dispatcher: Answerer,
        tag: str,
        now: Answer | IdRequest,
        *,
        msgpack: bool,
        endpoint: Endpoint,
    ) -> None:
        """Send an answer, or (a request that must wait) answer it in a task, so that no other request waits."""
        if isinstance(now, Answer):
            await self._respond(msg, now, msgpack, endpoint)
            return
        task = asyncio.create_task(
            self._answer_later(msg, dispatcher, tag, now, msgpack=msgpack, endpoint=endpoint)
        )
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _answer_later(
        self,
        msg: Msg,
        dispatcher: Answerer,
        tag: str,
        request: IdRequest,
        *,
        msgpack: bool,
        endpoint: Endpoint,
    ) -> None:
        answer = await dispatcher.answer(tag, request, msgpack)
        try:
            await self._respond(msg, answer, msgpack, endpoint)
        except Exception:
            log.exception("could not send the reply for tag %r", tag)

    async def _respond(self, msg: Msg, answer: Answer, msgpack: bool, endpoint: Endpoint) -> None:
        error = answer.error
        if error is not None:
            endpoint.count_error(f"{error.code}: {error.message}")
        if not msg.reply:
            return  # a publish without reply subject: nobody to answer
        await self._nc.publish(msg.reply, answer.body, headers=reply_headers(error, msgpack))

    def leave(self, kind: str) -> None:
        """Take no more requests of ``kind`` (and never subscribe it), for the rest of this run.

        A snowflake worker refused by the identity guard calls this: left in the queue group, it would
        answer its share of requests with errors, and NATS would never send its datacenter's callers
        to another datacenter's workers (a gateway crosses only when the home cluster has no member of
        the queue group). Requests already delivered are still answered (with the refusal). Callable
        from synchronous code: the drain runs in a task of its own, awaited by :meth:`stop`.
        """
        self._left.add(kind)
        service = self._service
        if service is None:
            return  # start() skips it
        for endpoint in [e for e in service.endpoints if e.name == kind]:
            service.endpoints.remove(endpoint)  # discovery lists only endpoints that take requests
            task = asyncio.create_task(endpoint.drain(), name=f"leave-{kind}")
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)
            log.warning("left the %s queue group: no more %s requests are sent to this worker", kind, kind)

    @property
    def left(self) -> frozenset[str]:
        """The kinds this worker no longer takes (see :meth:`leave`)."""
        return frozenset(self._left)

    async def _drain_endpoints(self, service: MicroService) -> None:
        """Drain the endpoints, and those left earlier (:meth:`leave`) if their drain is still going."""
        await service.drain_endpoints()
        if self._leaving:
            await asyncio.gather(*self._leaving, return_exceptions=True)

    async def stop(self, grace: float = 5.0) -> None:
        """Stop taking requests, answer those already received, then leave the service.

        Args:
            grace: seconds to wait for requests still waiting (for a segment, for the clock) once the
                endpoints are drained; those still unanswered then are cancelled.
        """
        service = self._service
        if service is None:
            return
        # Drain, not unsubscribe: every request the server already routed to this worker reaches the
        # handler, which answers it inline or starts its task (waited for below). Each drain waits for the
        # server's acknowledgement (nats-py: up to 10 s each): a server gone silent gets a few seconds,
        # then the worker leaves without it (no answer could reach the requesters through it anyway).
        try:
            await asyncio.wait_for(self._drain_endpoints(service), _SILENT_SERVER)
        except TimeoutError:
            log.warning(
                "NATS did not acknowledge the drain within %g s (a silent server?): stopping without it",
                _SILENT_SERVER,
            )
            grace = 0.0
            silent = True
            for task in list(self._leaving):
                task.cancel()
        else:
            silent = False
        if self._inflight:
            _, pending = (
                await asyncio.wait(set(self._inflight), timeout=grace) if grace else ((), self._inflight)
            )
            for task in list(pending):
                task.cancel()
        if silent:
            # Draining the connection next (the worker's last step) would wait on the same silence.
            with contextlib.suppress(Exception):
                await self._nc.close()
        else:
            try:
                await asyncio.wait_for(service.stop(), _SILENT_SERVER)
            except TimeoutError:
                log.warning("NATS did not acknowledge the discovery drain within %g s", _SILENT_SERVER)
        self._service = None
