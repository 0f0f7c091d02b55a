"""The segment store over PostgreSQL (asyncpg): Leaf's ``leaf_alloc`` table, one round trip per segment.

asyncpg's exceptions (and ``OSError``, which covers timeouts) become :class:`StoreUnavailable` in one place,
:func:`map_store_errors`; the DSN's password never appears in a message, a ``repr`` or a log line.
The schema itself is created by :func:`dispenser.adapters.postgres.schema.migrate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import asyncpg

from dispenser.core.errors import DispenserError, StoreUnavailable, TagExists, UnknownTag
from dispenser.core.segment import Segment
from dispenser.core.store_rules import check_new_tag, check_step, no_room
from dispenser.ports import Allocation, TagInfo
from dispenser.redaction import redact

__all__ = ["PostgresSegmentStore", "dsn_secrets", "invalid_settings", "map_store_errors", "scrub"]

# One statement, so one round trip once asyncpg has prepared it on the connection (its statement cache
# keeps it per connection). COALESCE lets the caller ask for a step other than the configured one (the
# adaptive step) without a second query; the step used comes back so the segment bounds are exact.
_NEXT_SEGMENT = """
UPDATE leaf_alloc
   SET max_id = max_id + COALESCE($2::int, step), update_time = now()
 WHERE biz_tag = $1
