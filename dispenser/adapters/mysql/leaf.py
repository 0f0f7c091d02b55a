"""Read Leaf's ``leaf_alloc`` from its MySQL (or MariaDB) database; every failure becomes one plain sentence.

Leaf's DDL: ``biz_tag varchar(128)`` primary key, ``max_id bigint``, ``step int``, ``description
varchar(256)`` (``desc`` in the first published version) and ``update_time timestamp``. Only ``biz_tag``,
``max_id`` and ``step`` are required; the description and the time of Leaf's last fetch are read when the
table has them. The table is only read, never written.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from dispenser.core.errors import DispenserError
from dispenser.core.leaf_import import LeafRow
from dispenser.redaction import redact

try:
    import aiomysql
except ImportError:  # pragma: no cover - the extra is part of the test install
    aiomysql = None

__all__ = ["LEAF_TABLE", "LeafDatabaseError", "MySQLTarget", "parse_mysql_dsn", "read_leaf_alloc"]

LEAF_TABLE = "leaf_alloc"
_SCHEMES = ("mysql", "mariadb")
_DEFAULT_PORT = 3306
# MySQL's error numbers (server: 1xxx, client library: 2xxx).
_ACCESS_DENIED = 1045
_NO_DATABASE_ACCESS = 1044
_UNKNOWN_DATABASE = 1049
_NO_TABLE = 1146
_TABLE_ACCESS_DENIED = 1142
_CANNOT_CONNECT = 2003


class LeafDatabaseError(DispenserError):
    """Leaf's MySQL could not be read: unreachable, refused us, or holds no Leaf table (message says which)."""

    code = "leaf_database"
    status = 503


@dataclass(frozen=True, slots=True)
class MySQLTarget:
    """Where Leaf's database is: parsed from ``mysql://user:password@host:port/database[?ssl_ca=PATH]``."""

    host: str
    port: int
    user: str
    password: str
    database: str
    ssl_ca: str | None = None

    @property
    def where(self) -> str:
        """``host:port/database``, for messages (no credentials)."""
        return f"{self.host}:{self.port}/{self.database}"


def parse_mysql_dsn(dsn: str) -> MySQLTarget:
    """Parse a MySQL DSN.

    Raises:
        ValueError: not ``mysql://`` (or ``mariadb://``), no database, or an unknown parameter; the message
            masks the password.
    """
    shown = redact(dsn)
    parts = urlsplit(dsn)
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"not a MySQL DSN (mysql://user:password@host:port/database): {shown}")
    database = unquote(parts.path.lstrip("/"))
    if not database or "/" in database:
        raise ValueError(f"the MySQL DSN names no database (…/leaf): {shown}")
    try:
        port = parts.port or _DEFAULT_PORT
    except ValueError:
        raise ValueError(f"the MySQL DSN's port is not a number: {shown}") from None
    params = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(params) - {"ssl_ca"})
    if unknown:
        raise ValueError(f"unknown MySQL DSN parameter(s) {', '.join(unknown)} (known: ssl_ca): {shown}")
    return MySQLTarget(
        host=parts.hostname or "127.0.0.1",
        port=port,
        user=unquote(parts.username or "root"),
        password=unquote(parts.password or ""),
        database=database,
        ssl_ca=params["ssl_ca"][-1] if "ssl_ca" in params else None,
    )


def _describe(exc: BaseException, target: MySQLTarget, timeout: float) -> str:
    """One sentence for a driver error (``exc.args`` is ``(errno, message)`` for PyMySQL's errors)."""
    if isinstance(exc, TimeoutError):
        return f"Leaf's MySQL at {target.host}:{target.port} did not answer within {timeout:g} s"
    errno = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
    detail = str(exc.args[1]) if len(exc.args) > 1 else str(exc) or type(exc).__name__
    if errno in (_ACCESS_DENIED, _NO_DATABASE_ACCESS):
        return f"Leaf's MySQL at {target.where} refused user {target.user!r}: {detail}"
    if errno == _UNKNOWN_DATABASE:
        return f"Leaf's MySQL at {target.host}:{target.port} has no database {target.database!r}"
    if errno == _NO_TABLE:
        return f"no table {LEAF_TABLE} in {target.where}: is this Leaf's database?"
    if errno == _TABLE_ACCESS_DENIED:
        return f"user {target.user!r} may not read {LEAF_TABLE} in {target.where}: {detail}"
    if errno == _CANNOT_CONNECT or isinstance(exc, OSError):
        return f"cannot reach Leaf's MySQL at {target.host}:{target.port}: {detail.splitlines()[0]}"
    return f"reading {LEAF_TABLE} from {target.where} failed: {detail}"


