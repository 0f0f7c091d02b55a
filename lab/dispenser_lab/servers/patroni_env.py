"""Patroni's own environment: a cached virtual environment of pinned PyPI packages, and Debian's PostgreSQL.

:func:`patroni_venv` builds it once (``python -m dispenser_lab.servers.patroni`` does it ahead of the
tests); :func:`pg_bindir` finds the PostgreSQL binaries Patroni drives. The cluster itself:
:mod:`~dispenser_lab.servers.patroni`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from dispenser_lab.servers.maven import cache_dir
from dispenser_lab.servers.process import DevServerError, ServerNotFoundError

__all__ = [
    "PATRONI_REQUIREMENTS",
    "PATRONI_VERSION",
    "STAMP",
    "SYSTEM_PYTHON",
    "default_venv_dir",
    "ensure_traversable",
    "main",
    "patroni_venv",
    "pg_bindir",
]

PATRONI_VERSION = "4.1.5"
PATRONI_REQUIREMENTS = (
    # 4.1.5: the version docs/ha.md was tested with (ZooKeeper DCS, strict synchronous mode, failsafe_mode).
    f"patroni[zookeeper,psycopg3]=={PATRONI_VERSION}",
    # Patroni's driver; the binary wheel needs no libpq headers.
    "psycopg[binary]==3.3.9",
    # The same kazoo the dispenser pins (<2.12).
    "kazoo==2.11.0",
)
"""What the Patroni environment holds, pinned: a change rebuilds it."""

SYSTEM_PYTHON = Path("/usr/bin/python3")
"""The interpreter the Patroni environment is built from (``$DISPENSER_PATRONI_PYTHON`` overrides it)."""

STAMP = ".complete"
"""The file whose content (a digest of :data:`PATRONI_REQUIREMENTS`) marks a finished environment."""


def pg_bindir() -> Path:
    """The ``bin`` directory of the newest Debian PostgreSQL that has ``pg_rewind``."""
    found = sorted(
        (int(p.parent.name), p)
        for p in Path("/usr/lib/postgresql").glob("*/bin")
        if p.parent.name.isdigit() and (p / "postgres").is_file() and (p / "pg_rewind").is_file()
    )
    if not found:
        raise ServerNotFoundError(
            "Patroni drives Debian's PostgreSQL and none is installed in /usr/lib/postgresql/<version>/bin "
            "(apt-get install postgresql; scripts/test does it)"
        )
    return found[-1][1]


def ensure_traversable(path: Path) -> None:
    """Let others search every ancestor of ``path`` (``o+x``, never read), so ``postgres`` reaches it."""
    for parent in [path.absolute(), *path.absolute().parents]:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod((mode & 0o7777) | 0o001)


def default_venv_dir() -> Path:
    """``~/.cache/leaf-dispenser/patroni-<version>`` (``$XDG_CACHE_HOME`` honoured)."""
    return cache_dir(f"patroni-{PATRONI_VERSION}")


def patroni_venv(dest: Path | None = None, *, timeout: float = 600.0) -> Path:
    """Build (once) the virtual environment Patroni runs from, and return its ``patroni`` executable.

    The environment is built from :data:`SYSTEM_PYTHON` with pip (PyPI), in a scratch directory renamed into
    place with a stamp of :data:`PATRONI_REQUIREMENTS`, so a later call returns at once and a half-built
    environment is never used; concurrent builds take turns on a lock file. When running as root, the
    directory and its ancestors are made traversable so that ``postgres`` can execute it.

    Raises:
        ServerNotFoundError: the system Python (or its ``venv`` module) is missing.
        DevServerError: pip failed (its output is in the message).
    """
    dest = default_venv_dir() if dest is None else Path(dest)
    digest = hashlib.sha256("\n".join(PATRONI_REQUIREMENTS).encode()).hexdigest()
    patroni = dest / "bin" / "patroni"

    def complete() -> bool:
        try:
            return (dest / STAMP).read_text().strip() == digest and patroni.is_file()
        except OSError:
            return False

    if not complete():
        python = Path(os.environ.get("DISPENSER_PATRONI_PYTHON", str(SYSTEM_PYTHON)))
        if not python.is_file():
            raise ServerNotFoundError(f"{python} not found: Patroni's environment is built from it")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with _locked(dest.with_name(dest.name + ".lock")):
            if not complete():
                _build_venv(python, dest, digest, timeout)
    if os.geteuid() == 0:
        ensure_traversable(patroni)
    return patroni


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_venv(python: Path, dest: Path, digest: str, timeout: float) -> None:
    """Build the environment in place, stamp last.

    A venv's scripts name its path, so it cannot be built elsewhere and moved; the stamp, written last, is
    what makes it count, so a half-built one is rebuilt.
    """
    shutil.rmtree(dest, ignore_errors=True)
    steps = [
        [str(python), "-m", "venv", str(dest)],
        [str(dest / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         *PATRONI_REQUIREMENTS],
    ]  # fmt: skip
    for cmd in steps:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            shutil.rmtree(dest, ignore_errors=True)
            raise DevServerError(f"building Patroni's environment took over {timeout:g} s: {cmd}") from exc
        if done.returncode != 0:
            shutil.rmtree(dest, ignore_errors=True)
            output = (done.stdout + done.stderr).strip()[-4000:]
            hint = " (on Debian: apt-get install python3-venv)" if "venv" in cmd else ""
            raise DevServerError(f"{' '.join(cmd)} failed (exit {done.returncode}){hint}:\n{output}")
    (dest / STAMP).write_text(digest + "\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m dispenser_lab.servers.patroni``: build Patroni's environment (once), print its path."""
    del argv
    if not (default_venv_dir() / STAMP).is_file():
        print(f"installing Patroni {PATRONI_VERSION} into {default_venv_dir()}", file=sys.stderr)
    try:
        print(patroni_venv().parent.parent)
    except DevServerError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
