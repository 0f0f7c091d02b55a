"""Connecting to NATS with the configured servers and credentials (user/password, token, nkey, creds, TLS)."""

from __future__ import annotations

import logging
import ssl

import nats
from nats.aio.client import Client

from dispenser.config import NatsConfig, redact

__all__ = ["connect", "server_version"]

log = logging.getLogger(__name__)


async def connect(config: NatsConfig, name: str = "leaf-dispenser") -> Client:
    """Connect to NATS with the configured servers and credentials; reconnects forever once connected.

    Raises:
        OSError: no server could be reached within ``connect_timeout`` (the message names the URLs).
    """
    tls: ssl.SSLContext | None = None
    if config.tls_ca or config.tls_cert:
        tls = ssl.create_default_context(cafile=config.tls_ca)
        if config.tls_cert:
            tls.load_cert_chain(config.tls_cert, config.tls_key)

    async def on_error(exc: Exception) -> None:
        log.warning("NATS error: %s", exc)

    async def on_disconnect() -> None:
        if not (nc.is_closed or nc.is_draining):  # a disconnect we asked for is not news
            log.warning("disconnected from NATS; reconnecting")

    async def on_reconnect() -> None:
        log.info(
            "reconnected to NATS at %s", redact(str(nc.connected_url.geturl() if nc.connected_url else ""))
        )

    servers = [url.strip() for url in config.url.split(",") if url.strip()]
    try:
        nc = await nats.connect(
            servers=servers,
            name=name,
            user=config.user,
            password=config.password,
            token=config.token,
            user_credentials=config.creds_file,
            nkeys_seed=config.nkeys_seed,
            tls=tls,
            connect_timeout=config.connect_timeout,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
        )
    except Exception as exc:
        shown = ", ".join(redact(s) for s in servers)
        raise OSError(f"cannot connect to NATS at {shown}: {exc or type(exc).__name__}") from exc
    return nc


def server_version(nc: Client) -> str:
    """The version the connected server announced (``2.10.22``), or ``?`` if it sent none or an odd one."""
    # nats-py's public ServerVersion has no string accessor (its repr is "<nats server v…>"): rebuild it.
    version = nc.connected_server_version
    try:
        text = f"{version.major}.{version.minor}.{version.patch}"
    except ValueError:  # not semantic versioning: nats-py refuses to parse it
        return "?"
    if text == "0.0.0":  # nats-py's "0.0.0-unknown": no server, or it sent no version
        return "?"
    if version.prerelease:
        text += f"-{version.prerelease}"
    if version.build:
        text += f"+{version.build}"
    return text
