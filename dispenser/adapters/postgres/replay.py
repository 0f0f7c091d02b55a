"""The fleet's answers to requests with a ``request_id``, in PostgreSQL (``dispenser_request``).

Why PostgreSQL rather than a JetStream key-value bucket: every segment worker already holds a pool to it
(no new server, no JetStream to enable and size), Kafka-only workers have no NATS at all, and one
``INSERT … ON CONFLICT DO UPDATE … RETURNING`` is an atomic first-writer-wins that also hands the loser
the winner's answer in the same round trip — a KV ``create`` would need a second read, and a retry of the
read when the winner's write is not visible yet. Only requests that carry a ``request_id`` pay the round
trip; the common path never touches this table.
"""

from __future__ import annotations

from typing import Final

from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.ports import Settled

__all__ = ["PostgresReplayStore"]

# DO UPDATE (not DO NOTHING): it waits for a concurrent insert of the same key to commit and then returns
# *that* row, so the loser of a race learns the winner's answer in this round trip (DO NOTHING returns no
# row, and a follow-up SELECT in the same statement could not see the winner's uncommitted insert). Each
# column keeps its value unless the held answer has expired, in which case the new one replaces it.
_SETTLE: Final = """
INSERT INTO dispenser_request AS held (kind, biz_tag, request_id, count, format, ranges, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7))
ON CONFLICT (kind, biz_tag, request_id) DO UPDATE SET
    count      = CASE WHEN held.expires_at <= now() THEN EXCLUDED.count      ELSE held.count      END,
    format     = CASE WHEN held.expires_at <= now() THEN EXCLUDED.format     ELSE held.format     END,
    ranges     = CASE WHEN held.expires_at <= now() THEN EXCLUDED.ranges     ELSE held.ranges     END,
    expires_at = CASE WHEN held.expires_at <= now() THEN EXCLUDED.expires_at ELSE held.expires_at END
RETURNING count, format, ranges
"""

_SWEEP: Final = """
WITH gone AS (DELETE FROM dispenser_request WHERE expires_at <= now() RETURNING 1)
SELECT count(*) AS n FROM gone
"""


class PostgresReplayStore:
    """:class:`~dispenser.ports.ReplayStore` over a segment store's pool (same errors, same timeouts).

    Times are PostgreSQL's (``now()``), so the workers' clocks do not need to agree for an answer to
    expire when it should.
    """

    def __init__(self, store: PostgresSegmentStore) -> None:
        """Share ``store``'s pool (the caller closes the store)."""
        self._store = store

    async def settle(
        self,
        key: tuple[str, str, str],
        count: int,
        format: str,
        ranges: tuple[tuple[int, int], ...],
        ttl: float,
    ) -> Settled:
        """Record the answer unless a live one exists; return the recorded one (one round trip).

        Raises:
            StoreUnavailable: PostgreSQL could not be reached or did not answer in time.
        """
        kind, tag, request_id = key
        flat = [bound for pair in ranges for bound in pair]
        row = await self._store.fetchrow(
            f"recording the answer to request_id {request_id!r} of tag {tag!r}",
            _SETTLE,
            kind,
            tag,
            request_id,
            count,
            format,
            flat,
            ttl,
        )
        assert row is not None  # an upsert always returns its row
        held = row["ranges"]
        return Settled(row["count"], row["format"], tuple(zip(held[::2], held[1::2], strict=True)))

    async def sweep(self) -> int:
        """Delete expired answers (one round trip, served by the ``expires_at`` index).

        Raises:
            StoreUnavailable: PostgreSQL could not be reached.
        """
        row = await self._store.fetchrow("sweeping expired request answers", _SWEEP)
        return 0 if row is None else int(row["n"])
