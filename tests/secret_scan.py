"""The suite-wide secret check: no value of :data:`tests.secret_values.SECRETS` may reach a log.

``tests/conftest.py`` puts a :class:`SecretScanHandler` on the root logger for the whole session and, at
the end, also runs :func:`scan_log_files` over the session's temporary directory (the dev servers' logs,
the logs of workers run as child processes). Any finding fails the run, naming the secret (never
printing its value) and the logger or file it reached.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Leak", "SecretScanHandler", "find_secrets", "scan_log_files"]

# Attributes every LogRecord has; anything else came in through `extra=` and is scanned as well.
_STANDARD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}
_CHUNK = 1 << 20
# A file with a NUL byte near its start is binary (e.g. a Kafka segment, also named *.log): not a log.
_BINARY_PROBE = 8192


@dataclass(frozen=True, slots=True)
class Leak:
    """A secret found where it must not be."""

    secret: str
    """The name of the secret in ``SECRETS`` (its value is never shown)."""
    where: str
    """The logger (``logger 'dispenser.app' (WARNING)``) or the file it was found in."""

    def __str__(self) -> str:
        return f"secret {self.secret!r} found in {self.where}"


def find_secrets(text: str, secrets: Mapping[str, str]) -> list[str]:
    """Return the names of the secrets whose value occurs in ``text``."""
    return [name for name, value in secrets.items() if value and value in text]


class SecretScanHandler(logging.Handler):
    """A logging handler that formats every record and remembers which secrets appeared in which logger.

    The record is formatted in full: the message with its arguments, the exception text with its
    traceback, the stack, and any ``extra`` fields, since a secret can hide in any of them.

    Args:
        secrets: Name → value; read at every record, so values added later are looked for too.
    """

    def __init__(self, secrets: Mapping[str, str]) -> None:
        super().__init__(logging.NOTSET)
        self.secrets = secrets
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self._leaks: dict[Leak, int] = {}

    @property
    def leaks(self) -> list[Leak]:
        """Every (secret, logger) pair seen so far, in the order first seen."""
        return list(self._leaks)

    def emit(self, record: logging.LogRecord) -> None:
        """Scan one record."""
        try:
            text = self.format(record)
        except Exception:  # a broken format string must not hide the raw parts from the scan
            text = f"{record.msg!r} {record.args!r}"
        extras = [repr(value) for key, value in vars(record).items() if key not in _STANDARD_ATTRIBUTES]
        if extras:
            text = "\n".join([text, *extras])
        for name in find_secrets(text, self.secrets):
            leak = Leak(name, f"logger {record.name!r} ({record.levelname})")
            self._leaks[leak] = self._leaks.get(leak, 0) + 1


def _log_files(root: Path) -> Iterator[Path]:
    # os.walk does not follow symbolic links, so a link out of the temporary directory is not scanned.
    for directory, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(".log"):
                yield Path(directory, name)


def _file_contains(path: Path, needles: Mapping[str, bytes]) -> list[str]:
    overlap = max((len(n) for n in needles.values()), default=1) - 1
    found: set[str] = set()
    with path.open("rb") as f:
        head = f.read(_BINARY_PROBE)
        if b"\0" in head:
            return []
        data = head
        while True:
            found.update(name for name, needle in needles.items() if needle in data)
            more = f.read(_CHUNK)
            if not more:
                break
            # Keep the tail, so that a secret split across two reads is still found.
            data = data[-overlap:] + more if overlap else more
    return [name for name in needles if name in found]


def scan_log_files(root: Path, secrets: Mapping[str, str]) -> list[Leak]:
    """Look for the secrets in every text file named ``*.log`` under ``root``.

    Binary files that happen to end in ``.log`` (Kafka's segments) are skipped; so are files that cannot be
    read. Returns one :class:`Leak` per (secret, file).
    """
    needles = {name: value.encode() for name, value in secrets.items() if value}
    leaks: list[Leak] = []
    if not needles or not root.is_dir():
        return leaks
    for path in sorted(_log_files(root)):
        try:
            names = _file_contains(path, needles)
        except OSError:
            continue
        leaks.extend(Leak(name, f"file {path}") for name in names)
    return leaks
