"""libfaketime: finding (or installing) it, and stepping one process's wall clock while it runs.

The worker runs with ``LD_PRELOAD=libfaketime.so.1`` and ``FAKETIME_TIMESTAMP_FILE`` naming a file that
holds a relative offset such as ``+1.000`` (seconds). With ``FAKETIME_CACHE_DURATION=1`` libfaketime
re-reads the file every second, so rewriting it steps the clock within a second (``FAKETIME_NO_CACHE=1``
would read it at every call, but races with a second thread: see :meth:`FaketimeClock.env`);
``FAKETIME_DONT_FAKE_MONOTONIC=1`` leaves ``CLOCK_MONOTONIC`` alone, so the event loop's timers are not
disturbed, only the wall clock that snowflake IDs are made from. (It also makes ``time.sleep`` fail with
EINVAL under libfaketime 0.9.10, which is why the ZooKeeper adapter's threads wait on an event instead.)
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["FaketimeClock", "FaketimeMissing", "ensure_libfaketime", "find_libfaketime"]

_PATTERNS = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/libfaketime.so.1",
)


class FaketimeMissing(RuntimeError):
    """libfaketime is not installed and could not be installed here."""


def find_libfaketime() -> Path | None:
    """Return the path of ``libfaketime.so.1`` (``$DISPENSER_LIBFAKETIME`` first), or ``None``."""
    configured = os.environ.get("DISPENSER_LIBFAKETIME")
    if configured:
        return Path(configured) if Path(configured).is_file() else None
    for pattern in _PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return Path(found[0])
    return None


def ensure_libfaketime(*, install: bool = True) -> Path:
    """Return the path of ``libfaketime.so.1``, installing Debian's ``faketime`` package if need be.

    The install runs only as root on a machine with ``apt-get`` (as in CI); ``apt-get update`` is tried
    once if the package is unknown.

    Raises:
        FaketimeMissing: not installed, and not installable here (the message says how).
    """
    found = find_libfaketime()
    if found is not None:
        return found
    how = "install Debian's faketime package (apt-get install faketime) or set DISPENSER_LIBFAKETIME"
    if not install or os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise FaketimeMissing(f"libfaketime.so.1 not found: {how}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    command = ["apt-get", "install", "-y", "--no-install-recommends", "faketime"]
    attempts: list[subprocess.CompletedProcess[str]] = []
    for update_first in (False, True):
        if update_first:
            subprocess.run(
                ["apt-get", "update"], check=False, env=env, capture_output=True, text=True, timeout=300
            )
        attempts.append(
            subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=300)
        )
        found = find_libfaketime()
        if found is not None:
            return found
    tail = "\n".join((attempts[-1].stdout + attempts[-1].stderr).splitlines()[-10:])
    raise FaketimeMissing(f"libfaketime.so.1 not found and `{' '.join(command)}` failed: {how}\n{tail}")


class FaketimeClock:
    """The offset file of one process under libfaketime.

    Args:
        path: The ``FAKETIME_TIMESTAMP_FILE``; created with offset 0.
        library: ``libfaketime.so.1``.
    """

    def __init__(self, path: Path, library: Path) -> None:
        self.path = path
        self.library = library
        self.offset_ms = 0
        self._write()

    def env(self) -> dict[str, str]:
        """The environment variables that put a child process under this clock."""
        return {
            "LD_PRELOAD": str(self.library),
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            # Not FAKETIME_NO_CACHE: with it, a process with more than one thread (kazoo's connection
            # thread) now and then reads the unfaked clock while another thread re-reads the file — the
            # wall clock jumps back by the whole offset, ~18 times a second (measured, libfaketime 0.9.10),
            # and the worker rightly refuses IDs. Cached for 1 s, a step shows within a second instead.
            "FAKETIME_CACHE_DURATION": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    def step(self, delta_ms: int) -> None:
        """Move the wall clock by ``delta_ms`` (negative: back) from where it is now."""
        self.offset_ms += delta_ms
        self._write()

    def _write(self) -> None:
        # Write a new file and rename it over the old one: libfaketime reads the file at every clock call
        # and must never see it half written (or missing).
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{self.offset_ms / 1000:+.3f}\n")
        tmp.replace(self.path)
