"""An ordered tag's requests over NATS: answered one at a time by its owner, forwarded by every other worker.

A worker that does not own the tag republishes the request, body, headers and reply subject as they came,
to the owner's subject (``<prefix>.ordered.<tag>``, subscribed by the lease holder only), so that the owner
answers the caller directly: one publisher, one answer loop, so the order of the answers is the order of the
IDs (docs/ordered.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from dispenser.adapters.nats.micro import ERROR_HEADER, is_msgpack, reply_headers
from dispenser.core.errors import DispenserError, Unavailable
from dispenser.messages import IdRequest, Reply, id_subject
from dispenser.service.answering import Answer, Answerer

__all__ = ["OrderedRoute", "forward_over_nats", "owner_subject"]

log = logging.getLogger(__name__)


def owner_subject(prefix: str, tag: str) -> str:
    """The subject only ``tag``'s owner subscribes: ``<prefix>.ordered.<tag>``."""
    return f"{prefix}.ordered.{tag}"


class OrderedRoute:
    """Where one ordered tag's requests go on this worker: its answer loop (the owner), or the owner's subject."""

    def __init__(
        self,
        nc: Client,
        tag: str,
        subject: str,
        *,
        errors: Answerer,
        serving: Callable[[], bool],
        elsewhere: Callable[[], bool],
        refusal: Callable[[], DispenserError],
    ) -> None:
        """Route ``tag``'s requests.

        Args:
            nc: the worker's connection.
            tag: the ordered tag.
            subject: the owner's subject (:func:`owner_subject`).
            errors: formats error answers (the worker's segment dispatcher).
            serving: whether this worker may answer now (its term unexpired, by its own clock).
            elsewhere: whether another worker holds the lease, as last seen (requests are forwarded to it).
            refusal: the error a request gets when no worker can answer it here.
        """
        self._nc, self.tag, self.subject = nc, tag, subject
        self._errors = errors
        self._serving, self._elsewhere, self._refusal = serving, elsewhere, refusal
        self._answerer: Answerer | None = None
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._loop: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None
        self.forwarded = 0
        self.answered = 0

    async def route(self, msg: Msg) -> None:
        """A request for the tag, from the worker's queue-group endpoint."""
        if self._answerer is not None:
            self._queue.put_nowait(msg)
        elif msg.reply and self._elsewhere():
            self.forwarded += 1
            await self._nc.publish(self.subject, msg.data, reply=msg.reply, headers=msg.headers)
        else:
            await self._publish(msg, self._errors.error(self.tag, self._refusal(), is_msgpack(msg)))

    async def begin(self, answerer: Answerer) -> None:
        """This worker owns the tag from now: answer from ``answerer`` (a fresh term's), one request at a time."""
        self._answerer = answerer
        if self._loop is None or self._loop.done():
            self._loop = asyncio.create_task(self._answer_loop(), name=f"ordered-{self.tag}")
        if self._sub is None:
            self._sub = await self._nc.subscribe(self.subject, cb=self._from_elsewhere)

    async def end(self) -> None:
        """The term is over: take no more requests on the owner's subject, refuse those still queued."""
        self._answerer = None
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # a closed connection has no subscription left
                await sub.unsubscribe()

    async def stop(self) -> None:
        """Take no more requests, answer those already here (while the term lasts), then flush.

        Nothing of this worker's is sent for the tag after this returns: the lease can then be given up.
        """
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # those delivered to it are handed to the queue first
                await sub.drain()  # type: ignore[no-untyped-call]  # nats-py leaves it untyped
        loop = self._loop
        if loop is not None and not loop.done():
            await self._queue.join()
        self._answerer = None
        if loop is not None:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        with contextlib.suppress(Exception):
            await self._nc.flush(timeout=2)

    async def _from_elsewhere(self, msg: Msg) -> None:
        """A request another worker forwarded (or a caller sent to the owner's subject)."""
        self._queue.put_nowait(msg)

    async def _answer_loop(self) -> None:
        """Answer in arrival order; each reply is sent before the next request takes its IDs."""
        while True:
            msg = await self._queue.get()
            try:
                await self._answer_one(msg)
            except Exception:  # never expected: every failure is already an error answer
                log.exception("ordered tag %r: answering a request failed", self.tag)
            finally:
                self._queue.task_done()

    async def _answer_one(self, msg: Msg) -> None:
        answerer = self._answerer
        msgpack = is_msgpack(msg)
        if answerer is None or not self._serving():
            await self._publish(msg, self._errors.error(self.tag, self._refusal(), msgpack))
            return
        try:
            request = answerer.decode(self.tag, msg.data, msgpack)
        except DispenserError as exc:
            await self._publish(msg, answerer.error(self.tag, exc, msgpack))
            return
        answer = answerer.answer_now(self.tag, request, msgpack) or await answerer.answer(
            self.tag, request, msgpack
        )
        if answer.error is None and not (self._answerer is answerer and self._serving()):
            # The term ran out while this request waited: its IDs are a gap, never answered.
            answer = self._errors.error(self.tag, self._refusal(), msgpack)
        else:
            self.answered += 1
        await self._publish(msg, answer)

    async def _publish(self, msg: Msg, answer: Answer) -> None:
        if not msg.reply:
            return
        await self._nc.publish(msg.reply, answer.body, headers=reply_headers(answer.error, is_msgpack(msg)))


_REPLY = msgspec.json.Decoder(Reply)


def forward_over_nats(
    nc: Client, prefix: str
) -> Callable[[str, int, float], Awaitable[list[tuple[int, int]]]]:
    """Ask the fleet's owner of an ordered tag for ``count`` IDs over NATS (for HTTP and Kafka requests).

    The returned function sends ``{"count": n, "format": "ranges"}`` on the tag's public subject, where the
    queue group routes it to the owner like any NATS caller's, and waits up to ``timeout`` seconds.

    Raises (from the returned function):
        Unavailable: no answer in time, nobody listening, or the owner's error reply (its message kept).
    """

    async def forward(tag: str, count: int, timeout: float) -> list[tuple[int, int]]:
        body = msgspec.json.encode(IdRequest(count=count, format="ranges"))
        try:
            msg = await nc.request(id_subject(prefix, "segment", tag), body, timeout=max(timeout, 0.001))
        except (NatsError, TimeoutError) as exc:
            raise Unavailable(
                f"ordered tag {tag!r}: its owner did not answer over NATS ({type(exc).__name__})"
            ) from None
        if msg.headers and ERROR_HEADER in msg.headers:
            raise Unavailable(msg.headers[ERROR_HEADER])
        reply = _REPLY.decode(msg.data)
        if reply.ranges is not None:
            return reply.ranges
        return [(i, i) for i in reply.ids or []]

    return forward
