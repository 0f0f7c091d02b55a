"""A 3-node PostgreSQL cluster managed by Patroni on 127.0.0.1, for failover tests and ``dispenser dev``.

Patroni from PyPI (:data:`PATRONI_REQUIREMENTS`) in a cached virtual environment, Debian's PostgreSQL, and
ZooKeeper as the DCS. The users it runs as, its failover speed and how a node is killed:
``docs/testing.md`` ("How the servers run").

This module runs the nodes and the cluster (start, stop, kill, wait for a state). The parts:
:mod:`~dispenser_lab.servers.patroni_env` (the virtual environment, PostgreSQL's binaries) and
:mod:`~dispenser_lab.servers.patroni_config` (a node's ``patroni.yml``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dispenser_lab.servers.patroni_config import POSTGRES_USER, node_config, write_node_config
from dispenser_lab.servers.patroni_env import (
    PATRONI_REQUIREMENTS,
    PATRONI_VERSION,
    SYSTEM_PYTHON,
    default_venv_dir,
    main,
    patroni_venv,
    pg_bindir,
)
from dispenser_lab.servers.process import (
    LOOPBACK,
    DevServerError,
    ProcessId,
    ServerStartError,
    children_of,
    command_line,
    free_port,
    kill_processes,
    process_id,
    wait_gone,
)
from dispenser_lab.servers.server import ServerProcess
from dispenser_lab.servers.zookeeper import ZooKeeperServer

__all__ = [
    "PATRONI_REQUIREMENTS",
    "PATRONI_VERSION",
    "SYSTEM_PYTHON",
    "Member",
    "PatroniCluster",
    "PatroniNode",
    "default_venv_dir",
    "main",
    "patroni_venv",
]


def _http(
    port: int, path: str, *, method: str = "GET", body: object = None, timeout: float = 2.0
) -> tuple[int, Any]:
    """Call a node's REST API; ``(status, parsed JSON or None)``, status 0 when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{LOOPBACK}:{port}{path}", data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    except (OSError, TimeoutError):
        return 0, None
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None


@dataclass(frozen=True, slots=True)
class Member:
    """One node as Patroni's ``/cluster`` reports it."""

    name: str
    role: str
    """``leader``, ``sync_standby``, ``replica`` (or ``standby_leader``, ``quorum_standby``)."""
    state: str
    """``running`` (the leader), ``streaming`` (a replica receiving WAL), ``stopped``, …"""
    timeline: int | None
    lag: int | None
    """Bytes of WAL behind the leader (replicas), or None."""


