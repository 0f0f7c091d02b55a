"""The life cycle the dev servers share: a port, one child process, start with retry, stop and kill."""

from __future__ import annotations

import abc
import atexit
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Generic, Self, TypeVar

from dispenser_lab.servers.process import (
    ServerStartError,
    file_size,
    free_port,
    kill_process,
    read_since,
    sigstop,
    stop_process,
    wait_until,
)

__all__ = ["ServerProcess"]

_BIND_FAILED = "address already in use"
# How often a server on an automatically chosen port may retry after losing its port to another process.
_PORT_ATTEMPTS = 3

_Prepared = TypeVar("_Prepared")


class ServerProcess(abc.ABC, Generic[_Prepared]):
    """One server process on 127.0.0.1 that we start, stop and kill ourselves, restartable on the same port.

    A subclass says what differs: :meth:`_prepare` (find the executables, create directories and files;
    its result goes to every :meth:`_launch`), :meth:`_launch` (the command line, through :meth:`_spawn`),
    :meth:`_ready` and :attr:`log_path`; and, if SIGTERM then SIGKILL will not do, :meth:`_stop_signals`
    and :meth:`_kill_process`.

    Args:
        port: The port; a free one is picked when omitted (and re-picked if another process takes it
            before the first start).
        start_timeout: Seconds to wait for readiness.
        stop_timeout: Seconds to wait after the first stop signal.
    """

    def __init__(self, port: int | None, *, start_timeout: float, stop_timeout: float) -> None:
        self._auto_port = port is None
        self._port = free_port() if port is None else port
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._ever_started = False

    @property
    def port(self) -> int:
        """The port (fixed for the life of this object once the server has started)."""
        return self._port

    @property
    @abc.abstractmethod
    def log_path(self) -> Path:
        """The server's log file (appended to across restarts)."""

    @property
    def pid(self) -> int | None:
        """PID of the running server, or None when it is not running."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    @property
    def running(self) -> bool:
        """Whether our server process is alive."""
        return self.pid is not None

    def start(self) -> None:
        """Prepare and start the server, and wait until it is ready; a no-op if it is already running.

        Raises:
            ServerNotFoundError: The server's executables are not installed.
            DevServerError: Preparing failed (e.g. fetching the ZooKeeper jars).
            ServerStartError: Preparing failed (e.g. ``initdb``), or the server exited or was not ready
                in time; the message holds the log tail.
        """
        if self.running:
            return
        prepared = self._prepare()
        attempts = _PORT_ATTEMPTS if self._auto_port and not self._ever_started else 1
        for attempt in range(1, attempts + 1):
            offset = file_size(self.log_path)
            try:
                self._launch(prepared, offset)
            except ServerStartError:
                lost_port = _BIND_FAILED in read_since(self.log_path, offset).lower()
                if not (lost_port and attempt < attempts):
                    raise
                self._port = free_port()
            else:
                break
        self._ever_started = True
        atexit.register(self._stop_at_exit)

    def stop(self) -> None:
        """Stop the server (see :meth:`_stop_signals`), then SIGKILL it; a no-op if it is not running."""
        proc, self._proc = self._proc, None
        atexit.unregister(self._stop_at_exit)
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a frozen server would not hear the stop signal
            stop_process(proc, self._stop_signals(), kill=self._kill_process)

    def kill(self) -> None:
        """SIGKILL the server (a crash, as far as clients can tell) and reap it; see :meth:`_kill_process`."""
        proc, self._proc = self._proc, None
        atexit.unregister(self._stop_at_exit)
        if proc is not None:
            self._kill_process(proc)

    def freeze(self) -> None:
        """SIGSTOP the server: alive, its sockets open, answering nothing (a frozen VM, a long GC pause).

        Clients see no error, only silence, until :meth:`thaw` (or :meth:`kill`, which works on a frozen
        process; :meth:`stop` thaws it first). Returns once every thread of it has stopped.
        """
        if self._proc is not None:
            sigstop(self._proc.pid)

    def thaw(self) -> None:
        """SIGCONT the server after :meth:`freeze`: it goes on where it stopped."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    @abc.abstractmethod
    def _prepare(self) -> _Prepared:
        """Get ready for a start (once per :meth:`start`, before the first attempt)."""

    @abc.abstractmethod
    def _launch(self, prepared: _Prepared, offset: int) -> None:
        """Start the process on ``self._port`` with :meth:`_spawn` and wait until it is ready."""

    @abc.abstractmethod
    def _ready(self, proc: subprocess.Popen[bytes], offset: int) -> bool:
        """Whether ``proc`` is ready; ``offset`` is where this attempt's part of the log starts."""

    def _stop_signals(self) -> Sequence[tuple[signal.Signals, float]]:
        """The signals :meth:`stop` sends in turn, each with the seconds to wait after it."""
        return [(signal.SIGTERM, self.stop_timeout)]

    def _kill_process(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL ``proc`` and reap it."""
        kill_process(proc)

    def _spawn(
        self,
        cmd: list[str],
        *,
        offset: int,
        cwd: Path,
        what: str,
        env: Mapping[str, str] | None = None,
        user: int | None = None,
        group: int | None = None,
        extra_groups: list[int] | None = None,
    ) -> None:
        """Run ``cmd`` with its output appended to the log, and wait until :meth:`_ready`.

        Raises:
            ServerStartError: It exited or was not ready in time; it is killed, and the message holds
                the log tail.
        """
        with self.log_path.open("ab") as log:
            # A session of its own: a Ctrl-C meant for `dispenser dev` (or the test run) must not reach the
            # server before the service has shut down; we stop it ourselves.
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                start_new_session=True,
                user=user,
                group=group,
                extra_groups=extra_groups,
            )
        self._proc = proc
        try:
            wait_until(
                lambda: self._ready(proc, offset),
                proc=proc,
                timeout=self.start_timeout,
                what=what,
                log=self.log_path,
                log_offset=offset,
            )
        except ServerStartError:
            self._kill_process(proc)
            self._proc = None
            raise

    def _stop_at_exit(self) -> None:
        self.stop()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
