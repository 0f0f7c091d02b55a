"""The NATS services protocol (ADR-32) on public nats-py API only: discovery, endpoint stats, error headers.

``$SRV.PING``, ``$SRV.INFO`` and ``$SRV.STATS`` answered with the JSON nats.micro sends; :class:`Endpoint`,
one queue subscription whose handler counts its own STATS; :data:`ERROR_HEADER` and
:data:`ERROR_CODE_HEADER`. Why not nats.micro itself: ``docs/protocol.md`` ("Subjects").
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.nuid import NUID

from dispenser.core.errors import DispenserError
from dispenser.messages import MSGPACK

__all__ = [
    "CONTENT_TYPE",
    "ERROR_CODE_HEADER",
    "ERROR_HEADER",
    "Endpoint",
    "MicroService",
    "control_subjects",
    "is_msgpack",
    "reply_headers",
]

log = logging.getLogger(__name__)

ERROR_HEADER = "Nats-Service-Error"
"""Header of an error reply: the error's description (ADR-32)."""
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
"""Header of an error reply: an HTTP-like status code, as a string (ADR-32)."""
CONTENT_TYPE = "Content-Type"
"""The request header whose value ``application/msgpack`` selects msgpack for the request and its reply."""
_MSGPACK_HEADERS = {CONTENT_TYPE: MSGPACK}


def is_msgpack(msg: Msg) -> bool:
    """Whether a request asks for msgpack (its ``Content-Type``), for itself and its reply."""
    return msg.headers is not None and msg.headers.get(CONTENT_TYPE) == MSGPACK


def reply_headers(error: DispenserError | None, msgpack: bool) -> dict[str, str] | None:
    """The headers of a reply: the encoding's, and an error reply's description and code (ADR-32)."""
    if error is None:
        return _MSGPACK_HEADERS if msgpack else None
    headers = {ERROR_HEADER: error.message, ERROR_CODE_HEADER: str(error.status)}
    if msgpack:
        headers[CONTENT_TYPE] = MSGPACK
    return headers


CONTROL_PREFIX = "$SRV"
VERBS = ("PING", "INFO", "STATS")

PING_RESPONSE_TYPE = "io.nats.micro.v1.ping_response"
INFO_RESPONSE_TYPE = "io.nats.micro.v1.info_response"
STATS_RESPONSE_TYPE = "io.nats.micro.v1.stats_response"

Handler = Callable[[Msg], Awaitable[None]]

_NAME = re.compile(r"[A-Za-z0-9_-]+")
"""Service and endpoint names (ADR-32): they are subject tokens."""
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?"
)
"""semver.org's regular expression: ADR-32 versions are semantic versions."""


def control_subjects(verb: str, name: str, instance_id: str) -> tuple[str, str, str]:
    """The three subjects one instance answers ``verb`` on: all services, this name, this instance."""
    return (
        f"{CONTROL_PREFIX}.{verb}",
        f"{CONTROL_PREFIX}.{verb}.{name}",
        f"{CONTROL_PREFIX}.{verb}.{name}.{instance_id}",
    )


# The discovery replies. Field order is the JSON key order: the same as nats.micro's ``to_dict()``.


class _Ping(msgspec.Struct):
    type: str
    id: str
    name: str
    version: str
    metadata: dict[str, str]


class _EndpointInfo(msgspec.Struct):
    name: str
    subject: str
    queue_group: str
    metadata: dict[str, str] | None


class _Info(msgspec.Struct):
    type: str
    id: str
    name: str
    version: str
    description: str | None
    endpoints: list[_EndpointInfo]
    metadata: dict[str, str]


class _EndpointStats(msgspec.Struct):
    name: str
    subject: str
    queue_group: str
    num_requests: int
    num_errors: int
    last_error: str
    processing_time: int
    average_processing_time: int
    data: None = None  # nats.micro's stats_handler hook; none here, so null as nats.micro sends it


class _Stats(msgspec.Struct):
    type: str
    name: str
    id: str
    version: str
    started: str
    endpoints: list[_EndpointStats]
    metadata: dict[str, str]


