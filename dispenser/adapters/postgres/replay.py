"""The fleet's answers to requests with a ``request_id``, in PostgreSQL (``dispenser_request``).

One ``INSERT … ON CONFLICT DO UPDATE … RETURNING`` decides the race and hands the loser the winner's
answer; the answers of requests arriving while a statement is in flight are group-committed by the next.
Why PostgreSQL and not a JetStream bucket: ``docs/protocol.md`` ("request_id across the fleet").
"""

from __future__ import annotations

import asyncio
from typing import Final

from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.errors import StoreRefusedValue, StoreUnavailable
from dispenser.ports import Settled

__all__ = ["PostgresReplayStore"]

# DO UPDATE (not DO NOTHING): it waits for a concurrent insert of the same key to commit and then returns
# *that* row, so the loser of a race learns the winner's answer in this round trip (DO NOTHING returns no
# row, and a follow-up SELECT in the same statement could not see the winner's uncommitted insert). Each
# column keeps its value unless the held answer has expired, in which case the new one replaces it.
#
# Many answers at once (group commit). Ordered by key, so that two workers' batches lock the rows they share
# in the same order (no deadlock between them). Ranges travel as array literals ('{1,100,201,300}'): unnest
# cannot take an array of arrays of different lengths.
#
# Only the rows whose held answer is not the one sent come back (a race lost, a key used before): nearly
# every row is ours, and decoding it back into a Settled cost the worker about 1 µs a row for nothing (measured:
# the store alone, 64 answers at a time, client CPU 9.3-10.1 -> 8.3-8.9 µs an answer at best).
_SETTLE_MANY: Final = """
WITH sent AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::text[], $7::float8[])
        AS r(kind, tag, request_id, count, format, ranges, ttl)
), held AS (
    INSERT INTO dispenser_request AS held (kind, biz_tag, request_id, count, format, ranges, expires_at)
    SELECT s.kind, s.tag, s.request_id, s.count, s.format, s.ranges::bigint[], now() + make_interval(secs => s.ttl)
      FROM sent s
     ORDER BY s.kind, s.tag, s.request_id
    ON CONFLICT (kind, biz_tag, request_id) DO UPDATE SET
        count      = CASE WHEN held.expires_at <= now() THEN EXCLUDED.count      ELSE held.count      END,
        format     = CASE WHEN held.expires_at <= now() THEN EXCLUDED.format     ELSE held.format     END,
        ranges     = CASE WHEN held.expires_at <= now() THEN EXCLUDED.ranges     ELSE held.ranges     END,
        expires_at = CASE WHEN held.expires_at <= now() THEN EXCLUDED.expires_at ELSE held.expires_at END
    RETURNING held.kind, held.biz_tag, held.request_id, held.count, held.format, held.ranges
)
SELECT held.* FROM held JOIN sent s ON (held.kind, held.biz_tag, held.request_id) = (s.kind, s.tag, s.request_id)
 WHERE (held.count, held.format, held.ranges) IS DISTINCT FROM (s.count, s.format, s.ranges::bigint[])
"""

MAX_BATCH: Final = 512
"""Most answers recorded by one statement (the rest wait for the next)."""

WRITERS: Final = 2
"""Statements in flight at once: while one waits for its commit, the next batch is already being written
(PostgreSQL flushes concurrent commits together), and the pool keeps connections for segment fetches."""

_Key = tuple[str, str, str]
_Row = tuple[
    int, str, str, float, tuple[tuple[int, int], ...]
]  # count, format, the ranges' literal, ttl, ranges
_Batch = dict[_Key, tuple[_Row, list[asyncio.Future[Settled]]]]

_SWEEP: Final = """
WITH gone AS (DELETE FROM dispenser_request WHERE expires_at <= now() RETURNING 1)
SELECT count(*) AS n FROM gone
"""


def _fail(batch: _Batch, failure: BaseException) -> None:
    """Fail every request of ``batch`` still waiting with ``failure``."""
    for _, futures in batch.values():
        for future in futures:
            if not future.done():
                future.set_exception(failure)


