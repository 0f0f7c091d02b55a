"""The CLI's logging set-up replaces its own handler only, never one the host process installed."""

from __future__ import annotations

import datetime
import json
import logging

from dispenser.cli.logs import LOG_HANDLER, JsonFormatter, setup_logging
from dispenser.config import load_config


def test_setup_replaces_its_own_handler_and_keeps_others() -> None:
    """Twice in one process (as tests call main()): one CLI handler, and a foreign handler kept."""
    root = logging.getLogger()
    foreign = logging.NullHandler()
    root.addHandler(foreign)
    before = list(root.handlers)
    try:
        config = load_config(environ={})
        setup_logging(config, verbose=False)
        setup_logging(config, verbose=True)
        ours = [h for h in root.handlers if h.get_name() == LOG_HANDLER]
        assert len(ours) == 1
        assert foreign in root.handlers
        assert root.level == logging.DEBUG
    finally:
        root.handlers[:] = before
        root.removeHandler(foreign)


def test_json_lines_carry_an_rfc3339_utc_time() -> None:
    """log.format = "json": one object per line, `time` like 2026-11-25T18:14:03.123Z (the record's moment, UTC)."""
    record = logging.LogRecord("dispenser.app", logging.WARNING, __file__, 1, "served %d IDs", (3,), None)
    record.created = 1764094443.1239  # 2025-11-25 18:14:03.123 UTC
    entry = json.loads(JsonFormatter().format(record))
    assert entry == {
        "time": "2025-11-25T18:14:03.123Z",
        "level": "WARNING",
        "logger": "dispenser.app",
        "message": "served 3 IDs",
    }
    assert datetime.datetime.fromisoformat(entry["time"]).utcoffset() == datetime.timedelta(0)
