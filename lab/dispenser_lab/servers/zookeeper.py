"""A real Apache ZooKeeper server on 127.0.0.1 for tests, run with Java from jars fetched off Maven Central.

:func:`fetch_zookeeper_jars` runs ``mvn dependency:copy-dependencies`` once, into a cache directory, on the
pom shipped in this package (``poms/zookeeper/pom.xml``, in the wheel too); :class:`ZooKeeperServer` runs ``ZooKeeperServerMain`` from those jars, standalone,
with a short ``tickTime`` so that session-expiry tests take seconds, not minutes.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from dispenser_lab.servers.maven import cache_dir, fetch_command, fetch_jars, is_complete, packaged_pom
from dispenser_lab.servers.process import LOOPBACK, ServerNotFoundError
from dispenser_lab.servers.server import ServerProcess

__all__ = [
    "ZOOKEEPER_VERSION",
    "ZooKeeperServer",
    "default_jar_dir",
    "fetch_zookeeper_jars",
    "find_java",
    "srvr",
]

ZOOKEEPER_VERSION = "3.9.4"
"""The ZooKeeper release the pom pins (keep both in step)."""

POM = packaged_pom("zookeeper")
"""The pom whose dependencies are the server's class path: package data, in the wheel as in a checkout."""

JARS_ENV = "DISPENSER_ZOOKEEPER_JARS"
"""Environment variable naming a directory of ZooKeeper jars to use instead of fetching (e.g. a mirror)."""

_MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"
_QUORUM_MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
# Small JVM, quick start: the test server holds a few hundred znodes at most.
_JVM_OPTIONS = ("-Xms16m", "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")


def default_jar_dir() -> Path:
    """Return where :func:`fetch_zookeeper_jars` puts the jars by default.

    ``$XDG_CACHE_HOME/leaf-dispenser/zookeeper-<version>/``, with ``~/.cache`` when the variable is unset.
    """
    return cache_dir(f"zookeeper-{ZOOKEEPER_VERSION}")


def fetch_zookeeper_jars(dest: Path | None = None, *, pom: Path = POM, timeout: float = 600.0) -> Path:
    """Download the ZooKeeper server jars (and a logging binding) from Maven Central, once.

    See :func:`dispenser_lab.servers.maven.fetch_jars`: a later call with the same pom returns at once,
    without starting Maven.

    Args:
        dest: Directory for the jars; :func:`default_jar_dir` when omitted.
        pom: The pom listing the jars (:data:`POM`, the one shipped in this package).
        timeout: Seconds Maven may take.

    Returns:
        ``dest``, holding the jars.

    Raises:
        ServerNotFoundError: ``mvn`` or the pom is missing (or set ``$DISPENSER_ZOOKEEPER_JARS``).
        DevServerError: Maven failed (its output is in the message) or took too long.
    """
    dest = default_jar_dir() if dest is None else Path(dest)
    return fetch_jars(pom, dest, what="ZooKeeper", jar_glob="zookeeper-*.jar", timeout=timeout)


def find_java(what: str = "ZooKeeper needs Java 11 or later") -> Path:
    """Locate the ``java`` executable: ``$JAVA_HOME/bin/java`` first, then ``PATH``.

    Args:
        what: What needs Java, for the error message.

    Raises:
        ServerNotFoundError: Neither place has it.
    """
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.is_file():
            return candidate
    found = shutil.which("java")
    if found is not None:
        return Path(found)
    raise ServerNotFoundError(
        f"java not found (JAVA_HOME or PATH); {what} (apt-get install -y openjdk-17-jre-headless)"
    )


def _find_jars() -> Path:
    override = os.environ.get(JARS_ENV)
    if override:
        jars = Path(override)
        if not any(jars.glob("zookeeper-*.jar")):
            raise ServerNotFoundError(f"{JARS_ENV}={override} holds no zookeeper-*.jar")
        return jars
    return fetch_zookeeper_jars()


def srvr(port: int, timeout: float = 1.0, word: bytes = b"srvr") -> str | None:
    """Send the four-letter word ``srvr`` to ``127.0.0.1:port`` and return the answer, or None if no answer.

    Another four-letter word (``mntr``, ``stat``) may be given as ``word``.

    ZooKeeper answers ``This ZooKeeper instance is not currently serving requests`` while it loads its
    database, and ``Zookeeper version: …`` once it serves. ``ruok`` is no readiness check: it says
    ``imok`` as soon as the port is open, even when loading the database failed and the server will never
    serve.
    """
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout) as sock:
            sock.sendall(word)
            chunks = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
    except OSError:
        return None
    return b"".join(chunks).decode("utf-8", errors="replace")


