"""A permuted tag in the buffered client: its IDs kept as a list, refilled by several requests at once.

A permuted tag's IDs come one per range, in no order (``docs/permuted.md``), so the client cannot hold only
ranges above the IDs it has, as it does for a plain tag. It numbers them instead, in the order they arrive,
from :data:`FIRST_POSITION` (above every ID, so a tag switched from plain to permuted keeps the plain ranges
it holds below them): the refill engine holds these positions, which only increase (its order guard never
skips one), and the cursor hands out the IDs at them. How it is refilled, and why no order guard is needed:
``docs/client.md``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from dispenser.client.errors import IdRequestError
from dispenser.core.ids import Range
from dispenser.core.refill import Fetch
from dispenser.messages import IdRequest, Reply
from dispenser.service.refiller import Refused

__all__ = [
    "FIRST_POSITION",
    "PERMUTED_REQUEST_MAX",
    "REQUESTS_IN_FLIGHT",
    "Listed",
    "ListedRequests",
    "ids_of",
    "may_be_permuted",
]

FIRST_POSITION = 2**64
"""A permuted tag's first position: above every 64-bit ID, so positions and plain IDs never meet."""

PERMUTED_REQUEST_MAX = 10_000
"""The most IDs one request of a permuted tag gets: the workers' ``MAX_PERMUTED_IDS``
(``dispenser/service/dispatch.py``, pinned equal by a test). A tag's first request asks for no more, since
the client learns from the first reply whether the tag is permuted."""

REQUESTS_IN_FLIGHT = 8
"""The most requests one refill of a permuted tag sends at once (a refill asks for up to this many times
:data:`PERMUTED_REQUEST_MAX`): the workers encipher each ID, so the requests of a refill are answered side by
side, by several workers, instead of one after the other."""


class Listed:
    """A permuted tag's IDs by position: the refill engine holds positions, this list the IDs at them.

    Positions are handed out in increasing order (the engine's segments, the cursor's runs), so the IDs
    below the first position asked for are forgotten as it moves on: dropped from the list once they are
    half of it (amortised, rather than shifting the whole list at every cursor run).
    """

    __slots__ = ("_base", "_ids", "_low")

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._base = FIRST_POSITION
        """The position of ``_ids[0]``."""
        self._low = FIRST_POSITION
        """The lowest position not forgotten."""

    def add(self, *parts: Sequence[int]) -> Range:
        """Keep the IDs of ``parts`` (at least one) at the next positions; return them, for the engine."""
        first = self._base + len(self._ids)
        for ids in parts:
            self._ids.extend(ids)
        return (first, self._base + len(self._ids) - 1)

    def ids(self, first: int, last: int) -> list[int]:
        """The IDs at positions ``first`` to ``last``; those below ``first`` are forgotten (handed out)."""
        assert first >= self._low, (first, self._low)  # positions are never asked for twice
        self._low = first
        drop = first - self._base
        if drop > len(self._ids) // 2:
            del self._ids[:drop]
            self._base = first
            drop = 0
        return self._ids[drop : drop + last - first + 1]


def may_be_permuted(refused: Refused, request: IdRequest) -> bool:
    """Whether a refusal may say the tag became permuted: ``count_too_large`` for more than such a tag gets."""
    error = refused.error
    return (
        isinstance(error, IdRequestError)
        and error.code == "count_too_large"
        and request.count > PERMUTED_REQUEST_MAX
    )


def ids_of(reply: Reply) -> list[int]:
    """The IDs of a reply: its list, or its ranges (the first reply, asked before the tag was known permuted).

    A permuted tag's refills ask for a list: half the bytes of ``[id, id]`` ranges. A plain reply's IDs too: a
    tag whose permuted mark was taken off, or a worker that has not seen the mark yet (``docs/permuted.md``),
    answers plain IDs, which a tag served as a list keeps in the list, as unique as the permuted ones (a
    request asks at most :data:`PERMUTED_REQUEST_MAX`).
    """
    if reply.ids is not None:
        return reply.ids
    return [i for first, last in reply.ranges or () for i in range(first, last + 1)]


class ListedRequests:
    """A permuted tag's refills as requests of at most :data:`PERMUTED_REQUEST_MAX` IDs each, sent at once.

    Each asks for a list (``format="ids"``), without a ``request_id``: the fleet records the answer to a
    ``request_id`` in its replay store, and a permuted tag's answer is up to 10,000 separate IDs, which cost
    the workers about three times the IDs' own work (a client drew ~0.5 million permuted IDs a second with a
    ``request_id``, 1-2 million without, one worker, ``docs/benchmarks.md``). What a lost reply then costs
    is a gap of its counters, never a repeat: the client installs only replies it received, and the counters
    run to ``10**18``. A retry (:attr:`Fetch.repeat`) sends again only the requests not answered yet, and
    keeps the answers it has.

    Args:
        tag: the tag.
        per_request: the most IDs one request asks for.
    """

    def __init__(self, tag: str, per_request: int) -> None:
        self.tag = tag
        self.per_request = per_request
        self._requests: list[IdRequest] = []
        self._answered: dict[int, list[int]] = {}

    async def fetch(self, fetch: Fetch, send: Callable[[IdRequest], Awaitable[Reply]]) -> list[list[int]]:
        """The IDs of one refill of ``fetch.size`` IDs, a list per request, its requests sent through ``send`` at once.

        Raises:
            Refused: a request was refused (what the others answered is a gap).
            Exception: what ``send`` raised for a request (the first one's); retried with ``repeat``.
        """
        if not fetch.repeat or not self._requests:
            size = fetch.size or self.per_request
            counts = [self.per_request] * (size // self.per_request)
            if size % self.per_request:
                counts.append(size % self.per_request)
            self._requests = [IdRequest(count=n, format="ids") for n in counts]
            self._answered = {}
        waiting = [n for n in range(len(self._requests)) if n not in self._answered]
        replies = await asyncio.gather(*(send(self._requests[n]) for n in waiting), return_exceptions=True)
        failure: BaseException | None = None
        for n, reply in zip(waiting, replies, strict=True):
            if isinstance(reply, BaseException):
                if failure is None or isinstance(reply, Refused):
                    failure = reply
            else:
                self._answered[n] = ids_of(reply)
        if failure is not None:
            raise failure
        return [self._answered[n] for n in range(len(self._requests))]
