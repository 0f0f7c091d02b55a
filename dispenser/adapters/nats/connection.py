"""Connecting to NATS with the configured servers and credentials (user/password, token, nkey, creds, TLS)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from typing import Any, TypeAlias

from nats.aio.client import Client

from dispenser.config import NatsConfig, redact

__all__ = ["Connection", "connect", "drain", "server_version"]

Connection: TypeAlias = Client
"""A NATS connection, as the wiring holds it (so that it need not import the driver)."""

log = logging.getLogger(__name__)

_DRAIN_TIMEOUT = 3
"""Seconds a drain (at stop) waits for the server: nats-py's default of 30 would outlast a SIGTERM's grace."""


async def connect(
    config: NatsConfig,
    name: str = "leaf-dispenser",
    *,
    deadline: float | None = None,
    on_retry: Callable[[Exception], None] | None = None,
) -> Client:
    """Connect to NATS with the configured servers and credentials; reconnects forever once connected.

    The first connection is tried, server after server, until ``deadline`` seconds have passed (each
    attempt bounded by ``connect_timeout``: a server that accepts TCP and never answers costs one
    attempt, not the whole deadline). A refused password or certificate ends it at once: trying again will
    not help. Once connected, a connection whose server went silent is noticed after
    ``ping_interval`` x ``max_outstanding_pings`` seconds and replaced by one to another server.

    Args:
        config: servers, credentials and timeouts.
        name: the connection's name, as the server's monitoring shows it.
        deadline: seconds to keep trying at the start; default ``config.start_deadline``.
        on_retry: called with the cause of each failed attempt at the start (the worker logs the first).

    Raises:
        OSError: no server could be reached within ``deadline``, or one refused the credentials; the
            message names NATS, the URLs and the last cause.
    """
    if deadline is None:
        deadline = config.start_deadline
    servers = [url.strip() for url in config.url.split(",") if url.strip()]
    shown = ", ".join(redact(s) for s in servers)
    nc = Client()
    callbacks = _Callbacks(nc, on_retry)
    connecting = asyncio.ensure_future(nc.connect(**_options(config, servers, name, callbacks)))
    refused = callbacks.refused
    try:
        racing: set[asyncio.Future[Any]] = {connecting, refused}
        done, _ = await asyncio.wait(racing, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
        if connecting in done:
            connecting.result()  # the connection, or nats-py's own error (a bad URL)
            callbacks.connected = True
            return nc
        failures = callbacks.failures
        cause = refused.result() if refused in done else (failures[-1] if failures else None)
        within = "" if refused in done else f" within {deadline:g} s"
        raise OSError(f"cannot connect to NATS at {shown}{within}: {_describe(cause)}")
    except OSError:
        raise
    except Exception as exc:
        raise OSError(f"cannot connect to NATS at {shown}: {_describe(exc)}") from exc
    finally:
        if not callbacks.connected:  # given up, failed or cancelled: leave no socket or task behind
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            with contextlib.suppress(Exception):
                await nc.close()


def _tls_context(config: NatsConfig) -> ssl.SSLContext | None:
    """The TLS context of the configured CA and client certificate; ``None`` when neither is set."""
    if not (config.tls_ca or config.tls_cert):
        return None
    tls = ssl.create_default_context(cafile=config.tls_ca)
    if config.tls_cert:
        tls.load_cert_chain(config.tls_cert, config.tls_key)
    return tls


def _options(config: NatsConfig, servers: list[str], name: str, callbacks: _Callbacks) -> dict[str, Any]:
    """nats-py's ``Client.connect`` arguments: servers, credentials, timeouts, reconnecting forever."""
    return {
        "servers": servers,
        "name": name,
        "user": config.user,
        "password": config.password,
        "token": config.token,
        "user_credentials": config.creds_file,
        "nkeys_seed": config.nkeys_seed,
        "tls": _tls_context(config),
        "connect_timeout": config.connect_timeout,  # seconds, a float is fine
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "ping_interval": config.ping_interval,
        "max_outstanding_pings": config.max_outstanding_pings,
        # Bounds a stop against a server that went silent (drain waits for its acknowledgement).
        "drain_timeout": _DRAIN_TIMEOUT,
        "error_cb": callbacks.on_error,
        "disconnected_cb": callbacks.on_disconnect,
        "reconnected_cb": callbacks.on_reconnect,
    }


class _Callbacks:
    """nats-py's error, disconnect and reconnect callbacks of one connection, and what they saw at the start.

    Until :attr:`connected`, errors are collected (and handed to ``on_retry``), and a refused credential
    settles :attr:`refused`; afterwards, one warning per outage, the rest at debug.
    """

    def __init__(self, nc: Client, on_retry: Callable[[Exception], None] | None) -> None:
        self._nc = nc
        self._on_retry = on_retry
        self.connected = False
        self.failures: list[Exception] = []
        """The errors of the attempts at the start, last last."""
        self.refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
        """Set to the first error that refused the credentials at the start: trying again will not help."""
        self._outage_logged = False

    async def on_error(self, exc: Exception) -> None:
        """A failed attempt at the start, or an error of the connection once connected."""
        if not self.connected:  # the start: the caller says what it needs to, once (see on_retry)
            self.failures.append(exc)
            if self._on_retry is not None:
                self._on_retry(exc)
            if _refused(exc) and not self.refused.done():
                self.refused.set_result(exc)
            return
        # One line per outage, not one per reconnect attempt (two a second): the rest at debug.
        if self._outage_logged:
            log.debug("NATS error: %s", _describe(exc))
        else:
            self._outage_logged = True
            log.warning("NATS error: %s", _describe(exc))

    async def on_disconnect(self) -> None:
        """Warn of a disconnect, unless it was asked for (closing, draining)."""
        if not (self._nc.is_closed or self._nc.is_draining):  # a disconnect we asked for is not news
            log.warning("disconnected from NATS; reconnecting")

    async def on_reconnect(self) -> None:
        """Log the server reconnected to; the next error starts a new outage."""
        self._outage_logged = False
        nc = self._nc
        log.info(
            "reconnected to NATS at %s", redact(str(nc.connected_url.geturl() if nc.connected_url else ""))
        )


async def drain(nc: Client) -> None:
    """Drain the connection (its subscriptions, then what is left to publish) and close it, in bounded time.

    nats-py's own drain can take its ``drain_timeout`` and then a flush of up to 10 s more against a server
    that went silent; past :data:`_DRAIN_TIMEOUT` + 1 s the connection is closed without waiting. A
    connection already closed or reconnecting is no failure.
    """
    try:
        await asyncio.wait_for(nc.drain(), _DRAIN_TIMEOUT + 1)
    except TimeoutError:
        log.warning("NATS did not acknowledge the drain within %g s: closing without it", _DRAIN_TIMEOUT + 1)
    except Exception as exc:  # closed, or reconnecting: nothing left to drain
        log.debug("NATS drain: %s", exc or type(exc).__name__)
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


def _refused(exc: Exception) -> bool:
    """A server answered and said no (credentials, certificate): no reason to try again."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True
    text = str(exc).lower()
    return "authorization violation" in text or "authentication" in text


def _describe(exc: Exception | None) -> str:
    if exc is None:
        return "no server answered"
    if isinstance(exc, TimeoutError):
        return "a server accepted the connection but did not answer (timed out)"
    return str(exc) or type(exc).__name__


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
