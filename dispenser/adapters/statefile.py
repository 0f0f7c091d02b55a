"""The local snowflake state file: this worker's ID and high-water timestamp, kept across restarts.

It is the weak-dependency cache of the design: when the registry cannot be reached at start-up, the worker
may start from it (in the modes where that is safe) and still refuse a clock behind the recorded high
water; in ``static`` mode it is the only record there is. The file lives in a configured state directory,
never in a temporary one (a reboot that empties ``/tmp`` must not erase the high-water mark).

A save is atomic and durable: the JSON goes to a temporary file in the same directory, is flushed and
fsynced, replaces the old file with ``os.replace``, and the directory is fsynced so the rename survives a
power cut. A reader sees the old state or the new one, never half of either.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import tempfile
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from dispenser.core.errors import StateFileCorrupt

__all__ = ["LocalState", "LocalStateFile", "RegistryMode", "default_state_dir", "state_file_path"]

RegistryMode = Literal["zookeeper", "zookeeper-lease", "postgres", "static"]

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class LocalState(msgspec.Struct, frozen=True, kw_only=True):
    """What one worker remembers between runs.

    Attributes:
        worker_id: The worker ID it last held.
        high_water_ms: The last Unix millisecond it may have issued IDs in (0 if none).
        mode: The worker-ID mode it ran in; a state from another mode is not evidence for this one.
        registry_name: The registry namespace (e.g. the ZooKeeper ``<name>``) the ID belongs to.
    """

    worker_id: _NonNegative
    high_water_ms: _NonNegative
    mode: RegistryMode
    registry_name: str

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
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True)
        payload = _encoder.encode(_File(format=1, state=state)) + b"\n"
        fd, tmp_name = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as tmp:
                tmp.write(payload)
                tmp.flush()
                os.fsync(tmp.fileno())
            os.replace(tmp_name, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_name)
            raise
        _fsync_dir(directory)

    async def asave(self, state: LocalState) -> None:
        """:meth:`save` in a worker thread, so the event loop does not wait for the disk."""
        await asyncio.to_thread(self.save, state)
