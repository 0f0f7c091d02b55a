"""The session timeout ZooKeeper grants, asked with a throw-away handshake.

kazoo keeps the granted timeout to itself, and the lease registry must time itself by the grant (a server
may grant less than asked for, up to its ``maxSessionTimeout``), so each server is asked once with a connect
request and a close (60 bytes) and the smallest grant is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct

__all__ = ["negotiated_timeout"]

_DEFAULT_PORT = 2181
_INT = struct.Struct("!i")
# Protocol version, last zxid seen, timeout ms, session id, password length.
_CONNECT = struct.Struct("!iqiqi")
_GRANT = struct.Struct("!iiq")  # protocol version, timeout ms, session id
_CLOSE = struct.Struct("!ii")  # xid, op code (closeSession = -11)


def _endpoints(hosts: str) -> list[tuple[str, int]]:
    """``host:port[,host:port...][/chroot]`` as (host, port) pairs (``[v6]:port`` and a bare host too)."""
    pairs = []
    for entry in hosts.partition("/")[0].split(","):
        item = entry.strip()
        if item.startswith("["):  # [v6]:port
            host, _, rest = item[1:].partition("]")
            port = rest.lstrip(":")
        elif item.count(":") == 1:
            host, _, port = item.partition(":")
        else:  # a bare host name, or a bare IPv6 address
            host, port = item, ""
        if host:
            pairs.append((host, int(port or _DEFAULT_PORT)))
    return pairs


async def _granted_ms(host: str, port: int, requested_ms: int) -> int:
    """The session timeout the server at ``host:port`` grants to a request of ``requested_ms``."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        password = bytes(16)
        connect = _CONNECT.pack(0, 0, requested_ms, 0, len(password)) + password + b"\x00"  # read-only: no
        writer.write(_INT.pack(len(connect)) + connect)
        size = _INT.unpack(await reader.readexactly(_INT.size))[0]
        _, granted, session_id = _GRANT.unpack_from(await reader.readexactly(size))
        if session_id:
            # Close the probe's session now rather than leave it to expire (it holds nothing).
            writer.write(_INT.pack(_CLOSE.size) + _CLOSE.pack(1, -11))
            with contextlib.suppress(OSError, asyncio.IncompleteReadError, TimeoutError):
                await asyncio.wait_for(reader.readexactly(_INT.size), 1.0)
        return int(granted)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def negotiated_timeout(hosts: str, requested: float, limit: float) -> float:
    """The smallest session timeout, in seconds, that the servers in ``hosts`` grant for ``requested``.

    Servers that do not answer within ``limit`` seconds are left out (one host of an ensemble may be down).

    Raises:
        OSError: no server answered.
    """
    requested_ms = round(requested * 1000)
    probes = [
        asyncio.ensure_future(_granted_ms(host, port, requested_ms)) for host, port in _endpoints(hosts)
    ]
    if not probes:
        raise OSError(f"no ZooKeeper hosts in {hosts!r}")
    done, pending = await asyncio.wait(probes, timeout=limit)
    for probe in pending:
        probe.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    grants = [p.result() for p in done if p.exception() is None and p.result() > 0]
    if not grants:
        errors = [p.exception() for p in done if p.exception() is not None]
        raise OSError(f"no ZooKeeper server answered a handshake ({errors[0]!r})" if errors else "no answer")
    return min(grants) / 1000