class PostgresReplayStore:
    """:class:`~dispenser.ports.ReplayStore` over a segment store's pool (same errors, same timeouts).

    Times are PostgreSQL's (``now()``), so the workers' clocks do not need to agree for an answer to
    expire when it should.
    """

    def __init__(self, store: PostgresSegmentStore) -> None:
        """Share ``store``'s pool (the caller closes the store)."""
        self._store = store
        self._queue: _Batch = {}
        self._writers: set[asyncio.Task[None]] = set()

    def settle(
        self,
        key: tuple[str, str, str],
        count: int,
        format: str,
        ranges: tuple[tuple[int, int], ...],
        ttl: float,
    ) -> asyncio.Future[Settled]:
        """Record the answer unless a live one exists; the recorded one, when committed (group-committed).

        Returns a future rather than being a coroutine: no task per request. Cancelling it (the request's
        deadline) leaves the record to be written all the same.

        Raises (through the future):
            StoreUnavailable: PostgreSQL could not be reached or did not answer in time.
            StoreRefusedValue: PostgreSQL refused a value of this request (a data error, such as a NUL in
                the request_id); the other answers written with it are recorded all the same.
        """
        if len(ranges) == 1:  # most answers: one range
            first, last = ranges[0]
            literal = f"{{{first},{last}}}"
        else:
            literal = "{" + ",".join(f"{first},{last}" for first, last in ranges) + "}"
        future: asyncio.Future[Settled] = asyncio.get_running_loop().create_future()
        queued = self._queue.get(key)
        if queued is not None:
            queued[1].append(future)  # copies of one request (one worker's cache makes them rare): one row
        else:
            self._queue[key] = ((count, format, literal, ttl, ranges), [future])
        if len(self._writers) < WRITERS:
            self._writers.add(asyncio.create_task(self._write(), name="replay-store-write"))
        return future

    async def _write(self) -> None:
        """Record what is queued, a batch per statement, until nothing is."""
        try:
            await self._write_queued()
        finally:
            # At once, not in a done callback: a settle() in between would count this writer as busy and
            # leave its answer queued with no writer.
            task = asyncio.current_task()
            assert task is not None
            self._writers.discard(task)

    async def _write_queued(self) -> None:
        while self._queue:
            keys = list(self._queue)[:MAX_BATCH]
            await self._write_batch({key: self._queue.pop(key) for key in keys})

    async def _write_batch(self, batch: _Batch) -> None:
        """Record ``batch`` in one statement and answer its requests; a row PostgreSQL refuses fails alone.

        A data error (:class:`StoreRefusedValue`: a NUL in text, a value too long) fails the whole
        statement, and one request's value must not cost the others their record: the batch is written
        again in halves, down to the row refused (about ``2·log2(n)`` statements for one bad row of ``n``).
        """
        keys = sorted(batch)
        try:
            rows = await self._store.fetch(
                f"recording the answers to {len(batch)} request_id(s)",
                _SETTLE_MANY,
                [k[0] for k in keys],
                [k[1] for k in keys],
                [k[2] for k in keys],
                [batch[k][0][0] for k in keys],
                [batch[k][0][1] for k in keys],
                [batch[k][0][2] for k in keys],
                [batch[k][0][3] for k in keys],
            )
        except StoreRefusedValue as exc:
            await self._write_apart(batch, keys, exc)
            return
        except BaseException as exc:
            failure = exc if isinstance(exc, Exception) else StoreUnavailable("the worker is stopping")
            _fail(batch, failure)
            if failure is not exc:
                raise
            return
        held = {
            (r["kind"], r["biz_tag"], r["request_id"]): Settled(
                r["count"], r["format"], tuple(zip(r["ranges"][::2], r["ranges"][1::2], strict=True))
            )
            for r in rows
        }
        for key, (row, futures) in batch.items():
            settled = held.get(key)
            if settled is None:  # not returned: the held answer is the one sent
                settled = Settled(row[0], row[1], row[4])
            for future in futures:
                if not future.done():  # else its request gave up (deadline); the record stands
                    future.set_result(settled)

    async def _write_apart(self, batch: _Batch, keys: list[_Key], refused: StoreRefusedValue) -> None:
        """After PostgreSQL refused a value of ``batch``: its halves again, or the one row's requests fail."""
        if len(keys) == 1:
            _fail(
                batch,
                StoreRefusedValue(
                    f"recording the answer to request_id {keys[0][2]!r}", refused.sqlstate, refused.reason
                ),
            )
            return
        half = len(keys) // 2
        try:
            for part in (keys[:half], keys[half:]):
                await self._write_batch({key: batch[key] for key in part})
        except BaseException as exc:  # cancelled (the worker is stopping): no request is left waiting
            _fail(batch, exc if isinstance(exc, Exception) else StoreUnavailable("the worker is stopping"))
            raise

    async def sweep(self) -> int:
        """Delete expired answers (one round trip, served by the ``expires_at`` index).

        Raises:
            StoreUnavailable: PostgreSQL could not be reached.
        """
        row = await self._store.fetchrow("sweeping expired request answers", _SWEEP)
        return 0 if row is None else int(row["n"])
