"""The NATS connection type for the wiring, and one-off requests for the command line (``dispenser get``)."""

from __future__ import annotations

from typing import TypeAlias

from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from dispenser.adapters.nats.connection import connect
from dispenser.config import NatsConfig
from dispenser.redaction import redact

__all__ = ["Connection", "request_once"]

Connection: TypeAlias = Client
"""A NATS connection, as the wiring holds it (so that it need not import the driver)."""


async def request_once(config: NatsConfig, subject: str, body: bytes, timeout: float, name: str) -> bytes:
    """Send one request on a connection of its own and return the reply's body.

    Raises:
        OSError: the server cannot be reached, nobody serves ``subject``, or no reply came in ``timeout``
            seconds (the message says which).
    """
    nc = await connect(config, name=name)
    try:
        msg = await nc.request(subject, body, timeout=timeout)
    except NoRespondersError:
        raise OSError(f"no dispenser is serving {subject} on {redact(config.url)}") from None
    except NatsTimeout:
        raise OSError(f"no reply on {subject} within {timeout}s") from None
    finally:
        await nc.close()
    return msg.data
