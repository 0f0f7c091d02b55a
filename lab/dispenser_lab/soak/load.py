"""The soak's clients: a few NATS connections, each with many requests in flight, every reply checked.

Each request draws its kind (segment or snowflake), tag, count (a batch) and format from a seeded random
generator. A share of requests carry a ``request_id``; such a request is sent again with the same body
after a timeout or a retryable error, as a careful client would. Figures go to the phase that was
current when the request was sent, its outcome (reply, error, timeout) to that phase too unless a fault
was injected while it was in flight (see :meth:`LoadGenerator._outcome_phase`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import nats
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from dispenser.client import KafkaIdClient
from dispenser.config import KafkaConfig
from dispenser_lab.soak.ledger import Checked, RangeSet, check_reply
from dispenser_lab.soak.plan import Phase, Profile

__all__ = ["LoadGenerator", "PhaseStats", "Problem"]

Kind = Literal["segment", "snowflake"]
Format = Literal["ids", "ranges"]

MAX_PROBLEMS = 50
"""Problems kept verbatim for the report (all are counted)."""
_NO_RESPONDER_PAUSE_S = 0.05
_reply_json = msgspec.json.Encoder()
MAX_RETRIES = 3
"""A request with a ``request_id`` is sent at most this many more times."""


@dataclass(frozen=True, slots=True)
class Problem:
    """A reply that fails the run: malformed, a non-retryable error, or an error without a code."""

    phase: str
    kind: str
    tag: str
    what: str


@dataclass(slots=True)
class PhaseStats:
    """What the clients saw during one phase."""

    phase: Phase
    started: float = 0.0
    """``time.monotonic()`` at the start."""
    ended: float | None = None
    requests: int = 0
    """Requests sent during the phase."""
    good: int = 0
    """Replies holding the IDs asked for."""
    ids: Counter[str] = field(default_factory=Counter)
    """IDs received, by kind."""
    errors: Counter[str] = field(default_factory=Counter)
    """Error replies, by code."""
    timeouts: int = 0
    no_responders: int = 0
    kafka_requests: int = 0
    """Of :attr:`requests`, those sent over Kafka."""
    transport: Counter[str] = field(default_factory=Counter)
    """Client-side NATS errors (while reconnecting, …), by exception name."""
    malformed: int = 0
    bad_errors: int = 0
    """Error replies that are not retryable or lack a code (each one fails the run)."""
    latencies_ns: array[int] = field(default_factory=lambda: array("q"))
    """Send-to-reply time of every reply received (good or error)."""
    notes: dict[str, Any] = field(default_factory=dict)
    """What the fault injection reported (seconds it took, recovery time, clock offset)."""

    @property
    def duration_s(self) -> float:
        """Seconds the phase lasted (so far)."""
        end = self.ended if self.ended is not None else time.monotonic()
        return end - self.started

    last_failed_sent: float | None = None
    """``time.monotonic()`` when the last request that got no IDs was sent (see :attr:`cost_s`)."""

    def failed(self, sent: float) -> None:
        """Note a request sent at ``sent`` (monotonic) that got no IDs."""
        if self.last_failed_sent is None or sent > self.last_failed_sent:
            self.last_failed_sent = sent

    @property
    def cost_s(self) -> float:
        """Seconds the phase's fault cost: from the phase's start to the sending of its last failed request.

        Every request sent after that got its IDs. 0 when none failed (a request cut off by the fault but
        sent before it counts as 0 s).
        """
        if self.last_failed_sent is None:
            return 0.0
        return max(0.0, self.last_failed_sent - self.started)

    @property
    def failed_requests(self) -> int:
        """Requests that got no IDs: error replies, timeouts and transport errors."""
        return sum(self.errors.values()) + self.timeouts + self.no_responders + sum(self.transport.values())


@dataclass(frozen=True, slots=True)
class _Request:
    kind: Kind
    tag: str
    count: int
    format: Format
    request_id: str | None

    def body(self) -> bytes:
        fields: dict[str, Any] = {"count": self.count}
        if self.format != "ids":
            fields["format"] = self.format
        if self.request_id is not None:
            fields["request_id"] = self.request_id
        return msgspec.json.encode(fields)


@dataclass(slots=True)
class _Requests:
    """One requester's requests: a new draw, or again the last one when it failed and carries a ``request_id``."""

    draw: Callable[[int], _Request]
    serial: int = 0
    retry: _Request | None = None
    retries: int = 0

    def next(self) -> _Request:
        """The request to send now (a retry at most :data:`MAX_RETRIES` times in a row)."""
        if self.retry is not None and self.retries < MAX_RETRIES:
            request, self.retry = self.retry, None
            self.retries += 1
            return request
        self.serial += 1
        self.retry, self.retries = None, 0
        return self.draw(self.serial)

    def failed(self, request: _Request) -> None:
        """``request`` got no answer or a retryable error: send it again if a retry can get the same IDs."""
        self.retry = request if request.request_id is not None else None


