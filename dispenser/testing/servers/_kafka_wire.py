"""Two Kafka requests spoken over a plain socket, so that the synchronous harness can ask a broker questions.

Metadata v1 (which brokers are alive, which broker leads each partition, the in-sync replicas) and
FindCoordinator v1 (which broker coordinates a consumer group or a transactional ID). Both versions are
accepted by Kafka 3.9 and 4.x alike (``../shared/KAFKA.md`` §4).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from dispenser.testing.servers._process import LOOPBACK

__all__ = ["Metadata", "PartitionState", "find_coordinator", "metadata"]

_METADATA = 3
_FIND_COORDINATOR = 10
_CLIENT_ID = b"leaf-probe"


@dataclass(frozen=True)
class PartitionState:
    """One partition as the broker sees it: leader (-1: none), replicas and in-sync replicas (node IDs)."""

    leader: int
    replicas: tuple[int, ...]
    isr: tuple[int, ...]
    error_code: int = 0


@dataclass(frozen=True)
class Metadata:
    """A Metadata v1 answer: live brokers (node ID → port), the controller, and the asked topics' partitions."""

    brokers: dict[int, int]
    controller: int
    partitions: dict[tuple[str, int], PartitionState] = field(default_factory=dict)
    topic_errors: dict[str, int] = field(default_factory=dict)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return int(value)

    def string(self) -> str | None:
        size = self.take(">h")
        if size < 0:
            return None
        text = self.data[self.pos : self.pos + size].decode()
        self.pos += size
        return text

    def ints(self) -> tuple[int, ...]:
        return tuple(self.take(">i") for _ in range(self.take(">i")))


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack(">h", len(raw)) + raw


def _call(port: int, api_key: int, version: int, body: bytes, timeout: float) -> _Reader | None:
    """Send one request (header v1) and return a reader past the response's correlation ID, or None."""
    request = struct.pack(">hhi", api_key, version, 7) + _string(_CLIENT_ID.decode()) + body
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout) as sock:
            sock.sendall(struct.pack(">i", len(request)) + request)
            data = b""
            while len(data) < 4 or len(data) < 4 + struct.unpack(">i", data[:4])[0]:
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                data += chunk
    except OSError:
        return None
    reader = _Reader(data[4:])
    return reader if reader.take(">i") == 7 else None


def metadata(port: int, topics: Sequence[str] = (), timeout: float = 1.0) -> Metadata | None:
    """Ask the broker at ``127.0.0.1:port`` for metadata (of ``topics`` only); None when it does not answer.

    A KRaft broker lists itself only once it has caught up with the controller and is unfenced.
    """
    body = struct.pack(">i", len(topics)) + b"".join(_string(t) for t in topics)
    reader = _call(port, _METADATA, 1, body, timeout)
    if reader is None:
        return None
    try:
        brokers = {}
        for _ in range(reader.take(">i")):
            node = reader.take(">i")
            reader.string()  # host
            brokers[node] = reader.take(">i")
            reader.string()  # rack
        controller = reader.take(">i")
        partitions: dict[tuple[str, int], PartitionState] = {}
        errors: dict[str, int] = {}
        for _ in range(reader.take(">i")):
            error = reader.take(">h")
            name = reader.string() or ""
            reader.take(">b")  # is_internal
            if error:
                errors[name] = error
            for _ in range(reader.take(">i")):
                p_error = reader.take(">h")
                index = reader.take(">i")
                leader = reader.take(">i")
                partitions[(name, index)] = PartitionState(leader, reader.ints(), reader.ints(), p_error)
    except struct.error:
        return None
    return Metadata(brokers, controller, partitions, errors)


def find_coordinator(port: int, key: str, key_type: int, timeout: float = 1.0) -> int | None:
    """The node ID coordinating ``key`` (``key_type`` 0: a consumer group, 1: a transactional ID), or None.

    None also when the broker answers with an error (e.g. the coordinator is not available yet).
    """
    reader = _call(port, _FIND_COORDINATOR, 1, _string(key) + struct.pack(">b", key_type), timeout)
    if reader is None:
        return None
    try:
        reader.take(">i")  # throttle time
        error = reader.take(">h")
        reader.string()  # error message
        node = reader.take(">i")
    except struct.error:
        return None
    return node if error == 0 else None