class ZooKeeperServer(ServerProcess[tuple[Path, Path]]):
    """One standalone ZooKeeper process on 127.0.0.1, restartable on the same port and data directory.

    Example::

        with ZooKeeperServer(tmp_path) as server:
            client = kazoo.client.KazooClient(server.hosts)

    The configuration (``zoo.cfg`` in ``workdir``, rewritten at each start) allows the four-letter words
    ``srvr`` (our readiness check and ``dispenser check``'s), ``ruok`` and ``stat``, disables the admin HTTP
    server, and negotiates session timeouts between ``min_session_timeout_ms`` and
    ``max_session_timeout_ms``; ZooKeeper expires sessions in steps of ``tick_time_ms``.

    Args:
        workdir: Holds ``zoo.cfg``, the data directory ``data/`` (kept across restarts) and the log
            ``zookeeper.log`` (appended to across restarts).
        port: Client port; a free one is picked when omitted (and re-picked if another process takes it
            before the first start).
        jars: Directory of the server's jars; :func:`fetch_zookeeper_jars` (or ``$DISPENSER_ZOOKEEPER_JARS``)
            when omitted.
        tick_time_ms: ZooKeeper's basic time unit.
        min_session_timeout_ms: The shortest session timeout a client may ask for.
        max_session_timeout_ms: The longest session timeout a client may ask for.
        config: Extra ``zoo.cfg`` settings, written last (an ensemble's ``server.N`` lines go here).
        java: The ``java`` executable; :func:`find_java` when omitted.
        server_id: This server's number in an ensemble: it is written to ``data/myid`` and the server runs
            ``QuorumPeerMain`` (see :class:`~dispenser_lab.servers.zookeeper_ensemble.ZooKeeperEnsemble`).
            None: a standalone ``ZooKeeperServerMain``.
        jvm_options: The JVM's options (heap, collector).
        start_timeout: Seconds to wait until ``srvr`` reports a serving server.
        stop_timeout: Seconds to wait after SIGTERM before SIGKILL.
    """

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        *,
        jars: Path | None = None,
        tick_time_ms: int = 500,
        min_session_timeout_ms: int = 1000,
        max_session_timeout_ms: int = 30000,
        config: Mapping[str, str] | None = None,
        java: Path | None = None,
        server_id: int | None = None,
        jvm_options: Sequence[str] = _JVM_OPTIONS,
        start_timeout: float = 30.0,
        stop_timeout: float = 5.0,
    ) -> None:
        self.workdir = Path(workdir)
        super().__init__(port, start_timeout=start_timeout, stop_timeout=stop_timeout)
        self._jars = jars
        self.tick_time_ms = tick_time_ms
        self.min_session_timeout_ms = min_session_timeout_ms
        self.max_session_timeout_ms = max_session_timeout_ms
        self.config = dict(config or {})
        self._java = java
        self.server_id = server_id
        self.jvm_options = tuple(jvm_options)

    @property
    def hosts(self) -> str:
        """The connection string clients take, ``127.0.0.1:PORT``."""
        return f"{LOOPBACK}:{self._port}"

    @property
    def data_dir(self) -> Path:
        """Snapshots and transaction logs (kept across restarts, so znodes and sessions survive them)."""
        return self.workdir / "data"

    @property
    def config_path(self) -> Path:
        """The ``zoo.cfg`` the server runs with."""
        return self.workdir / "zoo.cfg"

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self.workdir / "zookeeper.log"

    def _prepare(self) -> tuple[Path, Path]:
        """Find Java and the jars, fetching them if need be.

        Raises :class:`ServerNotFoundError` when Java, Maven or the pom is missing and
        :class:`DevServerError` when the jars could not be fetched.
        """
        java = self._java if self._java is not None else find_java()
        jars = self._jars if self._jars is not None else _find_jars()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.server_id is not None:
            (self.data_dir / "myid").write_text(f"{self.server_id}\n")
        return java, jars

    def _write_config(self) -> None:
        settings = {
            "tickTime": str(self.tick_time_ms),
            "minSessionTimeout": str(self.min_session_timeout_ms),
            "maxSessionTimeout": str(self.max_session_timeout_ms),
            "dataDir": str(self.data_dir.resolve()),
            "clientPort": str(self._port),
            "clientPortAddress": LOOPBACK,
            "admin.enableServer": "false",
            "4lw.commands.whitelist": "srvr,ruok,stat,mntr",
            **self.config,
        }
        self.config_path.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))

    def _launch(self, java_and_jars: tuple[Path, Path], offset: int) -> None:
        java, jars = java_and_jars
        self._write_config()
        cmd = [
            str(java),
            *self.jvm_options,
            # slf4j-simple (see the pom) logs to stderr, which goes to our log file.
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=info",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-Dorg.slf4j.simpleLogger.dateTimeFormat=yyyy-MM-dd'T'HH:mm:ss.SSS",
            "-Dzookeeper.jmx.log4j.disable=true",
            "-cp",
            str(jars.resolve() / "*"),
            _MAIN_CLASS if self.server_id is None else _QUORUM_MAIN_CLASS,
            str(self.config_path.resolve()),
        ]
        self._spawn(cmd, offset=offset, cwd=self.workdir, what=f"ZooKeeper on {self.hosts}")

    def _ready(self, proc: subprocess.Popen[bytes], offset: int) -> bool:
        answer = srvr(self._port, timeout=0.5)
        return answer is not None and answer.startswith("Zookeeper version:")

    def mode(self, timeout: float = 1.0) -> str | None:
        """What ``srvr`` says this server is: ``leader``, ``follower``, ``standalone``; None when not serving."""
        answer = srvr(self._port, timeout=timeout) if self.running else None
        for line in (answer or "").splitlines():
            if line.startswith("Mode:"):
                return line.partition(":")[2].strip()
        return None

    def __repr__(self) -> str:
        return f"ZooKeeperServer(hosts={self.hosts!r}, pid={self.pid})"


def main(argv: list[str] | None = None) -> int:
    """``python -m dispenser_lab.servers.zookeeper [DEST]``: fetch the jars (once) and print where they are."""
    return fetch_command(
        sys.argv[1:] if argv is None else argv,
        what=f"Apache ZooKeeper {ZOOKEEPER_VERSION}",
        default=default_jar_dir(),
        pending=lambda target: POM.is_file() and not is_complete(target, POM),
        fetch=fetch_zookeeper_jars,
    )


if __name__ == "__main__":
    sys.exit(main())