_encode = msgspec.json.Encoder().encode


class Endpoint:
    """One service endpoint: a queue subscription, its discovery entry and its STATS counters.

    The counters are public and plain ``int``/``str`` so that the endpoint's own callback updates them
    inline — nats-py runs one subscription's callbacks one after another, and a wrapper coroutine per
    request would cost the hot path a frame for bookkeeping. A callback counts every message in
    :attr:`num_requests`, the nanoseconds it spent in :attr:`processing_time`, and each error reply
    through :meth:`count_error`.
    """

    __slots__ = (
        "_nc",
        "_subscription",
        "last_error",
        "metadata",
        "name",
        "num_errors",
        "num_requests",
        "processing_time",
        "queue_group",
        "subject",
    )

    def __init__(
        self, nc: Client, name: str, subject: str, queue_group: str, metadata: dict[str, str] | None
    ) -> None:
        """Describe the endpoint; :meth:`start` subscribes it.

        Raises:
            ValueError: ``name`` is not ``[A-Za-z0-9_-]+``.
        """
        if not _NAME.fullmatch(name):
            raise ValueError(f"invalid endpoint name {name!r}: only letters, digits, '-' and '_'")
        self._nc = nc
        self._subscription: Subscription | None = None
        self.name = name
        self.subject = subject
        self.queue_group = queue_group
        self.metadata = metadata
        self.num_requests = 0
        """Messages received."""
        self.num_errors = 0
        """Error replies sent (and handler failures)."""
        self.last_error = ""
        """The last error, ``"<code>: <description>"``; empty until there is one."""
        self.processing_time = 0
        """Nanoseconds spent in the handler, all requests together."""

    async def start(self, handler: Handler) -> None:
        """Subscribe in the endpoint's queue group, with ``handler`` as the callback."""
        if self._subscription is not None:
            raise RuntimeError(f"endpoint {self.name!r} already started")
        self._subscription = await self._nc.subscribe(self.subject, queue=self.queue_group, cb=handler)

    @property
    def delivered(self) -> int:
        """Messages the server has delivered to this endpoint's subscription so far (0 before start)."""
        return 0 if self._subscription is None else self._subscription.delivered

    async def drain(self) -> None:
        """Take no more requests, and return once the callback has run for every one already delivered.

        ``Subscription.drain()`` tells the server to stop sending, flushes (so that the server has sent
        everything it routed here before the unsubscribe), then waits for the subscription's queue to
        empty. ``unsubscribe()`` would throw those pending requests away: the clients would time out.
        """
        subscription, self._subscription = self._subscription, None
        if subscription is None:
            return
        await _drain(subscription)

    def count_error(self, description: str) -> None:
        """Count an error reply (or a failed request) in the STATS."""
        self.num_errors += 1
        self.last_error = description

    def _info(self) -> _EndpointInfo:
        return _EndpointInfo(self.name, self.subject, self.queue_group, self.metadata)

    def _stats(self) -> _EndpointStats:
        n = self.num_requests
        return _EndpointStats(
            self.name,
            self.subject,
            self.queue_group,
            n,
            self.num_errors,
            self.last_error,
            self.processing_time,
            self.processing_time // n if n else 0,  # computed here, not per request
        )


