"""A NATS cluster of three (or more) ``nats-server`` processes on 127.0.0.1, routed to each other.

Each member is a :class:`~dispenser_lab.servers.nats.NatsServer` with a ``cluster`` block (a route to
every other member, on loopback) and the monitoring port, which tells when the routes are up (``/routez``).
Clients given all the members' URLs reconnect to another member in milliseconds when theirs dies
(``docs/ha.md``, measured); requests in flight at that moment are lost.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from dispenser_lab.servers.group import ServerGroup
from dispenser_lab.servers.nats import NatsServer
from dispenser_lab.servers.process import LOOPBACK, ServerStartError, free_port

__all__ = ["NatsCluster"]


def _cluster_config(name: str, number: int, listen: int, routes: list[int], monitor: int) -> str:
    """A member's configuration: its name, the monitoring port, and routes to the other members."""
    route_urls = ", ".join(f'"nats-route://{LOOPBACK}:{port}"' for port in routes)
    return (
        f"server_name: {name}-{number}\n"
        f'http: "{LOOPBACK}:{monitor}"\n'
        "cluster {\n"
        f"  name: {name}\n"
        f'  listen: "{LOOPBACK}:{listen}"\n'
        f"  routes: [{route_urls}]\n"
        "}\n"
    )


class NatsCluster(ServerGroup[NatsServer]):
    """``size`` NATS servers forming one cluster; member ``n`` is named ``<name>-<n>``.

    Example::

        with NatsCluster(tmp_path) as cluster:
            nc = await nats.connect(cluster.urls)                # all members: reconnects to another
            cluster.member_at(nc.connected_url.port).kill()      # kill -9 of the client's member

    Args:
        workdir: Holds one directory per member (``nats1``, ``nats2``…).
        size: Number of servers.
        name: The cluster's name.
        start_timeout: Seconds each member may take to start, and the cluster to route fully.
    """

    def __init__(
        self, workdir: Path, size: int = 3, *, name: str = "leaf", start_timeout: float = 20.0
    ) -> None:
        self.workdir = Path(workdir)
        self.start_timeout = start_timeout
        cluster_ports = [free_port() for _ in range(size)]
        self.monitor_ports = [free_port() for _ in range(size)]
        members = []
        for n in range(1, size + 1):
            routes = [port for i, port in enumerate(cluster_ports, start=1) if i != n]
            config = _cluster_config(name, n, cluster_ports[n - 1], routes, self.monitor_ports[n - 1])
            members.append(
                NatsServer(self.workdir / f"nats{n}", free_port(), config=config, start_timeout=start_timeout)
            )
        super().__init__(members)

    @property
    def urls(self) -> list[str]:
        """Every member's client URL, in member order."""
        return [m.url for m in self.members]

    @property
    def url(self) -> str:
        """The members' URLs comma-separated, as ``nats.url`` takes them."""
        return ",".join(self.urls)

    def start(self) -> None:
        """Start the members that are not running and wait until every running member routes to all others.

        Raises:
            ServerStartError: A member did not start, or the routes were not all up in time.
        """
        super().start()
        self.wait_routed()

    def routes(self, number: int) -> set[str]:
        """Names of the members member ``number`` has a route to (empty when it does not answer)."""
        port = self.monitor_ports[number - 1]
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/routez", timeout=1.0) as answer:
                routez = json.load(answer)
        except OSError:
            return set()
        return {str(route.get("remote_name", route.get("remote_id"))) for route in routez.get("routes") or []}

    def wait_routed(self) -> None:
        """Wait until each running member has a route to each other running member.

        Raises:
            ServerStartError: Not so after ``start_timeout`` seconds.
        """
        deadline = time.monotonic() + self.start_timeout
        while True:
            running = {n for n, m in enumerate(self.members, start=1) if m.running}
            missing = {n: len(running) - 1 - len(self.routes(n)) for n in running}
            if all(count <= 0 for count in missing.values()):
                return
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"NATS cluster routes incomplete after {self.start_timeout:g} s: {missing}"
                )
            time.sleep(0.05)

    def member_at(self, port: int) -> NatsServer:
        """The member whose client port is ``port`` (a client's ``connected_url.port``).

        Raises:
            KeyError: No member listens there.
        """
        for member in self.members:
            if member.port == port:
                return member
        raise KeyError(f"no cluster member has client port {port}")

    def __repr__(self) -> str:
        return f"NatsCluster(url={self.url!r}, running={[m.pid for m in self.members]})"
