"""The local snowflake state file: this worker's ID and high-water timestamp, kept across restarts.

The weak-dependency cache of the design, saved atomically and durably
(:func:`write_atomically`); see ``docs/snowflake.md`` ("Weak dependency on the registry").
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import secrets
import socket
import tempfile
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from dispenser.core.errors import StateFileCorrupt

__all__ = [
    "LocalState",
    "LocalStateFile",
    "RegistryMode",
    "WorkerIdentity",
    "default_state_dir",
    "state_file_path",
    "write_atomically",
]

RegistryMode = Literal["zookeeper", "zookeeper-lease", "postgres", "static"]

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class LocalState(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker remembers between runs.

    Attributes:
        worker_id: The worker ID it last held.
        high_water_ms: The last Unix millisecond it may have issued IDs in (0 if none).
        mode: The worker-ID mode it ran in; a state from another mode is not evidence for this one.
        registry_name: The registry namespace (e.g. the ZooKeeper ``<name>``) the ID belongs to.
        clean_stop_reserved_ms: Written only by a clean stop (every other save clears it): the highest
            mark that run reserved, and so the highest it can have reported. A registry mark not above it
            was written by that run, so ``high_water_ms`` (the exact last millisecond) may replace it and
            the restart need not wait out the reservation.
    """

    worker_id: _NonNegative
    high_water_ms: _NonNegative
    mode: RegistryMode
    registry_name: str
    clean_stop_reserved_ms: _NonNegative | None = None

    def matches(self, mode: RegistryMode, registry_name: str) -> bool:
        """Whether this state was written under the same mode and registry namespace."""
        return self.mode == mode and self.registry_name == registry_name


class _File(msgspec.Struct, kw_only=True):
    """On-disk envelope; ``format`` changes only if a field changes meaning."""

    format: Literal[1]
    state: LocalState


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(_File)


def default_state_dir() -> Path:
    """Return ``$XDG_STATE_HOME/leaf-dispenser``, or ``~/.local/state/leaf-dispenser`` when it is unset."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "leaf-dispenser"


def state_file_path(directory: Path, registry_name: str, address: str) -> Path:
    """Return the state file of one worker in ``directory``.

    Two workers on one machine (different ports) share the directory, not the file: the name holds the
    registry namespace and the worker's address, with anything but ``[A-Za-z0-9._-]`` replaced by ``_``.
    """
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", f"{registry_name}-{address}")
    return Path(directory) / f"snowflake-{safe}.json"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, payload: bytes) -> None:
    """Replace ``path`` with ``payload`` atomically and durably (temporary file, fsync, rename, fsync dir).

    A reader sees the old content or the new, never a mix; once this returns, a power cut keeps the new.
    The directory is created if missing.

    Raises:
        OSError: the directory or file could not be written; the old file, if any, is left intact.
    """
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(payload)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    _fsync_dir(directory)


class LocalStateFile:
    """Load and atomically save one :class:`LocalState` as JSON.

    Args:
        path: The file (see :func:`state_file_path`); its directory is created on the first save.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"LocalStateFile({str(self.path)!r})"

    def load(self) -> LocalState | None:
        """Return the saved state, or None when there is no file.

        Raises:
            StateFileCorrupt: the file exists but is not a valid state (bad JSON, a missing or negative
                field, an unknown mode); the message names the file and the problem.
        """
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateFileCorrupt(str(self.path), f"unreadable: {exc.strerror or exc}") from exc
        try:
            return _decoder.decode(raw).state
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise StateFileCorrupt(str(self.path), str(exc)) from exc

    def save(self, state: LocalState) -> None:
        """Write ``state`` atomically and durably (blocking: a few fsyncs; see :meth:`asave`).

        Raises:
            OSError: the directory or file could not be written; the old file, if any, is left intact.
        """
        write_atomically(self.path, _encoder.encode(_File(format=1, state=state)) + b"\n")

    async def asave(self, state: LocalState) -> None:
        """:meth:`save` in a worker thread, so the event loop does not wait for the disk."""
        await asyncio.to_thread(self.save, state)


_IDENTITY_SLOTS = 64
"""Workers of one registry namespace that may share a state directory (one slot each)."""


class WorkerIdentity:
    """A stable worker address, kept in the state directory and locked while this process runs.

    Address-keyed registries (``zookeeper``, ``postgres``) give an address the same worker ID at every
    start; an address holding the process ID would take a new one each time and exhaust the IDs. The first
    start writes ``<host name>:<random hex>`` into a slot file; later starts read it back. Each running
    process holds an exclusive ``flock`` on its slot (the kernel drops it when the process dies, ``kill -9``
    included), so two workers sharing the directory never share an address: the second takes the next
    slot. Copying a state directory to another machine copies its identities: don't (see docs/snowflake.md).
    """

    def __init__(self, address: str, path: Path, fd: int) -> None:
        self.address = address
        self.path = path
        self._fd: int | None = fd

    def __repr__(self) -> str:
        return f"WorkerIdentity({self.address!r}, {str(self.path)!r})"

    @classmethod
    def claim(cls, directory: Path, registry_name: str) -> WorkerIdentity:
        """Lock the first free slot of ``registry_name`` in ``directory`` and return its address.

        Raises:
            OSError: the directory or a slot file cannot be written, or every slot is held.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", registry_name)
        for slot in range(_IDENTITY_SLOTS):
            path = directory / f"identity-{safe}-{slot}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                address = cls._read_or_create(fd, directory)
            except BaseException:
                os.close(fd)
                raise
            return cls(address, path, fd)
        raise OSError(
            f"all {_IDENTITY_SLOTS} worker identity slots in {directory} are held by running workers"
        )

    @staticmethod
    def _read_or_create(fd: int, directory: Path) -> str:
        raw = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        host, sep, token = raw.rpartition(":")
        if sep and host and token and "/" not in raw:
            return raw
        # A new slot (or a torn first write): a fresh identity. The host name is for people reading the
        # registry; the random part is what makes it unique, even between hosts that share a name.
        host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
        address = f"{host}:{secrets.token_hex(4)}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, address.encode() + b"\n", 0)
        os.fsync(fd)
        _fsync_dir(directory)
        return address

    def release(self) -> None:
        """Unlock the slot (the address stays in the file for the next start). Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
