"""Datacenters on one machine: a ``nats-server`` per datacenter, the datacenters joined by gateways.

A NATS super-cluster: each datacenter is a cluster of its own (here one server, named after the
datacenter), and every server lists every gateway, its own included. A queue group is served in the
requester's own datacenter while it has a member there, else across a gateway; plain subscriptions (the
snowflake peer checks) hear every datacenter. The monitoring port tells when the gateways are up
(``/gatewayz``); they take about a second after start. See docs/datacenters.md.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from dispenser_lab.servers.group import ServerGroup
from dispenser_lab.servers.nats import NatsServer
from dispenser_lab.servers.process import LOOPBACK, ServerStartError, free_port

__all__ = ["NatsGateways", "gateway_config"]


def gateway_config(
    name: str,
    listen: int,
    gateways: dict[str, int],
    monitor: int | None = None,
    *,
    ping_interval: float | None = None,
    ping_max: int | None = None,
) -> str:
    """One datacenter's server configuration: its name, and a gateway to every datacenter (its own too).

    Args:
        name: The datacenter (the gateway's name; a cluster of several servers must have the same name).
        listen: The gateway port of this server.
        gateways: Every datacenter's gateway port, by name.
        monitor: The monitoring port (``/gatewayz``), if any.
        ping_interval: Seconds between the server's PINGs to a silent client (nats-server's default: 2
            minutes).
        ping_max: PINGs left unanswered before the server closes the connection (default 2). A frozen
            worker keeps its queue subscription until then: ``ping_interval * (ping_max + 1)`` at most
            (docs/datacenters.md).
    """
    urls = ", ".join(f'{{name: "{dc}", url: "nats://{LOOPBACK}:{port}"}}' for dc, port in gateways.items())
    http = f'http: "{LOOPBACK}:{monitor}"\n' if monitor is not None else ""
    if ping_interval is not None:
        http += f'ping_interval: "{round(ping_interval * 1000)}ms"\n'
    if ping_max is not None:
        http += f"ping_max: {ping_max}\n"
    return (
        f"server_name: {name}-1\n"
        f"{http}"
        "gateway {\n"
        f'  name: "{name}"\n'
        f'  listen: "{LOOPBACK}:{listen}"\n'
        f"  gateways: [{urls}]\n"
        "}\n"
    )


class NatsGateways(ServerGroup[NatsServer]):
    """One NATS server per datacenter, joined by gateways; member ``n`` is datacenter ``datacenters[n-1]``.

    Example::

        with NatsGateways(tmp_path, ("dc-a", "dc-b")) as dcs:
            a = await nats.connect(dcs.url_of("dc-a"))
            b = await nats.connect(dcs.url_of("dc-b"))

    Args:
        workdir: Holds one directory per datacenter (named after it).
        datacenters: The datacenters' names (gateway and cluster names).
        start_timeout: Seconds each server may take to start, and the gateways to connect.
        ping_interval: The servers' ``ping_interval`` in seconds (None: nats-server's 2 minutes).
        ping_max: The servers' ``ping_max`` (None: nats-server's 2). See :func:`gateway_config`.
    """

    def __init__(
        self,
        workdir: Path,
        datacenters: Sequence[str] = ("dc-a", "dc-b"),
        *,
        start_timeout: float = 20.0,
        ping_interval: float | None = None,
        ping_max: int | None = None,
    ) -> None:
        if len(set(datacenters)) != len(datacenters) or len(datacenters) < 2:
            raise ValueError(f"need two or more distinct datacenters, got {list(datacenters)}")
        self.workdir = Path(workdir)
        self.datacenters = list(datacenters)
        self.start_timeout = start_timeout
        gateway_ports = {dc: free_port() for dc in self.datacenters}
        self.monitor_ports = {dc: free_port() for dc in self.datacenters}
        members = [
            NatsServer(
                self.workdir / dc,
                free_port(),
                config=gateway_config(
                    dc,
                    gateway_ports[dc],
                    gateway_ports,
                    self.monitor_ports[dc],
                    ping_interval=ping_interval,
                    ping_max=ping_max,
                ),
                start_timeout=start_timeout,
            )
            for dc in self.datacenters
        ]
        super().__init__(members)

    def of(self, datacenter: str) -> NatsServer:
        """The server of ``datacenter``."""
        return self.members[self.datacenters.index(datacenter)]

    def url_of(self, datacenter: str) -> str:
        """The client URL of ``datacenter``'s server."""
        return self.of(datacenter).url

    def start(self) -> None:
        """Start the servers that are not running and wait until every running one has its gateways.

        Raises:
            ServerStartError: A server did not start, or the gateways were not all up in time.
        """
        super().start()
        self.wait_connected()

    def gateways(self, datacenter: str) -> set[str]:
        """The datacenters ``datacenter``'s server has both an outbound and an inbound gateway with."""
        port = self.monitor_ports[datacenter]
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/gatewayz", timeout=1.0) as answer:
                gatewayz = json.load(answer)
        except OSError:
            return set()
        outbound = set(gatewayz.get("outbound_gateways") or {})
        inbound = set(gatewayz.get("inbound_gateways") or {})
        return outbound & inbound

    def wait_connected(self) -> None:
        """Wait until each running server has gateways both ways with each other running one.

        Raises:
            ServerStartError: Not so after ``start_timeout`` seconds.
        """
        deadline = time.monotonic() + self.start_timeout
        while True:
            running = [dc for dc, m in zip(self.datacenters, self.members, strict=True) if m.running]
            missing = {dc: set(running) - {dc} - self.gateways(dc) for dc in running}
            if not any(missing.values()):
                return
            if time.monotonic() >= deadline:
                raise ServerStartError(f"NATS gateways incomplete after {self.start_timeout:g} s: {missing}")
            time.sleep(0.05)

    def __repr__(self) -> str:
        return f"NatsGateways({dict(zip(self.datacenters, (m.url for m in self.members), strict=True))!r})"