class MicroService:
    """One instance of a NATS micro service: its endpoints and the ``$SRV`` discovery subjects."""

    def __init__(
        self,
        nc: Client,
        *,
        name: str,
        version: str,
        description: str | None = None,
        metadata: dict[str, str] | None = None,
        instance_id: str | None = None,
    ) -> None:
        """Describe the service; add endpoints with :meth:`add_endpoint`, then :meth:`start` discovery.

        Args:
            nc: a connected client.
            name: shared by every instance (``[A-Za-z0-9_-]+``).
            version: a semantic version.
            description: for ``$SRV.INFO``.
            metadata: for PING, INFO and STATS.
            instance_id: unique per instance; a fresh NUID (what nats.micro and Go use) by default.

        Raises:
            ValueError: ``name`` is not ``[A-Za-z0-9_-]+`` or ``version`` is not a semantic version
                (as nats.micro refuses them).
        """
        if not _NAME.fullmatch(name):
            raise ValueError(f"invalid service name {name!r}: only letters, digits, '-' and '_'")
        if not _SEMVER.fullmatch(version):
            raise ValueError(f"invalid service version {version!r}: not a semantic version")
        self._nc = nc
        self.name = name
        self.version = version
        self.description = description
        self.metadata = metadata or {}
        self.id = instance_id or NUID().next().decode()
        self.endpoints: list[Endpoint] = []
        self.started = datetime.now(UTC)
        self._discovery: list[Subscription] = []

    async def add_endpoint(
        self,
        name: str,
        subject: str,
        queue_group: str,
        make_handler: Callable[[Endpoint], Handler],
        metadata: dict[str, str] | None = None,
    ) -> Endpoint:
        """Subscribe an endpoint; ``make_handler(endpoint)`` builds its callback (which counts into it).

        Returns:
            The endpoint, already receiving requests.
        """
        endpoint = Endpoint(self._nc, name, subject, queue_group, metadata)
        await endpoint.start(make_handler(endpoint))
        self.endpoints.append(endpoint)
        return endpoint

    async def start(self) -> None:
        """Answer ``$SRV.PING``, ``$SRV.INFO`` and ``$SRV.STATS`` (all, by name, by id), then flush."""
        if self._discovery:
            return
        answers = {"PING": self.ping, "INFO": self.info, "STATS": self.stats}
        for verb in VERBS:
            respond = self._responder(answers[verb])
            for subject in control_subjects(verb, self.name, self.id):
                self._discovery.append(await self._nc.subscribe(subject, cb=respond))
        self.started = datetime.now(UTC)
        await self._nc.flush()

    @staticmethod
    def _responder(answer: Callable[[], bytes]) -> Handler:
        async def respond(msg: Msg) -> None:
            if msg.reply:  # a plain publish on $SRV.… asks nobody
                await msg.respond(answer())

        return respond

    def ping(self) -> bytes:
        """The ``$SRV.PING`` reply."""
        return _encode(_Ping(PING_RESPONSE_TYPE, self.id, self.name, self.version, self.metadata))

    def info(self) -> bytes:
        """The ``$SRV.INFO`` reply: the service and each endpoint's subject, queue group and metadata."""
        endpoints = [endpoint._info() for endpoint in self.endpoints]
        return _encode(
            _Info(
                INFO_RESPONSE_TYPE,
                self.id,
                self.name,
                self.version,
                self.description,
                endpoints,
                self.metadata,
            )
        )

    def stats(self) -> bytes:
        """The ``$SRV.STATS`` reply: each endpoint's requests, errors, last error and processing time."""
        # Millisecond RFC 3339 in UTC, as nats.micro writes it.
        started = self.started.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        endpoints = [endpoint._stats() for endpoint in self.endpoints]
        return _encode(
            _Stats(STATS_RESPONSE_TYPE, self.name, self.id, self.version, started, endpoints, self.metadata)
        )

    async def drain_endpoints(self) -> None:
        """Stop taking requests; return once every request already delivered has been handed over.

        Discovery keeps answering (an operator sees the instance until it is gone).
        """
        # All at once: each drain is a round trip to the server, and no endpoint should keep taking
        # requests while another one's drain is waiting.
        await asyncio.gather(*(endpoint.drain() for endpoint in self.endpoints))

    async def stop(self) -> None:
        """Drain the endpoints (if not yet done), then the discovery subscriptions."""
        await self.drain_endpoints()
        subscriptions, self._discovery = self._discovery, []
        await asyncio.gather(*(_drain(subscription) for subscription in subscriptions))


async def _drain(subscription: Subscription) -> None:
    try:
        await subscription.drain()  # type: ignore[no-untyped-call]  # nats-py leaves drain() unannotated
    except Exception as exc:  # a closed or draining connection: nothing is left to receive either way
        log.debug("draining %s: %s", subscription.subject, exc)
