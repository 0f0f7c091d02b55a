"""Moved to :mod:`dispenser.adapters.nats.client_transport` (the client's transport) and ``connection``.

Kept, re-exporting, while ``dispenser.client.buffered`` still imports :class:`NatsIdTransport` from here; to go
once it imports it from :mod:`dispenser.adapters.nats.client_transport`.
"""

from __future__ import annotations

from dispenser.adapters.nats.client_transport import NatsIdTransport, request_once
from dispenser.adapters.nats.connection import Connection

__all__ = ["Connection", "NatsIdTransport", "request_once"]
