"""A ZooKeeper ensemble of three (or any odd number of) servers on 127.0.0.1, each killable on its own.

Every member is a :class:`~dispenser_lab.servers.zookeeper.ZooKeeperServer` running ``QuorumPeerMain``
with a ``myid`` file and the ensemble's ``server.N`` lines, from the same jars as the standalone server.
Settings as in ``docs/ha.md`` (the ensemble's configuration): ``tickTime`` 1000 ms, ``initLimit`` 5, ``syncLimit`` 2, a 128 MiB
heap per member. A leader kill costs clients well under a second (an election), and their sessions survive.
"""

from __future__ import annotations

import time
from pathlib import Path

from dispenser_lab.servers.group import ServerGroup
from dispenser_lab.servers.process import LOOPBACK, ServerStartError, free_port
from dispenser_lab.servers.zookeeper import ZooKeeperServer, srvr

__all__ = ["ENSEMBLE_JVM_OPTIONS", "ZooKeeperEnsemble"]

ENSEMBLE_JVM_OPTIONS = ("-Xms16m", "-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")
"""Three JVMs on a small machine: 128 MiB of heap each is plenty for a test's few hundred znodes."""


class ZooKeeperEnsemble(ServerGroup[ZooKeeperServer]):
    """``size`` ZooKeeper servers forming one ensemble; member ``n`` has ``myid`` n.

    Example::

        with ZooKeeperEnsemble(tmp_path) as ensemble:
            client = kazoo.client.KazooClient(ensemble.hosts)
            ensemble.leader().kill()      # kill -9; the others elect a new leader in well under a second
            ensemble.start()              # the killed member rejoins as a follower

    Args:
        workdir: Holds one directory per member (``zk1``, ``zk2``…).
        size: Number of servers (odd: 3 tolerates one failure).
        tick_time_ms: ZooKeeper's time unit; elections and session expiry go in steps of it.
        min_session_timeout_ms: The shortest session a client may ask for (two ticks at least).
        max_session_timeout_ms: The longest session a client may ask for.
        start_timeout: Seconds each member may take to serve (the first start waits for a quorum).
    """

    def __init__(
        self,
        workdir: Path,
        size: int = 3,
        *,
        tick_time_ms: int = 1000,
        min_session_timeout_ms: int = 2000,
        max_session_timeout_ms: int = 40000,
        start_timeout: float = 60.0,
    ) -> None:
        self.workdir = Path(workdir)
        quorum = {n: (free_port(), free_port()) for n in range(1, size + 1)}
        lines = {f"server.{n}": f"{LOOPBACK}:{q}:{e}" for n, (q, e) in quorum.items()}
        # `cons` lists each connection with its session ID: how a test finds the member a client is on.
        settings = {
            "initLimit": "5",
            "syncLimit": "2",
            "4lw.commands.whitelist": "srvr,ruok,stat,mntr,cons",
            **lines,
        }
        super().__init__(
            [
                ZooKeeperServer(
                    self.workdir / f"zk{n}",
                    free_port(),
                    tick_time_ms=tick_time_ms,
                    min_session_timeout_ms=min_session_timeout_ms,
                    max_session_timeout_ms=max_session_timeout_ms,
                    config=settings,
                    server_id=n,
                    jvm_options=ENSEMBLE_JVM_OPTIONS,
                    start_timeout=start_timeout,
                )
                for n in quorum
            ]
        )

    @property
    def hosts(self) -> str:
        """The connection string listing every member: ``127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3``."""
        return ",".join(m.hosts for m in self.members)

    def modes(self) -> dict[int, str | None]:
        """Each member's ``srvr`` mode by number: ``leader``, ``follower``, or None (down or not serving)."""
        return {n: m.mode() for n, m in enumerate(self.members, start=1)}

    def leader(self, timeout: float = 30.0) -> ZooKeeperServer:
        """The member that leads now (asked with ``srvr``), waiting up to ``timeout`` s for an election.

        Raises:
            ServerStartError: No member said it leads within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            for member in self.members:
                if member.mode(timeout=0.5) == "leader":
                    return member
            if time.monotonic() >= deadline:
                raise ServerStartError(f"no ZooKeeper leader after {timeout:g} s: {self.modes()}")
            time.sleep(0.05)

    def member_at(self, port: int) -> ZooKeeperServer:
        """The member whose client port is ``port`` (e.g. the one a client is connected to).

        Raises:
            KeyError: No member listens there.
        """
        for member in self.members:
            if member.port == port:
                return member
        raise KeyError(f"no ensemble member has client port {port}")

    def member_with_session(self, session_id: int) -> ZooKeeperServer | None:
        """The member a client's session is connected to (asked with ``cons``), or None if none lists it."""
        wanted = f"sid=0x{session_id:x},"
        for member in self.running:
            answer = srvr(member.port, word=b"cons")
            if answer is not None and wanted in answer:
                return member
        return None

    def await_session(self, session_id: int, timeout: float = 10.0) -> ZooKeeperServer | None:
        """:meth:`member_with_session`, asked again every 0.1 s for up to ``timeout`` s while no member lists it.

        After an election every follower drops its clients, which reconnect after a back-off: for a moment
        a live session is on no server (seen in a test that asked once, right after the ensemble settled).
        """
        deadline = time.monotonic() + timeout
        while (found := self.member_with_session(session_id)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return found

    def __repr__(self) -> str:
        return f"ZooKeeperEnsemble(hosts={self.hosts!r}, modes={self.modes()})"
