"""NATS: connecting with the configured credentials, and serving IDs as a NATS micro service (ADR-32).

Each generator is one endpoint (``<prefix>.segment.>``, ``<prefix>.snowflake.>``) in one queue group,
so any number of workers share the load. Discovery works through ``$SRV.PING``, ``$SRV.INFO`` and
``$SRV.STATS``; error replies carry ``Nats-Service-Error`` and ``Nats-Service-Error-Code`` headers as
well as the JSON body.

The micro protocol itself lives in :mod:`dispenser.adapters.nats_micro`, on public nats-py API only.
nats-py runs one subscription's callbacks one after another. The handler therefore answers the common
case inline (no await but the publish) and moves only requests that must wait — for a segment, for the
clock — into tasks of their own, so one slow tag never holds up the others.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from dispenser import __version__
from dispenser.adapters.nats_micro import ERROR_CODE_HEADER, ERROR_HEADER, Endpoint, MicroService
from dispenser.config import NatsConfig, redact
from dispenser.core.peers import PeerReading
from dispenser.messages import MSGPACK, RateEvent
from dispenser.service.answering import Answer, Answerer

__all__ = [
    "NatsIdService",
    "PeerClocks",
    "collect_peer_clocks",
    "connect",
    "rate_sink",
    "serve_clock",
    "server_version",
    "subscribe_rates",
]

log = logging.getLogger(__name__)

SpecialHandler = Callable[[bytes, bool], Awaitable[Answer]]
"""A tag with a handler of its own (``leaf.snowflake.decode``): body and msgpack flag in, answer out."""

_CONTENT_TYPE = "Content-Type"
_MSGPACK_HEADERS = {_CONTENT_TYPE: MSGPACK}


async def connect(config: NatsConfig, name: str = "leaf-dispenser") -> Client:
    """Connect to NATS with the configured servers and credentials; reconnects forever once connected.

    Raises:
        OSError: no server could be reached within ``connect_timeout`` (the message names the URLs).
    """
    tls: ssl.SSLContext | None = None
    if config.tls_ca or config.tls_cert:
        tls = ssl.create_default_context(cafile=config.tls_ca)
        if config.tls_cert:
            tls.load_cert_chain(config.tls_cert, config.tls_key)

    async def on_error(exc: Exception) -> None:
        log.warning("NATS error: %s", exc)

    async def on_disconnect() -> None:
        if not (nc.is_closed or nc.is_draining):  # a disconnect we asked for is not news
            log.warning("disconnected from NATS; reconnecting")

    async def on_reconnect() -> None:
        log.info(
            "reconnected to NATS at %s", redact(str(nc.connected_url.geturl() if nc.connected_url else ""))
        )

    servers = [url.strip() for url in config.url.split(",") if url.strip()]
    try:
        nc = await nats.connect(
            servers=servers,
            name=name,
            user=config.user,
            password=config.password,
            token=config.token,
            user_credentials=config.creds_file,
            nkeys_seed=config.nkeys_seed,
            tls=tls,
            connect_timeout=config.connect_timeout,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
    except Exception as exc:
        shown = ", ".join(redact(s) for s in servers)
        raise OSError(f"cannot connect to NATS at {shown}: {exc or type(exc).__name__}") from exc
    return nc


def server_version(nc: Client) -> str:
    """The version the connected server announced (``2.10.22``), or ``?`` if it sent none or an odd one."""
    # nats-py's public ServerVersion has no string accessor (its repr is "<nats server v…>"): rebuild it.
    version = nc.connected_server_version
    try:
        text = f"{version.major}.{version.minor}.{version.patch}"
    except ValueError:  # not semantic versioning: nats-py refuses to parse it
        return "?"
    if text == "0.0.0":  # nats-py's "0.0.0-unknown": no server, or it sent no version
        return "?"
    if version.prerelease:
        text += f"-{version.prerelease}"
    if version.build:
        text += f"+{version.build}"
    return text


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
        )
        self._service = service
        for kind, dispatcher in self._dispatchers.items():
            prefix = f"{config.subject_prefix}.{kind}."
            special = self._special.get(kind, {})
            await service.add_endpoint(
                kind,
                prefix + ">",
                config.queue_group,
                functools.partial(self._id_handler, prefix, dispatcher, special),
                metadata={"format": "json|msgpack", "subject": prefix + "<tag>"},
            )
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
        clock = time.perf_counter_ns

        async def handle(msg: Msg) -> None:
            # The endpoint's STATS are counted here rather than in a wrapper: one coroutine per request.
            started = clock()
            endpoint.num_requests += 1
            try:
                tag = msg.subject[cut:]
                headers = msg.headers
                msgpack = headers is not None and headers.get(_CONTENT_TYPE) == MSGPACK
                if special and tag in special:
                    await self._respond(msg, await special[tag](msg.data, msgpack), msgpack, endpoint)
                    return
                answer = dispatcher.answer_now(tag, msg.data, msgpack)
                if type(answer) is bytes:
                    if msg.reply:
                        await publish(msg.reply, answer, headers=_MSGPACK_HEADERS if msgpack else None)
                    return
                if answer is not None:
                    await self._respond(msg, answer, msgpack, endpoint)  # type: ignore[arg-type]
                    return
                task = asyncio.create_task(self._answer_later(msg, dispatcher, tag, msgpack, endpoint))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
            except Exception as exc:  # never expected: every failure is already an error reply
                log.exception("unexpected failure in the %s endpoint", endpoint.name)
                endpoint.count_error(repr(exc))
            finally:
                endpoint.processing_time += clock() - started

        return handle

    async def _answer_later(
        self, msg: Msg, dispatcher: Answerer, tag: str, msgpack: bool, endpoint: Endpoint
    ) -> None:
        answer = await dispatcher.answer(tag, msg.data, msgpack)
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
        if error is None:
            await self._nc.publish(msg.reply, answer.body, headers=_MSGPACK_HEADERS if msgpack else None)
            return
        headers = {ERROR_HEADER: error.message, ERROR_CODE_HEADER: str(error.status)}
        if msgpack:
            headers[_CONTENT_TYPE] = MSGPACK
        await self._nc.publish(msg.reply, answer.body, headers=headers)

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
        # handler, which answers it inline or starts its task (waited for below).
        await service.drain_endpoints()
        if self._inflight:
            _, pending = await asyncio.wait(set(self._inflight), timeout=grace)
            for task in pending:
                task.cancel()
        await service.stop()
        self._service = None


_clock_reply = msgspec.json.Encoder()


class _ClockReading(msgspec.Struct):
    wall_ms: int
    worker_id: int


async def serve_clock(
    nc: Client, subject: str, wall_ms: Callable[[], int], worker_id: Callable[[], int]
) -> Subscription:
    """Answer peers' start-up clock checks on ``subject`` (every worker answers: no queue group)."""

    async def answer(msg: Msg) -> None:
        if msg.reply:
            await msg.respond(_clock_reply.encode(_ClockReading(wall_ms(), worker_id())))

    return await nc.subscribe(subject, cb=answer)


