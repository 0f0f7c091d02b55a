"""The segment grants a worker remembers in its state directory (:class:`~dispenser.ports.GrantMemory`).

The highest ``max_id`` granted per cluster (``<system identifier>/<database>``) and tag, written atomically
and durably before the segment is handed out, so that a promoted replica that lost the last updates is
raised back to it (:mod:`dispenser.adapters.postgres.primary`). See ``docs/ha.md``
(``segment.remember_grants``). The directory's files are written and read in daemon threads under a bound
(:data:`WRITE_TIMEOUT`): a stalled disk fails fetches as ``unavailable`` and never holds the process's exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import re
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import msgspec

from dispenser.adapters.local.statefile import WorkerIdentity, write_atomically
from dispenser.core.errors import StoreUnavailable

__all__ = ["WRITE_TIMEOUT", "GrantFile", "probe_writable"]

log = logging.getLogger(__name__)

T = TypeVar("T")

WRITE_TIMEOUT = 2.0
"""Seconds a grant may take to reach the disk (or the directory to be read) before the fetch fails.

A healthy disk writes and fsyncs the file in milliseconds; a stalled one (NFS, a frozen block device) never
does. The same as ``postgres.command_timeout``'s default: the write is the second half of a fetch."""

_PREFIX = "segment-grants-"


class _Database(msgspec.Struct, kw_only=True):
    server: str | None = None
    """The primary last used (``<system identifier>/<timeline>``)."""
    max_ids: dict[str, Annotated[int, msgspec.Meta(ge=0)]] = {}


