"""Asking the dispensers over NATS: one-off requests (``dispenser get``) and the transport of :mod:`dispenser.client`.

nats-py's exceptions end here: "no responders" and a lost connection become :class:`ConnectionError`, a
request without a reply in time :class:`TimeoutError` (both :class:`OSError`), so the client above knows
nothing of the driver.
"""

from __future__ import annotations

import asyncio

import msgspec
from nats.aio.client import Client
from nats.errors import ConnectionClosedError, ConnectionReconnectingError, NoRespondersError
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout

from dispenser.adapters.nats.connection import connect
from dispenser.config import NatsConfig
from dispenser.messages import IdRequest, Kind, Reply, id_subject
from dispenser.redaction import redact

__all__ = ["NatsIdTransport", "request_once"]

_encode = msgspec.json.Encoder().encode
_decode_reply = msgspec.json.Decoder(Reply).decode


async def request_once(config: NatsConfig, subject: str, body: bytes, timeout: float, name: str) -> bytes:
    """Send one request on a connection of its own and return the reply's body.

    ``timeout`` bounds the whole: connecting (a server that is down or silent) and the reply.

    Raises:
        OSError: the server cannot be reached, nobody serves ``subject``, or no reply came in ``timeout``
            seconds (the message says which).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    nc = await connect(config, name=name, deadline=timeout)
    try:
        msg = await nc.request(subject, body, timeout=max(deadline - loop.time(), 0.001))
    except NoRespondersError:
        raise OSError(f"no dispenser is serving {subject} on {redact(config.url)}") from None
    except NatsTimeout:
        raise OSError(f"no reply on {subject} within {timeout:g} s (NATS at {redact(config.url)})") from None
    except NatsError as exc:  # the connection was lost meanwhile
        raise OSError(f"NATS request on {subject} failed: {exc}") from None
    finally:
        await nc.close()
    return msg.data


class NatsIdTransport:
    """ID requests over NATS (``<prefix>.<kind>.<tag>``), for :class:`dispenser.client.IdClient`.

    Args:
        config: servers and credentials (``subject_prefix`` too); used when no ``connection`` is given.
        connection: a connection of the caller's to use instead (not closed by :meth:`close`).
        name: the connection's name, as the NATS server's monitoring shows it.
        start_deadline: seconds :meth:`start` keeps trying to connect (default ``config.start_deadline``).
    """

    def __init__(
        self,
        config: NatsConfig | None = None,
        *,
        connection: Client | None = None,
        name: str = "leaf-client",
        start_deadline: float | None = None,
    ) -> None:
        self._config = config or NatsConfig()
        self._start_deadline = start_deadline
        self._prefix = self._config.subject_prefix
        self._name = name
        self._nc = connection
        self._owned = connection is None

    async def start(self) -> None:
        """Connect (unless a connection was given).

        Raises:
            OSError: no server could be reached within the start deadline.
        """
        if self._nc is None:
            self._nc = await connect(self._config, name=self._name, deadline=self._start_deadline)

    async def close(self) -> None:
        """Close the connection if it is ours."""
        nc, self._nc = self._nc, None
        if nc is not None and self._owned:
            await nc.close()

    async def request(self, kind: Kind, tag: str, request: IdRequest, timeout: float) -> Reply:
        """Send one ID request and return its reply (error replies included).

        Raises:
            ConnectionError: nobody serves the subject, or the connection is closed or reconnecting.
            TimeoutError: no reply within ``timeout`` seconds (it may still have been answered).
        """
        nc = self._nc
        if nc is None:
            raise ConnectionError("the NATS transport is not started")
        subject = id_subject(self._prefix, kind, tag)
        try:
            msg = await nc.request(subject, _encode(request), timeout=timeout)
        except NoRespondersError:
            raise ConnectionError(f"no dispenser is serving {subject}") from None
        except NatsTimeout:
            raise TimeoutError(f"no reply on {subject} within {timeout:g} s") from None
        except (ConnectionClosedError, ConnectionReconnectingError) as exc:
            raise ConnectionError(f"NATS connection unusable: {exc}") from None
        except NatsError as exc:
            raise ConnectionError(f"NATS request on {subject} failed: {exc}") from None
        try:
            return _decode_reply(msg.data)
        except msgspec.DecodeError as exc:
            raise ConnectionError(f"undecodable reply on {subject}: {exc}") from None
