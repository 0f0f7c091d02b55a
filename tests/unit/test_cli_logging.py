"""The CLI's logging set-up replaces its own handler only, never one the host process installed."""

from __future__ import annotations

import logging

from dispenser.cli import _LOG_HANDLER, _setup_logging
from dispenser.config import load_config


def test_setup_replaces_its_own_handler_and_keeps_others() -> None:
    """Twice in one process (as tests call main()): one CLI handler, and a foreign handler kept."""
    root = logging.getLogger()
    foreign = logging.NullHandler()
    root.addHandler(foreign)
    before = list(root.handlers)
    try:
        config = load_config(environ={})
        _setup_logging(config, verbose=False)
        _setup_logging(config, verbose=True)
        ours = [h for h in root.handlers if h.get_name() == _LOG_HANDLER]
        assert len(ours) == 1
        assert foreign in root.handlers
        assert root.level == logging.DEBUG
    finally:
        root.handlers[:] = before
        root.removeHandler(foreign)