@contextlib.asynccontextmanager
async def _errors(target: MySQLTarget, timeout: float) -> AsyncIterator[None]:
    secret = target.password
    try:
        yield
    except LeafDatabaseError:
        raise
    except (aiomysql.Error, OSError, TimeoutError) as exc:
        message = _describe(exc, target, timeout)
        if secret:
            message = message.replace(secret, "***")
        raise LeafDatabaseError(message) from None


async def _connect(target: MySQLTarget, timeout: float) -> Any:
    context = None
    if target.ssl_ca is not None:
        context = ssl.create_default_context(cafile=target.ssl_ca)
    # asyncio's timeout as well as the driver's: its connect_timeout covers the TCP connect only, not a
    # server that accepts and then never answers the handshake.
    async with asyncio.timeout(timeout):
        return await aiomysql.connect(
            host=target.host,
            port=target.port,
            user=target.user,
            password=target.password,
            db=target.database,
            connect_timeout=timeout,
            ssl=context,
            autocommit=True,
            charset="utf8mb4",
        )


async def read_leaf_alloc(
    dsn: str, *, tags: Sequence[str] | None = None, timeout: float = 10.0
) -> list[LeafRow]:
    """Every row of Leaf's ``leaf_alloc`` (or those of ``tags``), ordered by tag, read in one statement.

    Args:
        dsn: ``mysql://user:password@host:port/database`` (see :func:`parse_mysql_dsn`).
        tags: only these tags; each must exist.
        timeout: seconds to connect, and again to read.

    Raises:
        LeafDatabaseError: MySQL could not be reached or read, has no ``leaf_alloc``, or lacks a tag of ``tags``.
        ValueError: the DSN is malformed.
        ImportError: aiomysql is not installed (the ``leaf-import`` extra).
    """
    target = parse_mysql_dsn(dsn)
    if aiomysql is None:
        raise ImportError("reading Leaf's MySQL needs aiomysql: pip install 'leaf-dispenser[leaf-import]'")
    async with _errors(target, timeout):
        conn = await _connect(target, timeout)
        try:
            async with asyncio.timeout(timeout):
                rows = await _read(conn, target, tags)
        finally:
            await _close(conn)
    if tags is not None:
        missing = sorted(set(tags) - {row.tag for row in rows})
        if missing:
            raise LeafDatabaseError(f"not in {LEAF_TABLE} of {target.where}: {', '.join(missing)}")
    return rows


async def _close(conn: Any) -> None:
    """Say goodbye (COM_QUIT) and close; a connection already broken is just closed."""
    try:
        await conn.ensure_closed()
    except (aiomysql.Error, OSError):
        conn.close()


async def _read(conn: Any, target: MySQLTarget, tags: Sequence[str] | None) -> list[LeafRow]:
    async with conn.cursor() as cur:
        await cur.execute(f"SHOW COLUMNS FROM {LEAF_TABLE}")
        columns = {str(row[0]).lower() for row in await cur.fetchall()}
        lacking = sorted({"biz_tag", "max_id", "step"} - columns)
        if lacking:
            raise LeafDatabaseError(
                f"{LEAF_TABLE} in {target.where} is not Leaf's table: no column {', '.join(lacking)}"
            )
        # Leaf's DDL calls it `description`; the first published version `desc` (a reserved word).
        described = next((c for c in ("description", "desc") if c in columns), None)
        description = f"COALESCE(`{described}`, '')" if described else "''"
        idle = "TIMESTAMPDIFF(SECOND, update_time, NOW())" if "update_time" in columns else "NULL"
        query = f"SELECT biz_tag, max_id, step, {description}, {idle} FROM {LEAF_TABLE}"
        args: tuple[str, ...] = ()
        if tags is not None:
            if not tags:
                return []
            query += f" WHERE biz_tag IN ({', '.join(['%s'] * len(tags))})"
            args = tuple(tags)
        await cur.execute(query + " ORDER BY biz_tag", args)
        found = await cur.fetchall()
    rows = [
        LeafRow(
            tag=str(tag),
            max_id=int(max_id),
            step=int(step),
            description=str(text),
            idle_seconds=None if seconds is None else int(seconds),
        )
        for tag, max_id, step, text, seconds in found
    ]
    # In Python's order (code points), whatever the column's collation, as the dispenser lists tags.
    return sorted(rows, key=lambda row: row.tag)