RETURNING max_id, step, COALESCE($2::int, step) AS step_used
"""

# update_time::timestamptz: a table carried over from Leaf may use ``timestamp`` (no zone); the cast is a
# no-op on our own column and makes every TagInfo carry an aware datetime.
_COLUMNS = "biz_tag, max_id, step, COALESCE(description, '') AS description, update_time::timestamptz"

# COLLATE "C": code point order, the same as Python's sorted(), whatever the database's locale.
_SAVE_PEAKS = """
INSERT INTO dispenser_rate_peak (biz_tag, kind, peak, peak_at, update_time)
SELECT t, $2, p, to_timestamp(a), now() FROM unnest($1::text[], $3::float8[], $4::float8[]) AS x(t, p, a)
ON CONFLICT (biz_tag, kind) DO UPDATE SET peak = EXCLUDED.peak, peak_at = EXCLUDED.peak_at, update_time = now()
"""
_LOAD_PEAKS = (
    "SELECT biz_tag, peak, extract(epoch FROM peak_at)::float8 AS at FROM dispenser_rate_peak WHERE kind = $1"
)

_LIST_TAGS = f'SELECT {_COLUMNS} FROM leaf_alloc ORDER BY biz_tag COLLATE "C"'

_ADD_TAG = f"""
INSERT INTO leaf_alloc (biz_tag, max_id, step, description, update_time)
VALUES ($1, $2, $3, $4, now())
RETURNING {_COLUMNS}
"""

_SET_STEP = f"UPDATE leaf_alloc SET step = $2, update_time = now() WHERE biz_tag = $1 RETURNING {_COLUMNS}"

_REMOVE_TAG = "DELETE FROM leaf_alloc WHERE biz_tag = $1 RETURNING biz_tag"

_REDACTED = "***"


def dsn_secrets(dsn: str) -> tuple[str, ...]:
    """The strings that must never appear in a message: the DSN's passwords, raw and percent-decoded.

    The split follows asyncpg's own parser (first ``@`` of the netloc, first ``:`` of the userinfo), so
    whatever asyncpg would send as the password is what gets hidden; ``sslpassword`` (the client key's
    passphrase) counts too.
    """
    secrets: set[str] = set()
    with contextlib.suppress(ValueError):
        parts = urllib.parse.urlsplit(dsn)
        auth, at, _ = parts.netloc.partition("@")
        if at and ":" in auth:
            raw = auth.partition(":")[2]
            secrets.update((raw, urllib.parse.unquote(raw)))
        for key, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
            if key in ("password", "sslpassword"):
                secrets.add(value)
    # An empty or one-character "password" would blank out half the message and protects nothing.
    return tuple(sorted((s for s in secrets if len(s) > 1), key=len, reverse=True))


def scrub(text: str, secrets: Sequence[str]) -> str:
    """Return ``text`` with every one of ``secrets`` replaced by ``***``."""
    for secret in secrets:
        text = text.replace(secret, _REDACTED)
    return text


def invalid_settings(exc: ValueError, where: str, secrets: Sequence[str]) -> ValueError:
    """The error for a malformed DSN or option: a ``ValueError`` (no retry can help) without the password.

    asyncpg raises plain ``ValueError`` for some settings, and its text may quote the DSN.
    """
    return ValueError(scrub(f"invalid connection settings ({where}): {exc}", secrets))


def _describe(exc: BaseException, timeout: float | None) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout} s" if timeout is not None else "timed out"
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if isinstance(exc, asyncpg.UndefinedTableError):
        detail += " (was the schema migrated? see dispenser.adapters.postgres.schema.migrate)"
    return detail


@contextlib.contextmanager
def map_store_errors(
    action: str,
    *,
    where: str,
    secrets: Sequence[str] = (),
    timeout: float | None = None,
    unavailable: Callable[[str], DispenserError] = StoreUnavailable,
) -> Iterator[None]:
    """Turn the driver's exceptions raised inside the block into :class:`StoreUnavailable` (or ``unavailable``).

    Converted: every asyncpg error (server-side ``PostgresError``, client-side ``InterfaceError``, and
    ``InternalClientError``) and ``OSError`` (refused or reset connections, DNS failures, and
    ``TimeoutError``). Our own errors and cancellation pass through untouched.

    Args:
        action: what was being done, for the message ("fetching the next segment of 'order'").
        where: the redacted DSN (see :func:`dispenser.redaction.redact`).
        secrets: strings to blank out of the driver's message (see :func:`dsn_secrets`).
        timeout: the timeout in force, to say how long we waited when one fires.
        unavailable: the error to raise, built from the message (the worker registry raises
            ``CoordinatorUnavailable``).
    """
    try:
        yield
    except (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError) as exc:
        raw = f"{action} ({where}): {_describe(exc, timeout)}"
        message = scrub(raw, secrets)
        if message == raw:
            raise unavailable(message) from exc
        # The driver's message carried the password: suppress the chain so that tracebacks and error
        # reporters (which honour __suppress_context__) never print the original.
        raise unavailable(message) from None


async def _keep_session(_conn: asyncpg.Connection[Any]) -> None:
    """Pool reset hook: nothing to undo, so skip asyncpg's default reset query.

    The default runs ``SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL`` on every
    release: a second round trip per segment. This store never changes session state (no SET, LISTEN,
    cursors or session-level advisory locks), and asyncpg still rolls back a transaction left open.
    """


class PostgresSegmentStore:
    """:class:`~dispenser.ports.SegmentStore` over an asyncpg pool.

    Build one with :meth:`connect`. The pool reconnects by itself: after PostgreSQL restarts, the next
    call that finds its connection closed opens a new one, so the same store object keeps working.
    """

    def __init__(
        self,
        pool: asyncpg.Pool[asyncpg.Record],
        *,
        where: str = "postgres",
        secrets: Sequence[str] = (),
        timeout: float | None = None,
    ) -> None:
        """Wrap an existing pool (prefer :meth:`connect`, which builds the pool as this store needs).

        Args:
            pool: the asyncpg pool; the store closes it in :meth:`close`.
            where: how to name the database in messages (a redacted DSN).
            secrets: strings never to repeat in a message.
            timeout: seconds to wait for a pooled connection (opening one if needed).
        """
        self._pool = pool
        self._where = where
        self._secrets = tuple(secrets)
        self._timeout = timeout
        self._closed = False

    @classmethod
    async def connect(
        cls,
        dsn: str,
        *,
        min_size: int = 1,
        max_size: int = 4,
        command_timeout: float = 5.0,
        connect_timeout: float = 5.0,
        application_name: str = "leaf-dispenser",
    ) -> PostgresSegmentStore:
        """Open a pool to ``dsn`` and return a store over it.

        Args:
            dsn: ``postgresql://user:password@host:port/database?sslmode=…`` (asyncpg's syntax; PG*
                environment variables fill in what it leaves out).
            min_size: connections opened now and kept open.
            max_size: most connections open at once (one segment fetch uses one, briefly).
            command_timeout: seconds a statement may take before it is cancelled.
            connect_timeout: seconds to open a connection (at start and when reconnecting).
            application_name: shown in ``pg_stat_activity``.

        Raises:
            StoreUnavailable: the first ``min_size`` connections could not be opened.
            ValueError: the DSN or an option is malformed (the message hides the password).
        """
        where = redact(dsn)
        secrets = dsn_secrets(dsn)
        with map_store_errors("connecting", where=where, secrets=secrets, timeout=connect_timeout):
            try:
                pool = await asyncpg.create_pool(
                    dsn,
                    min_size=min_size,
                    max_size=max_size,
                    command_timeout=command_timeout,
                    timeout=connect_timeout,
                    reset=_keep_session,
                    server_settings={"application_name": application_name},
                )
            except ValueError as exc:
                if isinstance(exc, OSError):
                    raise  # a TLS failure (e.g. certificate verify failed): unavailable, as at run time
                raise invalid_settings(exc, where, secrets) from None
        return cls(pool, where=where, secrets=secrets, timeout=connect_timeout + command_timeout)

    def __repr__(self) -> str:
        return f"PostgresSegmentStore({self._where})"

    def _errors(self, action: str) -> contextlib.AbstractContextManager[None]:
        return map_store_errors(action, where=self._where, secrets=self._secrets, timeout=self._timeout)

    async def next_segment(self, tag: str, step: int | None = None) -> Allocation:
        """Reserve the next segment of ``tag`` in one ``UPDATE … RETURNING`` round trip.

        Args:
            tag: the business tag (not validated: a tag carried over from Leaf may use other characters).
            step: the segment size; ``None`` uses the tag's configured step.

        Raises:
            UnknownTag: no such tag.
            StoreUnavailable: PostgreSQL could not be reached or did not answer in time.
            BadRequest: ``step`` is below 1 or above the ``step`` column's range.
        """
        if step is not None:
            check_step(step)
        with self._errors(f"fetching the next segment of {tag!r}"):
            try:
                async with self._pool.acquire(timeout=self._timeout) as conn:
                    row = await conn.fetchrow(_NEXT_SEGMENT, tag, step)
            except asyncpg.NumericValueOutOfRangeError:
                raise no_room(tag, step) from None
        if row is None:
            raise UnknownTag(tag)
        return Allocation(Segment.from_max_id(row["max_id"], row["step_used"]), row["step"])

    async def list_tags(self) -> list[TagInfo]:
        """All tags ordered by name (code point order).

        Raises:
            StoreUnavailable: PostgreSQL could not be reached.
        """
        with self._errors("listing tags"):
            async with self._pool.acquire(timeout=self._timeout) as conn:
                rows = await conn.fetch(_LIST_TAGS)
        return [_tag_info(row) for row in rows]

    async def add_tag(self, tag: str, step: int, start: int = 1, description: str = "") -> TagInfo:
        """Create a tag whose first segment starts at ``start`` (stored as Leaf's ``max_id``).

        Raises:
            TagExists: the tag is already there.
            InvalidTag: the name is not valid.
            BadRequest: ``step`` or ``start`` is below 1, or a value does not fit its column.
            StoreUnavailable: PostgreSQL could not be reached.
        """
        check_new_tag(tag, step, start, description)
        with self._errors(f"adding tag {tag!r}"):
            try:
                async with self._pool.acquire(timeout=self._timeout) as conn:
                    row = await conn.fetchrow(_ADD_TAG, tag, start, step, description)
            except asyncpg.UniqueViolationError:
                raise TagExists(tag) from None
        assert row is not None  # INSERT … RETURNING returns the row it inserted
        return _tag_info(row)

    async def set_step(self, tag: str, step: int) -> TagInfo:
        """Change a tag's configured step; the next segment fetched with ``step=None`` uses it.

        Raises:
            UnknownTag: no such tag.
            BadRequest: ``step`` is out of range.
            StoreUnavailable: PostgreSQL could not be reached.
        """
        check_step(step)
        with self._errors(f"setting the step of {tag!r}"):
            async with self._pool.acquire(timeout=self._timeout) as conn:
                row = await conn.fetchrow(_SET_STEP, tag, step)
        if row is None:
            raise UnknownTag(tag)
        return _tag_info(row)

    async def remove_tag(self, tag: str) -> None:
        """Delete a tag's row.

        Raises:
            UnknownTag: no such tag.
            StoreUnavailable: PostgreSQL could not be reached.
        """
        with self._errors(f"removing tag {tag!r}"):
            async with self._pool.acquire(timeout=self._timeout) as conn:
                removed = await conn.fetchval(_REMOVE_TAG, tag)
        if removed is None:
            raise UnknownTag(tag)

    async def fetchrow(self, action: str, query: str, *args: object) -> asyncpg.Record | None:
        """Run one statement of another adapter over this store's pool, with the same error mapping.

        Args:
            action: what is being done, for the error message ("recording the answer to …").
            query: the SQL, with ``$1``… placeholders.
            *args: the placeholders' values.

        Raises:
            StoreUnavailable: PostgreSQL could not be reached or did not answer in time.
        """
        with self._errors(action):
            async with self._pool.acquire(timeout=self._timeout) as conn:
                return await conn.fetchrow(query, *args)

    async def __aenter__(self) -> PostgresSegmentStore:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def save_peaks(self, kind: str, peaks: dict[str, tuple[float, float]]) -> None:
        """Save each tag's peak rate and when it was seen (one round trip; the last writer wins).

        Raises:
            StoreUnavailable: PostgreSQL could not be reached.
        """
        tags = list(peaks)
        with self._errors("saving the rate peaks"):
            async with self._pool.acquire(timeout=self._timeout) as conn:
                await conn.execute(
                    _SAVE_PEAKS, tags, kind, [peaks[t][0] for t in tags], [peaks[t][1] for t in tags]
                )

    async def load_peaks(self, kind: str) -> dict[str, tuple[float, float]]:
        """The saved ``tag → (peak IDs/s, unix seconds seen)`` (empty before schema version 2).

        Raises:
            StoreUnavailable: PostgreSQL could not be reached.
        """
        with self._errors("loading the rate peaks"):
            async with self._pool.acquire(timeout=self._timeout) as conn:
                try:
                    rows = await conn.fetch(_LOAD_PEAKS, kind)
                except asyncpg.UndefinedTableError:  # not migrated yet: no peaks, not an outage
                    return {}
        return {row["biz_tag"]: (row["peak"], row["at"]) for row in rows}

    async def close(self) -> None:
        """Close the pool's connections (terminating them if PostgreSQL does not answer). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await asyncio.wait_for(self._pool.close(), self._timeout)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError):
            # A graceful close needs the server; without it, drop the sockets.
            self._pool.terminate()


def _tag_info(row: asyncpg.Record) -> TagInfo:
    return TagInfo(
        tag=row["biz_tag"],
        max_id=row["max_id"],
        step=row["step"],
        description=row["description"],
        update_time=row["update_time"],
    )
