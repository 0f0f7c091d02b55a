"""What the ``dispenser`` command's modules share.

The types of a subcommand's parser and handler, and the process settings of the commands that run
servers or ask them.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
from collections.abc import Callable
from importlib.metadata import entry_points

from dispenser.config import Config

__all__ = ["LAB_ENTRY_POINTS", "AddParser", "Handler", "lab_command", "stacks_on_sigusr1", "uvloop_suits"]

log = logging.getLogger("dispenser")

AddParser = Callable[..., argparse.ArgumentParser]
"""Adds a subcommand's parser (``add_parser`` of the subparsers, with the global options as a parent)."""

Handler = Callable[[argparse.Namespace, Config], int]
"""Runs a subcommand with its arguments and the loaded configuration; returns the exit status."""


LAB_ENTRY_POINTS = "dispenser.lab"
"""The entry-point group where the lab (``leaf-dispenser-lab``) registers ``bench`` and ``dev``."""


def lab_command(name: str) -> Handler:
    """The lab's handler of ``dispenser NAME``, or one that says how to install the lab.

    Looked up only when the command runs (scanning the installed distributions costs tens of
    milliseconds), so that every other command starts as fast as before and the product never imports
    the lab.
    """
    for entry in entry_points(group=LAB_ENTRY_POINTS, name=name):
        handler: Handler = entry.load()
        return handler

    def missing(_args: argparse.Namespace, _config: Config) -> int:
        print(
            f"dispenser {name}: this command comes with the lab, a second distribution "
            "(leaf-dispenser-lab, lab/ in the repository): pip install ./lab",
            file=sys.stderr,
        )
        return 2

    return missing


def stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` writes every thread's Python stack to stderr, and the process goes on.

    For a worker that is alive but silent: the main thread's stack shows whether the event loop is
    blocked (and where) or idle, waiting for something that does not come.
    """
    if not hasattr(signal, "SIGUSR1"):  # Windows
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    except (OSError, ValueError, AttributeError):  # stderr is no file (embedded, or a test capturing it)
        log.debug("no stacks on SIGUSR1: stderr has no file descriptor")


def uvloop_suits(config: Config) -> bool:
    """Whether to run on uvloop: not with TLS to Kafka, whose connections it closes in 30 s (``run_async``)."""
    return config.kafka.security_protocol not in ("SSL", "SASL_SSL")
