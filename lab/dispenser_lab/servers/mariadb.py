"""A real MariaDB server on 127.0.0.1 for tests: Leaf's MySQL, from Debian's ``mariadb-server`` package.

``dispenser import-leaf`` reads Leaf's segments from MySQL, and its tests from this server. How it runs
(as a plain child, as ``mysql`` when we are root): ``docs/testing.md`` ("How the servers run").
"""

from __future__ import annotations

import logging
import os
import pwd
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

from dispenser_lab.servers.process import (
    LOOPBACK,
    ServerNotFoundError,
    ServerStartError,
    read_since,
)
from dispenser_lab.servers.server import ServerProcess

log = logging.getLogger(__name__)

__all__ = ["MariaDBInstall", "MariaDBServer", "find_mariadb"]

_RUN_AS = "mysql"
_READY = "ready for connections"
_NAME = re.compile(r"[A-Za-z0-9_]{1,64}")
# Where Debian puts the server (sbin is not on every PATH) and the tools.
_SEARCH = ("/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin")


class MariaDBInstall(NamedTuple):
    """The programs of a MariaDB installation."""

    server: Path
    """``mariadbd``."""
    install_db: Path
    """``mariadb-install-db``, which creates the system tables of a new data directory."""
    client: Path
    """``mariadb``, the command-line client."""


def _which(*names: str) -> Path | None:
    path = os.pathsep.join([os.environ.get("PATH", ""), *_SEARCH])
    for name in names:
        found = shutil.which(name, path=path)
        if found:
            return Path(found)
    return None


def find_mariadb() -> MariaDBInstall:
    """Find MariaDB's server, ``mariadb-install-db`` and client (MySQL's older names are accepted too).

    Raises:
        ServerNotFoundError: one of them is missing (``apt-get install mariadb-server``).
    """
    server = _which("mariadbd", "mysqld")
    install_db = _which("mariadb-install-db", "mysql_install_db")
    client = _which("mariadb", "mysql")
    if server is None or install_db is None or client is None:
        raise ServerNotFoundError(
            "MariaDB is not installed (needs mariadbd, mariadb-install-db and mariadb): "
            "apt-get install mariadb-server"
        )
    return MariaDBInstall(server, install_db, client)


def _is_root() -> bool:
    return os.geteuid() == 0


def _ensure_traversable(path: Path) -> None:
    """Give "others" search permission on every ancestor of ``path`` that lacks it (as root only)."""
    for parent in path.absolute().parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)