class PatroniNode(ServerProcess[Path]):
    """One Patroni process and the PostgreSQL it manages; :attr:`port` is PostgreSQL's.

    Args:
        workdir: The node's directory (config, data directory ``data/``, socket, logs), owned by
            ``postgres`` when we are root.
        name: The member name.
        bootstrap: Patroni's ``bootstrap.dcs`` section (used by whichever node bootstraps the cluster).
        scope: The cluster name (its ZooKeeper path is ``/service/<scope>``).
        zookeeper_hosts: ``host:port,…`` of the DCS.
        start_timeout: Seconds to wait for Patroni's REST API.
    """

    def __init__(
        self,
        workdir: Path,
        name: str,
        *,
        scope: str,
        zookeeper_hosts: str,
        bootstrap: Mapping[str, Any],
        start_timeout: float = 60.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.workdir = Path(workdir).absolute()
        super().__init__(None, start_timeout=start_timeout, stop_timeout=stop_timeout)
        self.name = name
        self.scope = scope
        self.zookeeper_hosts = zookeeper_hosts
        self.bootstrap = dict(bootstrap)
        self.rest_port = free_port()

    @property
    def log_path(self) -> Path:
        """Patroni's log (and PostgreSQL's, which Patroni's postmaster inherits)."""
        return self.workdir / "patroni.log"

    @property
    def data_dir(self) -> Path:
        """PostgreSQL's data directory."""
        return self.workdir / "data"

    @property
    def config_path(self) -> Path:
        """The node's Patroni configuration (JSON, which YAML reads as is)."""
        return self.workdir / "patroni.yml"

    def dsn_for(self, database: str = "postgres") -> str:
        """DSN of this node alone."""
        return f"postgresql://postgres@{LOOPBACK}:{self.port}/{database}"

    def api(self, path: str, *, method: str = "GET", body: object = None) -> tuple[int, Any]:
        """Call this node's REST API: ``(HTTP status, JSON body)``; status 0 when it does not answer."""
        return _http(self.rest_port, path, method=method, body=body)

    def sql(self, query: str, database: str = "postgres") -> str | None:
        """Run one query with ``psql`` on this node; its unaligned output, or None if it failed."""
        cmd = [str(pg_bindir() / "psql"), "-XAtq", "-h", LOOPBACK, "-p", str(self.port), "-U", "postgres",
               "-d", database, "-c", query]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=10, check=False)
        except subprocess.TimeoutExpired:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    def postmaster(self) -> ProcessId | None:
        """The running postmaster of this node (from ``postmaster.pid``), or None."""
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0].strip()
        except (FileNotFoundError, PermissionError):
            return None
        if not first.isdigit():
            return None
        found = process_id(int(first))
        if found is None or "postgres" not in command_line(found[0]):
            return None  # a stale file, or the PID now belongs to someone else
        return found

    def wal_processes(self, kind: str) -> list[ProcessId]:
        """This node's ``walsender`` or ``walreceiver`` processes (children of its postmaster)."""
        postmaster = self.postmaster()
        if postmaster is None:
            return []
        return [child for child in children_of(postmaster[0]) if f" {kind}" in command_line(child[0])]

    def reset(self) -> None:
        """Throw away a stopped node's data: its next start copies the leader afresh (``pg_basebackup``).

        Quicker than the crash recovery and ``pg_rewind`` a killed node's data would need.
        """
        if self.running:
            raise DevServerError(f"{self.name} is running; stop or kill it first")
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def _prepare(self) -> Path:
        patroni = patroni_venv()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = node_config(
            scope=self.scope,
            name=self.name,
            zookeeper_hosts=self.zookeeper_hosts,
            bootstrap=self.bootstrap,
            rest_port=self.rest_port,
            port=self.port,
            workdir=self.workdir,
            data_dir=self.data_dir,
            bin_dir=pg_bindir(),
        )
        write_node_config(self.config_path, config, self.workdir)
        return patroni

    def _launch(self, patroni: Path, offset: int) -> None:
        user: int | None = None
        group: int | None = None
        extra: list[int] | None = None
        if os.geteuid() == 0:
            entry = pwd.getpwnam(POSTGRES_USER)
            user, group, extra = entry.pw_uid, entry.pw_gid, []
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(self.workdir)}
        self._spawn(
            [str(patroni), str(self.config_path)],
            offset=offset,
            cwd=self.workdir,
            what=f"Patroni node {self.name} (REST {LOOPBACK}:{self.rest_port})",
            env=env,
            user=user,
            group=group,
            extra_groups=extra,
        )

    def _ready(self, proc: subprocess.Popen[bytes], offset: int) -> bool:
        return self.api("/liveness")[0] == 200

    def _stop_signals(self) -> Sequence[tuple[signal.Signals, float]]:
        """SIGTERM: Patroni stops its PostgreSQL (fast shutdown) and exits."""
        return [(signal.SIGTERM, self.stop_timeout)]

    def _kill_process(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL Patroni and its postmaster together (a machine dying), then reap the backends."""
        postmaster = self.postmaster()
        tree = [] if postmaster is None else children_of(postmaster[0])
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        if postmaster is not None:
            kill_processes([postmaster])
        proc.wait()
        if postmaster is not None:
            wait_gone([postmaster], timeout=5.0)
        leftovers = wait_gone(tree, timeout=5.0)
        if leftovers:
            kill_processes(leftovers)
            wait_gone(leftovers, timeout=5.0)

    def __repr__(self) -> str:
        return f"PatroniNode({self.name!r}, port={self.port}, rest={self.rest_port}, pid={self.pid})"


class PatroniCluster:
    """Three (or ``nodes``) Patroni nodes over one DCS, with strict synchronous replication by default.

    Example::

        with PatroniCluster(tmp_path / "ha") as cluster:
            conn = await asyncpg.connect(cluster.dsn)   # reaches the primary, whichever it is
            cluster.kill_leader()
            cluster.wait_leader(other_than=...)

    Args:
        workdir: Holds each node's directory and, without ``zookeeper_hosts``, the ZooKeeper's.
        nodes: How many nodes.
        synchronous: ``"strict"`` (``synchronous_mode`` + ``synchronous_mode_strict``: a commit waits for a
            standby, and writes stop when none is left), ``"sync"`` (non-strict) or ``"async"``.
        zookeeper_hosts: An existing ZooKeeper (ensemble) to use; omitted, the cluster runs its own single
            server, capping sessions at ``session_cap_ms``, with ``failsafe_mode`` on.
        ttl: Patroni's leader lease, seconds (Patroni raises anything below 20 to 20).
        session_cap_ms: ``maxSessionTimeout`` of the cluster's own ZooKeeper (None: ZooKeeper's 30 s
            default as started here, so the ttl rules).
        failsafe: ``failsafe_mode`` (default: on with the cluster's own single ZooKeeper).
        scope: The cluster's name in the DCS.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        nodes: int = 3,
        synchronous: str = "strict",
        zookeeper_hosts: str | None = None,
        ttl: int = 20,
        session_cap_ms: int | None = 6000,
        failsafe: bool | None = None,
        scope: str = "leafha",
        loop_wait: int = 2,
        retry_timeout: int = 5,
    ) -> None:
        if synchronous not in ("strict", "sync", "async"):
            raise ValueError(f"synchronous must be 'strict', 'sync' or 'async', not {synchronous!r}")
        self.workdir = Path(workdir).absolute()
        self.synchronous = synchronous
        self.zookeeper: ZooKeeperServer | None = None
        if zookeeper_hosts is None:
            self.zookeeper = ZooKeeperServer(
                self.workdir / "zookeeper",
                tick_time_ms=500,
                min_session_timeout_ms=1000,
                max_session_timeout_ms=session_cap_ms or 30000,
            )
            zookeeper_hosts = self.zookeeper.hosts
        self.zookeeper_hosts = zookeeper_hosts
        failsafe = self.zookeeper is not None if failsafe is None else failsafe
        self.bootstrap: dict[str, Any] = {
            "ttl": ttl,
            "loop_wait": loop_wait,
            "retry_timeout": retry_timeout,
            "maximum_lag_on_failover": 1048576,
            "failsafe_mode": failsafe,
            **self._sync_settings(synchronous),
            "postgresql": {
                "use_pg_rewind": True,
                "use_slots": True,
                "parameters": {
                    "wal_level": "replica",
                    "hot_standby": "on",
                    "max_wal_senders": 10,
                    "max_replication_slots": 10,
                    "wal_log_hints": "on",
                    "wal_keep_size": "128MB",
                    "synchronous_commit": "on",
                    "max_connections": 100,
                },
            },
        }
        self.nodes = [
            PatroniNode(
                self.workdir / f"node{i}",
                f"node{i}",
                scope=scope,
                zookeeper_hosts=zookeeper_hosts,
                bootstrap=self.bootstrap,
            )
            for i in range(1, nodes + 1)
        ]

    @staticmethod
    def _sync_settings(synchronous: str) -> dict[str, bool]:
        return {
            "synchronous_mode": synchronous != "async",
            "synchronous_mode_strict": synchronous == "strict",
        }

    # --- addresses -------------------------------------------------------------------------------------

    @property
    def hosts(self) -> str:
        """``127.0.0.1:P1,127.0.0.1:P2,…``: every node's PostgreSQL."""
        return ",".join(f"{LOOPBACK}:{node.port}" for node in self.nodes)

    @property
    def dsn(self) -> str:
        """A DSN naming every node that connects to whichever is the primary (``target_session_attrs``)."""
        return self.dsn_for("postgres")

    def dsn_for(self, database: str, target_session_attrs: str = "read-write") -> str:
        """The multi-host DSN of ``database``."""
        return f"postgresql://postgres@{self.hosts}/{database}?target_session_attrs={target_session_attrs}"

    def node(self, name: str) -> PatroniNode:
        """The node called ``name``."""
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    # --- life cycle ------------------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        """Start the DCS (if ours) and every node, and wait until :meth:`wait_healthy`.

        Raises:
            ServerNotFoundError: PostgreSQL, the system Python or Java is missing.
            ServerStartError: the cluster did not come up in time (the message holds the nodes' log tails).
        """
        if self.zookeeper is not None:
            self.zookeeper.start()
        for node in self.nodes:
            node.start()
        self.wait_healthy(timeout)

    def stop(self) -> None:
        """Kill every node and the ZooKeeper (nothing to keep: a test cluster is thrown away)."""
        for node in self.nodes:
            node.kill()
        if self.zookeeper is not None:
            self.zookeeper.kill()

    def __enter__(self) -> PatroniCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # --- state -----------------------------------------------------------------------------------------

    def members(self) -> list[Member]:
        """The members as a running node's ``/cluster`` reports them (empty when no node answers)."""
        for node in self.nodes:
            if not node.running:
                continue
            status, body = node.api("/cluster")
            if status == 200 and isinstance(body, dict):
                return [
                    Member(
                        name=m["name"],
                        role=m.get("role", ""),
                        state=m.get("state", ""),
                        timeline=m.get("timeline"),
                        lag=m.get("lag") if isinstance(m.get("lag"), int) else None,
                    )
                    for m in body.get("members", [])
                ]
        return []

    def leader(self) -> PatroniNode | None:
        """The node that leads and whose PostgreSQL is out of recovery (writable), or None.

        Patroni's ``/primary`` answers 200 as soon as the node holds the leader lock, a moment before its
        PostgreSQL is promoted; a client that connects then finds only standbys. So PostgreSQL is asked too.
        """
        for node in self.nodes:
            if (
                node.running
                and node.api("/primary")[0] == 200
                and node.sql("SELECT pg_is_in_recovery()") == "f"
            ):
                return node
        return None

    def healthy(self) -> bool:
        """Whether a leader runs and every running node streams from it.

        Unless the cluster replicates asynchronously, one of the replicas must also be the synchronous standby.
        """
        members = {m.name: m for m in self.members()}
        running = [n for n in self.nodes if n.running]
        leader = self.leader()
        if leader is None or len(members) < len(running):
            return False
        replicas = [members.get(n.name) for n in running if n is not leader]
        if any(m is None or m.state != "streaming" for m in replicas):
            return False
        wants_sync = self.synchronous != "async" and replicas
        return not wants_sync or any(m is not None and m.role == "sync_standby" for m in replicas)

    def wait_healthy(self, timeout: float = 120.0) -> PatroniNode:
        """Wait until :meth:`healthy`; return the leader.

        Raises:
            ServerStartError: not within ``timeout`` seconds (with the members and the log tails).
        """
        self._wait(self.healthy, timeout, "a leader with every node streaming")
        leader = self.leader()
        assert leader is not None
        return leader

    def wait_replayed(self, timeout: float = 30.0) -> None:
        """Wait until every running replica reports no lag (it has replayed all the leader wrote)."""

        def replayed() -> bool:
            members = self.members()
            running = {n.name for n in self.nodes if n.running}
            replicas = [m for m in members if m.name in running and m.role != "leader"]
            return len(replicas) == len(running) - 1 and all(m.lag == 0 for m in replicas)

        self._wait(replayed, timeout, "every replica caught up")

    def wait_leader(self, *, other_than: PatroniNode | None = None, timeout: float = 60.0) -> PatroniNode:
        """Wait until a node other than ``other_than`` is the writable leader, and return it."""

        def found() -> bool:
            leader = self.leader()
            return leader is not None and leader is not other_than

        self._wait(found, timeout, f"a leader other than {other_than.name if other_than else None}")
        leader = self.leader()
        assert leader is not None
        return leader

    def _wait(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n.name} ({n.log_path}):\n" + _tail(n.log_path) for n in self.nodes)
                raise ServerStartError(
                    f"Patroni cluster: no {what} after {timeout:g} s; members {self.members()}\n{tails}"
                )
            time.sleep(0.1)

    # --- faults ----------------------------------------------------------------------------------------

    def kill_leader(self) -> PatroniNode:
        """SIGKILL the leader's Patroni and PostgreSQL process tree; return the node (stopped)."""
        leader = self.leader()
        if leader is None:
            raise DevServerError("no leader to kill")
        leader.kill()
        return leader

    def set_synchronous(self, synchronous: str) -> None:
        """Switch the replication mode at run time (``PATCH /config``) and wait until it is in force."""
        settings = self._sync_settings(synchronous)
        leader = self.wait_leader()
        status, body = leader.api("/config", method="PATCH", body=settings)
        if status != 200:
            raise DevServerError(f"PATCH /config on {leader.name} answered {status}: {body}")
        self.synchronous = synchronous

        def applied() -> bool:
            leader = self.leader()
            if leader is None:
                return False
            roles = {m.role for m in self.members()}
            return ("sync_standby" in roles) == (synchronous != "async") and self.healthy()

        self._wait(applied, 60.0, f"replication mode {synchronous!r} in force")


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"<unreadable: {exc}>"


if __name__ == "__main__":
    sys.exit(main())