class _File(msgspec.Struct, kw_only=True):
    format: Literal[1, 2]
    databases: dict[str, _Database] = {}
    """Format 2: by cluster, ``<system identifier>/<database>``; format 1 (read, then rewritten): by database."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(_File)


class GrantFile:
    """This worker's remembered grants: in memory, and in its file in ``directory``.

    Build one with :meth:`open` (it locks a slot of the directory until :meth:`close`).
    """

    def __init__(
        self, directory: Path | None, identity: WorkerIdentity | None, write_timeout: float = WRITE_TIMEOUT
    ) -> None:
        self.write_timeout = write_timeout
        """Seconds a write (or a read of the directory) may take; past them the fetch fails (see module)."""
        self.directory = None if directory is None else Path(directory)
        self._identity = identity
        self.path = (
            None
            if self.directory is None or identity is None
            else self.directory / f"{_PREFIX}{_safe(identity.address)}.json"
        )
        self._data = (_load(self.path) if self.path is not None else None) or _File(format=2)
        self._version = 0  # bumped by every change
        self._written = 0  # the version on disk
        self._writer: asyncio.Task[None] | None = None
        self._flushed = asyncio.Event()
        self._failing = False
        self._others: dict[str, dict[str, int]] = {}  # cluster -> the other files' grants, as last read
        self._stalled = False  # a flush gave up on the write under way, which has not ended yet
        self._read_failing = False

    @classmethod
    def open(cls, directory: Path) -> GrantFile:
        """Lock a slot in ``directory`` (created if missing) and load its file.

        Raises:
            OSError: the directory cannot be written, or every slot is held.
        """
        return cls(directory, WorkerIdentity.claim(Path(directory), "segment-grants"))

    @classmethod
    async def open_within(cls, directory: Path, timeout: float | None = None) -> GrantFile:
        """:meth:`open` in a daemon thread, for at most ``timeout`` seconds (:data:`WRITE_TIMEOUT`): a stalled disk.

        The event loop goes on meanwhile (a SIGTERM is still heard), and a thread stuck for ever does not
        keep the process alive.

        Raises:
            OSError: as :meth:`open`, or the directory did not answer within ``timeout``.
        """
        timeout = WRITE_TIMEOUT if timeout is None else timeout
        try:
            async with asyncio.timeout(timeout):
                return await _in_daemon_thread(cls.open, Path(directory))
        except TimeoutError:
            raise OSError(errno.ETIMEDOUT, f"no answer within {timeout:g} s (a stalled disk?)") from None

    def __repr__(self) -> str:
        return f"GrantFile({str(self.path)!r})"

    def _db(self, cluster: str) -> _Database:
        found = self._data.databases.get(cluster)
        if found is None:
            found = self._data.databases[cluster] = _Database()
        return found

    async def remembered(self, cluster: str) -> dict[str, int]:
        """Tag → highest ``max_id`` in ``cluster``: this worker's, and every other file's in the directory.

        Whatever the timeline each was granted on: a primary of the same system on an earlier timeline (a
        PITR restored without the later history files) lost them as a promoted replica does. The other
        files' grants are kept for :meth:`floor` until the next call. The directory is read in a thread,
        for at most :attr:`write_timeout`: on a stalled disk the other files' grants are those last read
        (said once in the log).

        Args:
            cluster: ``<system identifier>/<database>``.
        """
        others = self._others.get(cluster, {})
        if self.directory is not None:
            try:
                async with asyncio.timeout(self.write_timeout):
                    others = await _in_daemon_thread(self._read_others, cluster)
            except TimeoutError:
                if not self._read_failing:
                    log.error(
                        "cannot read the segment grants of the other workers in %s within %g s (a stalled "
                        "disk?): using those last read",
                        self.directory,
                        self.write_timeout,
                    )
                self._read_failing = True
            else:
                self._read_failing = False
        self._others[cluster] = others
        merged = dict(others)
        own = self._data.databases.get(cluster)
        for tag, max_id in (own.max_ids if own is not None else {}).items():
            merged[tag] = max(merged.get(tag, 0), max_id)
        return merged

    def _read_others(self, cluster: str) -> dict[str, int]:
        """The other files' grants in ``cluster`` (blocking: run in a thread)."""
        assert self.directory is not None
        others: dict[str, int] = {}
        for other in sorted(self.directory.glob(f"{_PREFIX}*.json")):
            data = _load(other) if other != self.path else None
            db = None if data is None else data.databases.get(cluster)
            for tag, max_id in (db.max_ids if db is not None else {}).items():
                others[tag] = max(others.get(tag, 0), max_id)
        return others

    def floor(self, cluster: str, tag: str) -> int | None:
        """The highest ``max_id`` of ``tag`` in ``cluster``: this worker's, and the other files' as last read.

        Read from memory only (no file is opened): every fetch asks for it.
        """
        own = self._data.databases.get(cluster)
        found = [
            max_id
            for max_id in (
                None if own is None else own.max_ids.get(tag),
                self._others.get(cluster, {}).get(tag),
            )
            if max_id is not None
        ]
        return max(found) if found else None

    def server(self, cluster: str) -> str | None:
        """The primary last used for ``cluster`` (``<system identifier>/<timeline>``)."""
        found = self._data.databases.get(cluster)
        return None if found is None else found.server

    async def remember(self, cluster: str, tag: str, max_id: int) -> None:
        """Record a grant in memory at once and on disk before returning (writes are coalesced).

        A disk that refuses the write is logged (once per failing streak) and the grant stays in memory:
        the repair still covers this process, not a restart of it.

        Raises:
            StoreUnavailable: the write did not end within :attr:`write_timeout` (a stalled disk). The
                grant stays in memory (this worker's floor covers it); its segment must not be handed out.
        """
        known = self._db(cluster).max_ids
        if known.get(tag, -1) >= max_id:
            return
        known[tag] = max_id
        await self._flush()

    async def set_server(self, cluster: str, identity: str) -> None:
        """Record the primary now in use (durably, like a grant; raises as :meth:`remember`)."""
        db = self._db(cluster)
        if db.server == identity:
            return
        db.server = identity
        await self._flush()

    def stalled(self) -> str | None:
        """Why a grant cannot be made durable now (a write that outlasted its bound is still under way), or None.

        In words a request may be answered: the file's path (where the state directory is) is not in them.
        """
        if not self._stalled:
            return None
        return (
            f"the segment grants could not be saved within {self.write_timeout:g} s and the write has not "
            "ended (a stalled disk?): no segment is fetched until it does (docs/ha.md)"
        )

    async def _flush(self) -> None:
        if self.path is None:
            return
        self._version += 1
        wanted = self._version
        try:
            async with asyncio.timeout(self.write_timeout):
                while self._written < wanted:
                    if self._writer is None:
                        self._writer = asyncio.create_task(self._write(), name="segment-grants-write")
                    flushed = self._flushed
                    await flushed.wait()
        except TimeoutError:
            if not self._stalled:
                log.error(
                    "the segment grants could not be saved to %s within %g s (a stalled disk?): segment "
                    "fetches fail (unavailable) until the write ends",
                    self.path,
                    self.write_timeout,
                )
            self._stalled = self._writer is not None  # until the write under way ends
            unsaved = "a segment this worker could not remember is not handed out"
            raise StoreUnavailable(  # the path (where the state directory is) for the log only
                f"the segment grants could not be saved within {self.write_timeout:g} s (a stalled disk?): "
                f"{unsaved}",
                logged=f"the segment grants could not be saved to {self.path} within {self.write_timeout:g} s "
                f"(a stalled disk?): {unsaved}",
            ) from None

    async def _write(self) -> None:
        try:
            path = self.path
            assert path is not None
            while self._written < self._version:
                version = self._version
                payload = _encoder.encode(self._data) + b"\n"
                try:
                    # A daemon thread, not the default executor: a write that never ends (a stalled disk)
                    # must not hold the process's exit, which joins the executor's threads.
                    await _in_daemon_thread(write_atomically, path, payload)
                except OSError as exc:
                    if not self._failing:
                        log.error(
                            "cannot save the segment grants to %s (%s): a restart of this worker would not "
                            "remember them (this run still does)",
                            self.path,
                            exc.strerror or exc,
                        )
                    self._failing = True
                else:
                    if self._failing or self._stalled:
                        log.info("segment grants saved to %s again", self.path)
                    self._failing = False
                finally:
                    self._stalled = False
                self._written = version
                done, self._flushed = self._flushed, asyncio.Event()
                done.set()
        finally:
            self._writer = None

    def close(self) -> None:
        """Release the directory slot (the file stays for the next start)."""
        if self._identity is not None:
            self._identity.release()


