"""The segment grants a worker remembers in its state directory (:class:`~dispenser.ports.GrantMemory`).

The highest ``max_id`` granted per cluster (``<system identifier>/<database>``) and tag, written atomically
and durably before the segment is handed out, so that a promoted replica that lost the last updates is
raised back to it (:mod:`dispenser.adapters.postgres.primary`). See ``docs/ha.md``
(``segment.remember_grants``).
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from dispenser.adapters.local.statefile import WorkerIdentity, write_atomically

__all__ = ["GrantFile"]

log = logging.getLogger(__name__)

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

    def __init__(self, directory: Path | None, identity: WorkerIdentity | None) -> None:
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

    @classmethod
    def open(cls, directory: Path) -> GrantFile:
        """Lock a slot in ``directory`` (created if missing) and load its file.

        Raises:
            OSError: the directory cannot be written, or every slot is held.
        """
        return cls(directory, WorkerIdentity.claim(Path(directory), "segment-grants"))

    def __repr__(self) -> str:
        return f"GrantFile({str(self.path)!r})"

    def _db(self, cluster: str) -> _Database:
        found = self._data.databases.get(cluster)
        if found is None:
            found = self._data.databases[cluster] = _Database()
        return found

    def remembered(self, cluster: str) -> dict[str, int]:
        """Tag → highest ``max_id`` in ``cluster``: this worker's, and every other file's in the directory.

        Whatever the timeline each was granted on: a primary of the same system on an earlier timeline (a
        PITR restored without the later history files) lost them as a promoted replica does. The other
        files' grants are kept for :meth:`floor` until the next call.

        Args:
            cluster: ``<system identifier>/<database>``.
        """
        others: dict[str, int] = {}
        if self.directory is not None:
            for other in sorted(self.directory.glob(f"{_PREFIX}*.json")):
                data = _load(other) if other != self.path else None
                db = None if data is None else data.databases.get(cluster)
                for tag, max_id in (db.max_ids if db is not None else {}).items():
                    others[tag] = max(others.get(tag, 0), max_id)
        self._others[cluster] = others
        merged = dict(others)
        own = self._data.databases.get(cluster)
        for tag, max_id in (own.max_ids if own is not None else {}).items():
            merged[tag] = max(merged.get(tag, 0), max_id)
        return merged

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
        """
        known = self._db(cluster).max_ids
        if known.get(tag, -1) >= max_id:
            return
        known[tag] = max_id
        await self._flush()

    async def set_server(self, cluster: str, identity: str) -> None:
        """Record the primary now in use (durably, like a grant)."""
        db = self._db(cluster)
        if db.server == identity:
            return
        db.server = identity
        await self._flush()

    async def _flush(self) -> None:
        if self.path is None:
            return
        self._version += 1
        wanted = self._version
        while self._written < wanted:
            if self._writer is None:
                self._writer = asyncio.create_task(self._write(), name="segment-grants-write")
            flushed = self._flushed
            await flushed.wait()

    async def _write(self) -> None:
        try:
            path = self.path
            assert path is not None
            while self._written < self._version:
                version = self._version
                payload = _encoder.encode(self._data) + b"\n"
                try:
                    await asyncio.to_thread(write_atomically, path, payload)
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
                    if self._failing:
                        log.info("segment grants saved to %s again", self.path)
                    self._failing = False
                self._written = version
                done, self._flushed = self._flushed, asyncio.Event()
                done.set()
        finally:
            self._writer = None

    def close(self) -> None:
        """Release the directory slot (the file stays for the next start)."""
        if self._identity is not None:
            self._identity.release()


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
