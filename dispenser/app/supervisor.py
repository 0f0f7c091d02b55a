"""``dispenser serve --processes N``: N worker processes under one supervisor, which restarts those that die.

The supervisor is this small module over the standard library's ``multiprocessing`` (``forkserver``: each
process forked from one that imported the worker once and runs no event loop) rather than gunicorn's arbiter,
circus or supervisord: docs/operations.md, "Processes per host", says why. It starts each process with its
own configuration (:func:`~dispenser.app.processes.process_config`), restarts one that dies with a back-off
(logged), forwards SIGTERM and SIGINT to all and waits for them within the stop budget (SIGKILL past it),
and serves the host's one ``/metrics`` (each process's, labelled ``process``) and the probes on
``metrics.port``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import msgspec

from dispenser.adapters.http.host import ChildProbe, HostOperations
from dispenser.adapters.prometheus import merge_expositions
from dispenser.app.commands import run_worker
from dispenser.app.processes import process_config
from dispenser.app.stopping import STOP_BUDGET, stop_on_signal
from dispenser.app.worker import Worker
from dispenser.config import Config
from dispenser.runner import run_async

__all__ = ["ProcessReport", "restart_delay", "supervise"]

log = logging.getLogger("dispenser.supervisor")

_FIRST_DELAY = 0.5
"""Seconds before the first restart of a process that died; doubled at each death in a row."""
_MAX_DELAY = 30.0
_STABLE = 30.0
"""Seconds a process must have run for its next death to restart it after the first delay again."""
_CHILD_MARGIN = 0.5
"""Seconds of the stop budget the processes leave the supervisor (to see them exit, or kill them)."""


def restart_delay(previous: float | None, ran: float) -> float:
    """Seconds before restarting a process that died after running ``ran`` seconds.

    ``previous``: the delay before its last restart (``None``: it never died before). The first death, or
    one after a stable run (30 s), waits 0.5 s; each death in a row doubles the wait, up to 30 s.
    """
    if previous is None or ran >= _STABLE:
        return _FIRST_DELAY
    return min(previous * 2, _MAX_DELAY)


class ProcessReport(msgspec.Struct, frozen=True):
    """What a process tells the supervisor once it serves: who it is, where its ``/metrics`` is."""

    index: int
    pid: int
    metrics_port: int | None
    worker_id: int | None


@dataclass(slots=True)
class _Slot:
    index: int
    process: BaseProcess | None = None
    conn: Connection | None = None
    report: ProcessReport | None = None
    started_at: float = 0.0
    restarts: int = 0
    ever_ready: bool = False
    exited: asyncio.Event = field(default_factory=asyncio.Event)


def _child(config: Config, index: int, conn: Connection, prepare: Callable[[], None], fast: bool) -> None:
    """A worker process, run until SIGTERM (the supervisor's), or until the supervisor is gone.

    In a process group of its own, so that a terminal's Ctrl-C reaches the supervisor only, which passes
    it on once (a second signal would cut the process's wind-down short); its log lines say which it is.
    """
    os.setpgrp()
    prepare()
    prefix = f"process {index}: "

    class _Named(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if not getattr(record, "_named", False):
                record.msg = prefix + str(record.msg)
                record._named = True
            return True

    for handler in logging.getLogger().handlers:
        handler.addFilter(_Named())

    def ready(worker: Worker) -> None:
        parts = worker.parts
        metrics = getattr(parts.metrics, "port", None)
        worker_id = getattr(getattr(parts.snowflake, "generator", None), "worker_id", None)
        conn.send_bytes(msgspec.msgpack.encode(ProcessReport(index, os.getpid(), metrics, worker_id)))

    async def run() -> int:
        loop = asyncio.get_running_loop()

        def orphaned() -> None:  # the pipe's other end closed: the supervisor is gone (kill -9)
            loop.remove_reader(conn.fileno())
            log.warning("the supervisor is gone: stopping")
            signal.raise_signal(signal.SIGTERM)

        loop.add_reader(conn.fileno(), orphaned)
        return await run_worker(config, ready, stop_budget=STOP_BUDGET - _CHILD_MARGIN)

    raise SystemExit(run_async(run(), fast=fast))


def _exit_cause(process: BaseProcess) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


class _Supervisor:
    def __init__(
        self, config: Config, processes: int, prepare: Callable[[], None], fast: bool, stop_budget: float
    ) -> None:
        self.config = msgspec.structs.replace(
            config, worker=msgspec.structs.replace(config.worker, processes=processes)
        )
        self.slots = [_Slot(index) for index in range(processes)]
        self.prepare = prepare
        self.fast = fast
        self.stop_budget = stop_budget
        self.stop = asyncio.Event()
        self.failed_start: _Slot | None = None
        # forkserver: each process is forked from a server process that has imported the worker once and
        # runs no event loop (a fork of this one, whose loop runs, would inherit its state; a spawn
        # imports everything again: ~2 s of CPU per start, and per restart).
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["dispenser.app.supervisor"])

    def spawn(self, slot: _Slot) -> None:
        # A socket pair, not a pipe: the child's end reads as closed once the supervisor is gone.
        mine, theirs = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_child,
            args=(process_config(self.config, slot.index), slot.index, theirs, self.prepare, self.fast),
            name=f"dispenser-worker-{slot.index}",
            daemon=False,
        )
        process.start()
        theirs.close()
        slot.process, slot.conn, slot.report = process, mine, None
        slot.started_at = time.monotonic()
        slot.exited = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_reader(mine.fileno(), self._reported, slot, mine)
        loop.add_reader(process.sentinel, self._ended, slot, process)
        log.info("started process %d (pid %s)", slot.index, process.pid)

    def _reported(self, slot: _Slot, conn: Connection) -> None:
        try:
            report = msgspec.msgpack.decode(conn.recv_bytes(), type=ProcessReport)
        except (EOFError, OSError):  # the process ended: _ended says so
            asyncio.get_running_loop().remove_reader(conn.fileno())
            return
        slot.report, slot.ever_ready = report, True
        said = f", snowflake worker ID {report.worker_id}" if report.worker_id is not None else ""
        log.info("process %d (pid %d) serving%s", slot.index, report.pid, said)

    def _ended(self, slot: _Slot, process: BaseProcess) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(process.sentinel)
        if slot.conn is not None:
            loop.remove_reader(slot.conn.fileno())
            slot.conn.close()
            slot.conn = None
        process.join()  # its report stays (it said whether this process served) until the next spawn
        slot.exited.set()

    async def keep(self, slot: _Slot) -> None:
        """Run the slot's process; restart it when it dies, after a back-off, until the stop."""
        delay: float | None = None
        while not self.stop.is_set():
            self.spawn(slot)
            await slot.exited.wait()
            process = slot.process
            assert process is not None
            if self.stop.is_set():
                return
            if not slot.ever_ready and process.exitcode == 1:
                log.error("process %d could not start (%s): stopping", slot.index, _exit_cause(process))
                self.failed_start = slot
                self.stop.set()
                return
            ran = time.monotonic() - slot.started_at
            delay = restart_delay(delay, ran)
            slot.restarts += 1
            log.warning(
                "process %d (pid %s) %s after %.1f s: restarting it in %.1f s (restart %d)",
                slot.index,
                process.pid,
                _exit_cause(process),
                ran,
                delay,
                slot.restarts,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay)

    async def wind_down(self) -> int:
        """SIGTERM to every live process, then wait for all within the budget; SIGKILL the rest."""
        live = [s for s in self.slots if s.process is not None and not s.exited.is_set()]
        for slot in live:
            assert slot.process is not None
            assert slot.process.pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(slot.process.pid, signal.SIGTERM)
        waiting = [asyncio.ensure_future(s.exited.wait()) for s in live]
        if waiting:
            _, pending = await asyncio.wait(waiting, timeout=self.stop_budget)
            for future in pending:
                future.cancel()
        late = [s for s in live if not s.exited.is_set()]
        for slot in late:
            assert slot.process is not None
            assert slot.process.pid is not None
            log.error(
                "process %d (pid %d) did not stop within %g s: killed",
                slot.index,
                slot.process.pid,
                self.stop_budget,
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(slot.process.pid, signal.SIGKILL)
        for slot in late:
            await slot.exited.wait()
        # A process still starting when the signal came dies of it before its handlers are in place: it had
        # opened nothing, so that is a clean stop too.
        clean = all(
            s.process is None
            or s.process.exitcode == 0
            or (s.process.exitcode == -signal.SIGTERM and not s.report)
            for s in live
        )
        return 0 if clean and not late and self.failed_start is None else 1

    def probes(self) -> list[ChildProbe]:
        """The processes serving now, for the host's ``/metrics`` and ``/readyz``."""
        return [
            ChildProbe(
                str(s.index), s.report.metrics_port if s.report is not None else None, s.report is not None
            )
            for s in self.slots
            if s.process is not None and not s.exited.is_set()
        ]

    def restarts(self) -> dict[str, int]:
        """Restarts so far, by process index."""
        return {str(s.index): s.restarts for s in self.slots}


async def supervise(
    config: Config,
    processes: int,
    *,
    prepare: Callable[[], None],
    fast: bool = True,
    stop_budget: float = STOP_BUDGET,
) -> int:
    """Run ``processes`` workers until SIGTERM or SIGINT; returns the exit status (0: every one stopped cleanly).

    Args:
        config: the configuration (checked with :func:`~dispenser.app.processes.check_processes` before).
        processes: how many.
        prepare: run first in each process (the command's logging); a picklable function.
        fast: run the processes on uvloop.
        stop_budget: seconds from the signal to the end of every process (SIGKILL past it).
    """
    supervisor = _Supervisor(config, processes, prepare, fast, stop_budget)
    host: HostOperations | None = None
    keeping: list[asyncio.Task[None]] = []
    with stop_on_signal(supervisor.stop.set):
        try:
            if config.metrics.port is not None:
                host = HostOperations(
                    config.metrics.host, config.metrics.port, supervisor.probes, _merged(supervisor)
                )
                await host.start()
                log.info("serving the host's /metrics (and /healthz, /readyz) on %s", host.url)
            log.info("starting %d worker processes", processes)
            keeping = [asyncio.create_task(supervisor.keep(slot)) for slot in supervisor.slots]
            await supervisor.stop.wait()
            log.info("stopping %d worker processes", processes)
            status = await supervisor.wind_down()
            for task in keeping:
                task.cancel()
            await asyncio.gather(*keeping, return_exceptions=True)
            log.info("stopped" if status == 0 else "stopped, not cleanly (exit status 1)")
            return status
        finally:
            if host is not None:
                await host.stop()


def _merged(supervisor: _Supervisor) -> Callable[[dict[str, str]], bytes]:
    def merge(texts: dict[str, str]) -> bytes:
        return merge_expositions(texts, restarts=supervisor.restarts(), processes=len(supervisor.slots))

    return merge