class MariaDBServer(ServerProcess[MariaDBInstall]):
    """One ``mariadbd`` on TCP 127.0.0.1, its own data directory, stopped by the PID we started.

    The first :meth:`start` runs ``mariadb-install-db`` (``root`` without a password on the socket and on
    127.0.0.1). Settings are trimmed for a test machine: a small buffer pool, no performance schema.

    Example::

        with MariaDBServer(tmp_path / "mariadb") as db:
            dsn = db.create_database("leaf")  # mysql://root@127.0.0.1:PORT/leaf
            db.sql("CREATE TABLE t (i int)", database="leaf")

    Args:
        basedir: A directory of its own: the data directory, the socket and the log go in it.
        port: TCP port; a free one is picked when omitted.
        start_timeout: Seconds to wait for "ready for connections" (``mariadb-install-db`` not included).
        stop_timeout: Seconds to wait for a clean shutdown after SIGTERM, before SIGKILL.
    """

    def __init__(
        self,
        basedir: Path,
        port: int | None = None,
        *,
        start_timeout: float = 60.0,
        stop_timeout: float = 30.0,
    ) -> None:
        self.basedir = Path(basedir).absolute()
        self.datadir = self.basedir / "data"
        # Temporary tables and files of this server alone, not the shared /tmp: in one CI-like run a
        # bootstrap beside a busy test suite failed on "Error on delete of '/tmp/#sql-temptable-….MAI'".
        self.tmpdir = self.basedir / "tmp"
        super().__init__(port, start_timeout=start_timeout, stop_timeout=stop_timeout)
        self._install: MariaDBInstall | None = None

    # --- addresses -------------------------------------------------------------------------------------

    @property
    def socket_path(self) -> Path:
        """The server's Unix socket (``root`` logs in through it without a password)."""
        return self.basedir / "mariadbd.sock"

    @property
    def log_path(self) -> Path:
        """The server's log (its stderr; appended to across restarts)."""
        return self.basedir / "mariadbd.log"

    def dsn_for(self, database: str, user: str = "root", password: str | None = None) -> str:
        """``mysql://user[:password]@127.0.0.1:PORT/database``, the form ``dispenser import-leaf`` takes."""
        auth = quote(user, safe="")
        if password is not None:
            auth += ":" + quote(password, safe="")
        return f"mysql://{auth}@{LOOPBACK}:{self._port}/{quote(database, safe='')}"

    @property
    def install(self) -> MariaDBInstall:
        """The programs this server runs (found on first use)."""
        if self._install is None:
            self._install = find_mariadb()
        return self._install

    # --- databases -------------------------------------------------------------------------------------

    def create_database(self, name: str) -> str:
        """Create an empty database (utf8mb4) and return its DSN for ``root``."""
        self._check_name(name)
        self.sql(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        return self.dsn_for(name)

    def drop_database(self, name: str) -> None:
        """Drop a database if it exists."""
        self._check_name(name)
        self.sql(f"DROP DATABASE IF EXISTS `{name}`")

    @staticmethod
    def _check_name(name: str) -> None:
        if not _NAME.fullmatch(name):
            raise ValueError(f"not a plain database name: {name!r}")

    def sql(self, statements: str, database: str | None = None) -> str:
        """Run SQL as ``root`` through the socket with the ``mariadb`` client; returns its tab-separated output.

        Raises:
            ServerStartError: the client failed (the message holds its error).
        """
        cmd = [
            str(self.install.client),
            "--no-defaults",
            f"--socket={self.socket_path}",
            "--user=root",
            "--batch",
            "--skip-column-names",
        ]
        if database is not None:
            cmd.append(f"--database={database}")
        result = subprocess.run(
            cmd, input=statements, capture_output=True, text=True, check=False, timeout=60
        )
        if result.returncode != 0:
            raise ServerStartError(
                f"mariadb client failed (exit {result.returncode}): {result.stderr.strip()}"
            )
        return result.stdout

    # --- life cycle ------------------------------------------------------------------------------------

    def _identity(self) -> pwd.struct_passwd | None:
        """The system user the server runs as when we are root (``mysqld`` refuses root), else None (us)."""
        if not _is_root():
            return None
        try:
            return pwd.getpwnam(_RUN_AS)
        except KeyError:
            raise ServerStartError(
                f"MariaDB cannot run as root and there is no system user {_RUN_AS!r} "
                "(the mariadb-server package creates it)"
            ) from None

    def _prepare(self) -> MariaDBInstall:
        install = self.install
        self.basedir.mkdir(parents=True, exist_ok=True)
        self.tmpdir.mkdir(exist_ok=True)
        owner = self._identity()
        if owner is not None:
            _ensure_traversable(self.basedir)
            for path in (self.basedir, *(p for p in self.basedir.rglob("*"))):
                os.chown(path, owner.pw_uid, owner.pw_gid, follow_symlinks=False)
        if not (self.datadir / "mysql").is_dir():
            try:
                self._install_db(install, owner)
            except ServerStartError as failed:
                # Once more from an empty directory: the bootstrap failed once in a CI-like suite run, beside a
                # busy suite, on a temporary table it could not delete (cause not found; see the tmpdir).
                log.warning("%s; trying once more", failed)
                shutil.rmtree(self.datadir, ignore_errors=True)
                self._install_db(install, owner)
        return install

    def _install_db(self, install: MariaDBInstall, owner: pwd.struct_passwd | None) -> None:
        if self.datadir.exists() and any(self.datadir.iterdir()):
            raise ServerStartError(
                f"{self.datadir} is neither empty nor a MariaDB data directory (no mysql/); refusing to initialise it"
            )
        cmd = [
            str(install.install_db),
            "--no-defaults",  # must come first
            f"--datadir={self.datadir}",
            f"--tmpdir={self.tmpdir}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
            "--skip-name-resolve",
            # Passed on to the bootstrapping server: no fsync per statement while it fills the system
            # tables (8 s -> 4.5 s here); a crash during install leaves a directory we refuse to reuse.
            "--innodb-flush-log-at-trx-commit=0",
            "--innodb-doublewrite=0",
            "--innodb-buffer-pool-size=16M",
        ]
        try:
            result = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                check=False,
                timeout=120,
                cwd=self.basedir,
                user=None if owner is None else owner.pw_uid,
                group=None if owner is None else owner.pw_gid,
                extra_groups=None if owner is None else [],
            )
        except subprocess.TimeoutExpired as exc:
            raise ServerStartError(
                f"mariadb-install-db of {self.datadir} took more than {exc.timeout:g} s"
            ) from exc
        if result.returncode != 0:
            raise ServerStartError(
                f"mariadb-install-db of {self.datadir} failed (exit {result.returncode}):\n"
                f"{result.stdout}{result.stderr}"
            )

    def _launch(self, install: MariaDBInstall, offset: int) -> None:
        owner = self._identity()
        cmd = [
            str(install.server),
            "--no-defaults",  # must come first: no /etc/mysql/*.cnf
            f"--datadir={self.datadir}",
            f"--tmpdir={self.tmpdir}",
            f"--port={self._port}",
            f"--bind-address={LOOPBACK}",
            f"--socket={self.socket_path}",
            f"--pid-file={self.basedir / 'mariadbd.pid'}",
            "--skip-name-resolve",
            # A test server: little memory, nothing it does not need.
            "--innodb-buffer-pool-size=16M",
            "--performance-schema=OFF",
            "--skip-log-bin",
        ]
        # mariadbd is our direct child (no mysqld_safe), so its PID is exactly the one we signal.
        self._spawn(
            cmd,
            offset=offset,
            cwd=self.basedir,
            what=f"MariaDB on {LOOPBACK}:{self._port} (data {self.datadir})",
            user=None if owner is None else owner.pw_uid,
            group=None if owner is None else owner.pw_gid,
            extra_groups=None if owner is None else [],
        )

    def _ready(self, proc: subprocess.Popen[bytes], offset: int) -> bool:
        # "mariadbd: ready for connections." is logged once both the TCP port and the socket listen.
        return _READY in read_since(self.log_path, offset)

    def __repr__(self) -> str:
        return f"MariaDBServer(port={self._port}, datadir={str(self.datadir)!r}, pid={self.pid})"
