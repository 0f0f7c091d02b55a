"""Load from real requesters over NATS while a cluster member is killed, and what it saw.

Each requester is a nats-py connection of its own asking one request at a time, in turn on each subject,
with a short timeout; a request that times out or finds no responders is asked again (as a client
would). Every reply is decoded; the IDs go into one list for the duplicate check, error replies are
counted by code and those not marked retryable kept apart, and each requester's successes are
timestamped so the stall around a kill can be measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import nats
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from dispenser.core.snowflake import SnowflakeLayout
from dispenser.messages import Reply

_reply = msgspec.json.Decoder(Reply)
_LAYOUT = SnowflakeLayout()


@dataclass
class Success:
    """One answered request: when it was answered and sent (monotonic seconds), on which subject, the IDs."""

    at: float
    subject: str
    ids: list[int]
    sent: float


@dataclass
class LoadResult:
    """What the requesters saw."""

    successes: list[list[Success]] = field(default_factory=list)
    """Per requester, in order."""
    timeouts: list[float] = field(default_factory=list)
    """When requests timed out (lost in flight, or nobody reachable)."""
    no_responders: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    """Error replies by code."""
    errors_at: list[tuple[float, str]] = field(default_factory=list)
    """When each error reply came (monotonic seconds) and its code."""
    not_retryable: list[str] = field(default_factory=list)
    malformed: list[bytes] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        """Every ID handed out, in no particular order."""
        return [i for per in self.successes for s in per for i in s.ids]

    def duplicates(self) -> int:
        """How many IDs were handed out more than once (the one number that must be 0)."""
        ids = self.ids
        return len(ids) - len(set(ids))

    def answered(self) -> int:
        """How many requests were answered with IDs."""
        return sum(len(per) for per in self.successes)

    def stall(self, at: float) -> float:
        """The longest wait any requester had, around ``at``, between two answered requests."""
        longest = 0.0
        for per in self.successes:
            before = [s.at for s in per if s.at <= at]
            after = [s.at for s in per if s.at > at]
            if before and after:
                longest = max(longest, after[0] - before[-1])
            elif before:
                longest = max(longest, time.monotonic() - before[-1])
        return longest

    def first_from_worker(self, worker_id: int, after: float) -> float | None:
        """When the first snowflake ID of ``worker_id`` asked for after ``after`` (monotonic) came, if ever.

        Asked for after: a reply received after ``after`` may have been sent before it.
        """
        times = [
            s.at
            for per in self.successes
            for s in per
            if s.sent > after and ".snowflake." in s.subject and s.ids
            if _LAYOUT.decompose(s.ids[0]).worker_id == worker_id
        ]
        return min(times, default=None)


def ids_of(reply: Reply) -> list[int]:
    """The IDs of a successful reply, whichever format it used."""
    if reply.ranges is not None:
        return [i for first, last in reply.ranges for i in range(first, last + 1)]
    return list(reply.ids or [])


async def _requester(
    nc: Client,
    subjects: Sequence[str],
    *,
    count: int,
    timeout: float,
    result: LoadResult,
    stop: asyncio.Event,
) -> None:
    mine: list[Success] = []
    result.successes.append(mine)
    body = msgspec.json.encode({"count": count})
    turn = 0
    while not stop.is_set():
        subject = subjects[turn % len(subjects)]
        turn += 1
        sent = time.monotonic()
        try:
            msg = await nc.request(subject, body, timeout=timeout)
        except NoRespondersError:
            result.no_responders += 1
            await asyncio.sleep(0.01)
            continue
        except (NatsTimeoutError, TimeoutError):
            result.timeouts.append(time.monotonic())
            continue
        except nats.errors.Error:  # connection closed or reconnecting: ask again shortly
            await asyncio.sleep(0.01)
            continue
        try:
            reply = _reply.decode(msg.data)
        except msgspec.DecodeError:
            result.malformed.append(msg.data)
            continue
        if reply.error is not None:
            result.errors[reply.error.code] += 1
            result.errors_at.append((time.monotonic(), reply.error.code))
            if not reply.error.retryable:
                result.not_retryable.append(f"{reply.error.code}: {reply.error.message}")
            await asyncio.sleep(0.01)
            continue
        ids = ids_of(reply)
        if len(ids) != count:
            result.malformed.append(msg.data)
            continue
        mine.append(Success(time.monotonic(), subject, ids, sent))


@contextlib.asynccontextmanager
async def load(
    servers: Sequence[Sequence[str]],
    subjects: Sequence[str],
    *,
    count: int = 10,
    timeout: float = 1.0,
    one_subject_each: bool = False,
) -> AsyncIterator[LoadResult]:
    """Run one requester per entry of ``servers`` (its URL list, tried in that order) until the block ends.

    Args:
        servers: Each requester's servers; the first is the one it connects to, the rest are where it
            reconnects when that one dies.
        subjects: Asked in turn by every requester.
        count: IDs per request.
        timeout: Seconds a request waits for its reply before it is asked again.
        one_subject_each: Requester ``n`` asks only ``subjects[n % len(subjects)]``, so that a request
            that waits out its timeout on one subject holds up no other subject's answers (asked in
            turn, one slow worker shows as a gap on every subject).
    """
    result = LoadResult()
    stop = asyncio.Event()
    clients = [
        await nats.connect(
            servers=list(urls),
            dont_randomize=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            name=f"ha-requester-{n}",
        )
        for n, urls in enumerate(servers)
    ]
    tasks = [
        asyncio.create_task(
            _requester(
                nc,
                [subjects[n % len(subjects)]] if one_subject_each else subjects,
                count=count,
                timeout=timeout,
                result=result,
                stop=stop,
            ),
            name=f"requester-{n}",
        )
        for n, nc in enumerate(clients)
    ]
    try:
        yield result
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        for nc in clients:
            await nc.close()


async def until(predicate: Callable[[], object], timeout: float, what: str, step: float = 0.05) -> float:
    """Wait until ``predicate()`` is true; return the seconds it took.

    Raises:
        AssertionError: still false after ``timeout`` seconds (the message says what was awaited).
    """
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(step)
    return time.monotonic() - started
