"""The ``dispenser`` command's logging: a line of text or a JSON object per record, on stderr."""

from __future__ import annotations

import datetime
import json
import logging
import sys

from dispenser.config import Config

__all__ = ["LOG_HANDLER", "JsonFormatter", "setup_logging"]


class JsonFormatter(logging.Formatter):
    """One JSON object per line (``log.format = "json"``), its ``time`` in RFC 3339, UTC, to the millisecond."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON: time, level, logger, message (and the exception, if any)."""
        moment = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        entry = {
            "time": moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


LOG_HANDLER = "dispenser-cli"
"""The name of the handler :func:`setup_logging` installs (and replaces on a second call)."""


def setup_logging(config: Config, verbose: bool) -> None:
    """Log to stderr at ``log.level`` (DEBUG with ``verbose``), as text or JSON (``log.format``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(LOG_HANDLER)
    if config.log.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    # Replace our own handler only: one a host program (or a test harness) put on the root logger stays.
    for old in [h for h in root.handlers if h.get_name() == LOG_HANDLER]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel("DEBUG" if verbose else config.log.level.upper())