class LoadGenerator:
    """Clients that keep ``profile.clients x profile.inflight`` requests outstanding until stopped.

    Args:
        profile: How much load, of which kinds.
        nats_urls: The NATS servers (any member of a cluster).
        seed: Seeds every requester's random choices.
        subject_prefix: The workers' subject prefix.
    """

    def __init__(
        self,
        profile: Profile,
        nats_urls: list[str],
        seed: int,
        subject_prefix: str = "leaf",
        kafka: KafkaConfig | None = None,
    ) -> None:
        self.profile = profile
        self.nats_urls = nats_urls
        self.kafka = kafka
        """Where to ask over Kafka too (``profile.kafka_inflight`` requesters), or None."""
        self._kafka_client: KafkaIdClient | None = None
        self.seed = seed
        self.prefix = subject_prefix
        self.phase: PhaseStats | None = None
        """The phase new requests count towards; set by the schedule."""
        self.ledger: dict[str, RangeSet] = {}
        """IDs received, by namespace: ``segment:<tag>`` (unique per tag) and ``snowflake`` (all tags)."""
        self.problems: list[Problem] = []
        self.client_errors: Counter[str] = Counter()
        """Errors the NATS connections reported (connection refused while NATS restarts, …), by name."""
        self._stopping = False
        self._connections: list[Client] = []
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def total_ids(self) -> int:
        """IDs received so far, all kinds."""
        return sum(ranges.ids for ranges in self.ledger.values())

    async def start(self) -> None:
        """Connect the clients and start the requesters."""
        for client in range(self.profile.clients):
            nc = await nats.connect(
                self.nats_urls,
                name=f"soak-client-{client}",
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                # nats-py's default callbacks log every failed reconnect attempt as an error with a
                # traceback; during a NATS restart that is expected, and counted here instead.
                error_cb=self._on_client_error,
            )
            self._connections.append(nc)
            for slot in range(self.profile.inflight):
                rng = random.Random(f"{self.seed}/{client}/{slot}")
                name = f"c{client}s{slot}"
                self._tasks.append(asyncio.create_task(self._requester(nc, rng, name), name=name))
        if self.kafka is not None and self.profile.kafka_inflight:
            # One client for every Kafka requester, as a service would hold one: it reads its own replies.
            self._kafka_client = KafkaIdClient(self.kafka, timeout=self.profile.request_timeout_s)
            await self._kafka_client.start()
            for slot in range(self.profile.kafka_inflight):
                rng = random.Random(f"{self.seed}/kafka/{slot}")
                name = f"k{slot}"
                self._tasks.append(
                    asyncio.create_task(self._kafka_requester(self._kafka_client, rng, name), name=name)
                )

    async def stop(self) -> None:
        """Let every requester finish its request in flight, then close the connections."""
        self._stopping = True
        timeout = self.profile.request_timeout_s + 5.0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), timeout)
        for task in self._tasks:
            task.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        for nc in self._connections:
            with contextlib.suppress(Exception):
                await nc.close()
        if self._kafka_client is not None:
            with contextlib.suppress(Exception):
                await self._kafka_client.close()
        for result in results:
            if isinstance(result, Exception):
                raise result

    async def _on_client_error(self, exc: Exception) -> None:
        self.client_errors[type(exc).__name__] += 1

    def _draw(self, rng: random.Random, name: str, serial: int) -> _Request:
        profile = self.profile
        kind: Kind = "snowflake" if rng.random() < profile.snowflake_share else "segment"
        tags = profile.snowflake_tags if kind == "snowflake" else profile.segment_tags
        fmt: Format = "ranges" if rng.random() < profile.ranges_share else "ids"
        request_id = f"soak-{self.seed}-{name}-{serial}" if rng.random() < profile.request_id_share else None
        return _Request(kind, rng.choice(tags), rng.randint(*profile.count_range), fmt, request_id)

    def _namespace(self, request: _Request) -> RangeSet:
        key = "snowflake" if request.kind == "snowflake" else f"segment:{request.tag}"
        ranges = self.ledger.get(key)
        if ranges is None:
            ranges = self.ledger[key] = RangeSet()
        return ranges

    async def _requester(self, nc: Client, rng: random.Random, name: str) -> None:
        timeout = self.profile.request_timeout_s
        clock = time.perf_counter_ns
        requests = _Requests(lambda serial: self._draw(rng, name, serial))
        while not self._stopping:
            phase = self.phase
            if phase is None:
                await asyncio.sleep(0.01)
                continue
            request = requests.next()
            subject = f"{self.prefix}.{request.kind}.{request.tag}"
            phase.requests += 1
            sent = time.monotonic()
            started = clock()
            try:
                msg = await nc.request(subject, request.body(), timeout=timeout)
            except NatsTimeout:
                phase = self._outcome_phase(phase)
                phase.timeouts += 1
                phase.failed(sent)
                requests.failed(request)
                continue
            except NoRespondersError:
                phase = self._outcome_phase(phase)
                phase.no_responders += 1
                phase.failed(sent)
                requests.failed(request)
                await asyncio.sleep(_NO_RESPONDER_PAUSE_S)
                continue
            except (NatsError, RuntimeError) as exc:
                # Reconnecting, closed, buffer full: the client's side of a fault. RuntimeError: nats-py
                # on uvloop may still write to the transport of a server just killed (seen in the ha soak:
                # "unable to perform operation on <TCPTransport closed=True>"); the next request reconnects.
                phase = self._outcome_phase(phase)
                phase.transport[type(exc).__name__] += 1
                phase.failed(sent)
                requests.failed(request)
                await asyncio.sleep(_NO_RESPONDER_PAUSE_S)
                continue
            phase = self._outcome_phase(phase)
            phase.latencies_ns.append(clock() - started)
            checked = check_reply(
                msg.data, msg.headers, tag=request.tag, count=request.count, fmt=request.format
            )
            self._count(phase, request, checked)
            if checked.outcome != "ids":
                phase.failed(sent)
            if checked.outcome == "error" and not checked.reason and checked.retryable:
                requests.failed(request)

    async def _kafka_requester(self, client: KafkaIdClient, rng: random.Random, name: str) -> None:
        """Segment requests over Kafka request/reply, checked into the same ledger as the NATS ones."""

        def draw(serial: int) -> _Request:
            drawn = self._draw(rng, name, serial)  # its kind and tag are redrawn: Kafka asks for segments
            return _Request(
                "segment", rng.choice(self.profile.segment_tags), drawn.count, drawn.format, drawn.request_id
            )

        requests = _Requests(draw)
        while not self._stopping:
            phase = self.phase
            if phase is None:
                await asyncio.sleep(0.01)
                continue
            request = requests.next()
            phase.requests += 1
            phase.kafka_requests += 1
            sent = time.monotonic()
            started = time.perf_counter_ns()
            try:
                reply = await client.request(
                    request.tag, request.count, format=request.format, request_id=request.request_id
                )
            except TimeoutError:
                phase = self._outcome_phase(phase)
                phase.timeouts += 1
                phase.failed(sent)
                requests.failed(request)
                continue
            except OSError as exc:  # the request could not be sent (a broker is away)
                phase = self._outcome_phase(phase)
                phase.transport[f"kafka {type(exc).__name__}"] += 1
                phase.failed(sent)
                requests.failed(request)
                await asyncio.sleep(_NO_RESPONDER_PAUSE_S)
                continue
            phase = self._outcome_phase(phase)
            phase.latencies_ns.append(time.perf_counter_ns() - started)
            checked = check_reply(
                _reply_json.encode(reply),
                None,
                tag=request.tag,
                count=request.count,
                fmt=request.format,
                nats=False,
            )
            self._count(phase, request, checked)
            if checked.outcome != "ids":
                phase.failed(sent)
            if checked.outcome == "error" and not checked.reason and checked.retryable:
                requests.failed(request)

    def _count(self, phase: PhaseStats, request: _Request, checked: Checked) -> None:
        """Count a checked reply into ``phase`` (and its IDs into the ledger)."""
        if checked.outcome == "ids":
            phase.good += 1
            phase.ids[request.kind] += request.count
            self._namespace(request).add(checked.runs)
        elif checked.outcome == "error":
            phase.errors[checked.code or "<no code>"] += 1
            if checked.reason or not checked.retryable:
                phase.bad_errors += 1
                what = f"error reply {checked.code!r} retryable={checked.retryable}"
                self._problem(phase, request, f"{what} {checked.reason}".strip())
        else:
            phase.malformed += 1
            self._problem(phase, request, f"malformed reply: {checked.reason}")

    def _outcome_phase(self, sent_in: PhaseStats) -> PhaseStats:
        """The phase a request's outcome counts towards.

        The phase it was sent in, unless a fault was injected while it was in flight: then the fault's
        phase, so that a request cut off by a SIGKILL shows up where the SIGKILL is (and a clean phase
        is not blamed for the tail of the fault before it).
        """
        current = self.phase
        if current is None or current is sent_in or current.phase.fault is None:
            return sent_in
        return current

    def _problem(self, phase: PhaseStats, request: _Request, what: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(Problem(phase.phase.name, request.kind, request.tag, what))