class PeerClocks(msgspec.Struct):
    """What the start-up clock query heard."""

    readings: list[PeerReading]
    answered: bool
    """Whether anything answered at all: a peer's reading, or the server's "no responders" status (no
    peer is running). False means the query went unheard: no permission to publish on the clock subject
    (or to receive on the inbox), or the server did not answer in time; the clock is then unverified."""


async def collect_peer_clocks(
    nc: Client, subject: str, wall_ms: Callable[[], int], window: float, enough: int | None = None
) -> PeerClocks:
    """Ask every live peer for its clock and collect the answers that arrive within ``window`` seconds.

    Args:
        nc: the connection.
        subject: the clock subject (``<prefix>.snowflake-clock``).
        wall_ms: our clock.
        window: seconds to listen for answers.
        enough: stop listening once this many peers have answered (``None``: the whole window).
    """
    inbox = nc.new_inbox()
    readings: list[PeerReading] = []
    answered = False
    subscription = await nc.subscribe(inbox)
    try:
        sent = wall_ms()
        await nc.publish(subject, b"", reply=inbox)
        loop = asyncio.get_running_loop()
        end = loop.time() + window
        while (left := end - loop.time()) > 0:
            try:
                msg = await subscription.next_msg(timeout=left)
            except TimeoutError:
                break
            answered = True
            if not msg.data:
                continue  # the server's "no responders" status: nobody else is running
            try:
                reading = msgspec.json.decode(msg.data, type=_ClockReading)
            except msgspec.DecodeError:
                log.warning("ignoring a malformed clock reading on %s", subject)
                continue
            readings.append(PeerReading(reading.wall_ms, sent, wall_ms(), reading.worker_id))
            if enough is not None and len(readings) >= enough:
                break
    finally:
        await subscription.unsubscribe()
    return PeerClocks(readings, answered)


_rate_events = msgspec.json.Decoder(RateEvent)


def rate_sink(nc: Client, prefix: str) -> Callable[[RateEvent], Awaitable[None]]:
    """Publish rate events on ``<prefix>.rate.<tag>``."""

    async def publish(event: RateEvent) -> None:
        await nc.publish(f"{prefix}.rate.{event.tag}", msgspec.json.encode(event))

    return publish


async def subscribe_rates(nc: Client, prefix: str, observe: Callable[[RateEvent], None]) -> Subscription:
    """Hand every rate event on ``<prefix>.rate.>`` to ``observe`` (malformed ones are logged and dropped)."""

    async def received(msg: Msg) -> None:
        try:
            event = _rate_events.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("ignoring a malformed rate event on %s: %s", msg.subject, exc)
            return
        observe(event)

    return await nc.subscribe(f"{prefix}.rate.>", cb=received)
