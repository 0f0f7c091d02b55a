"""What a broker adapter sees of the service: request bodies in, reply bodies out.

The NATS and Kafka adapters depend on this interface only, never on the concrete
:class:`~dispenser.service.dispatch.Dispatcher` (an import contract in ``pyproject.toml`` holds the line).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dispenser.core.errors import DispenserError
from dispenser.messages import IdRequest

__all__ = ["Answer", "Answerer"]


@dataclass(frozen=True, slots=True)
class Answer:
    """A reply body, and the error it carries if it is an error reply (for broker headers)."""

    body: bytes
    error: DispenserError | None = None


class Answerer(Protocol):
    """What a broker adapter needs of a :class:`Dispatcher`: request bodies in, reply bodies out.

    Adapters type against this rather than the concrete class, so that they depend on the service's
    interface only (and tests can hand them a fake).
    """

    def answer_now(self, tag: str, body: bytes, msgpack: bool = False) -> bytes | Answer | None:
        """The reply body, an error :class:`Answer`, or ``None``: call :meth:`answer`, which may wait."""
        ...

    async def answer(self, tag: str, body: bytes, msgpack: bool = False) -> Answer:
        """Answer, waiting where needed; never raises."""
        ...

    def answer_request_now(self, tag: str, request: IdRequest, msgpack: bool = False) -> Answer | None:
        """Answer a decoded request (Kafka's) at once if possible; ``None``: use :meth:`answer_request`."""
        ...

    async def answer_request(self, tag: str, request: IdRequest, msgpack: bool = False) -> Answer:
        """Answer a decoded request, waiting where needed; never raises."""
        ...

    def error(self, tag: str, exc: DispenserError, msgpack: bool = False) -> Answer:
        """The error reply for ``exc`` (for failures found before the request reached the dispatcher)."""
        ...