async def probe_writable(directory: Path, timeout: float | None = None) -> None:
    """Create ``directory`` if missing and a file in it, in a daemon thread, within ``timeout`` (:data:`WRITE_TIMEOUT`).

    What ``dispenser check`` asks of a state directory: a stalled disk fails it in the bound instead of
    holding the command (and its exit) for ever.

    Raises:
        OSError: the directory cannot be written, or did not answer within ``timeout``.
    """
    timeout = WRITE_TIMEOUT if timeout is None else timeout

    def probe() -> None:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".check-"):
            pass

    try:
        async with asyncio.timeout(timeout):
            await _in_daemon_thread(probe)
    except TimeoutError:
        raise OSError(errno.ETIMEDOUT, f"no answer within {timeout:g} s (a stalled disk?)") from None


def _in_daemon_thread(fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
    """``fn(*args)`` in a new daemon thread; its outcome lands on the returned future (if still wanted).

    Unlike ``asyncio.to_thread`` (the default executor, joined without a timeout when the loop closes and
    again when the interpreter exits), a thread stuck for ever here does not keep the process alive.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return  # given up on (the waiter's bound passed)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]  # T when no error

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the waiter, whatever it is
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="segment-grants-io", daemon=True).start()
    return future


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)


def _load(path: Path) -> _File | None:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read the segment grants in %s: %s", path, exc.strerror or exc)
        return None
    try:
        data = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        # Written atomically, so this is not a torn write: someone edited it. Remembering less only means
        # a repair may miss these grants; say so rather than refuse to start.
        log.error("ignoring %s: not a segment grants file (%s)", path, exc)
        return None
    return _upgraded(data)


def _upgraded(data: _File) -> _File:
    """Format 1 (keyed by database name) as format 2 (by cluster), from the primary each entry last used.

    An entry with no primary recorded cannot be placed in a cluster and is dropped: a grant is only ever
    made after its primary was recorded, so such an entry holds none.
    """
    if data.format == 2:
        return data
    databases = {
        f"{db.server.partition('/')[0]}/{name}": db
        for name, db in data.databases.items()
        if db.server is not None
    }
    return _File(format=2, databases=databases)
