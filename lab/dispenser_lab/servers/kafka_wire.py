"""Three Kafka requests spoken over a plain socket, so that the synchronous harness can ask a broker questions.

Metadata v1 (which brokers are alive, which broker leads each partition, the in-sync replicas),
FindCoordinator v1 (which broker coordinates a consumer group or a transactional ID), both accepted by
Kafka 3.9 and 4.x alike; and WriteTxnMarkers v1, what a transaction
coordinator sends to partition leaders to end a transaction, for markers a coordinator dropped
(:meth:`dispenser_lab.servers.KafkaBroker.repair_dropped_markers`).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from dispenser_lab.servers.process import LOOPBACK

__all__ = ["Metadata", "PartitionState", "find_coordinator", "metadata", "write_txn_markers"]

_METADATA = 3
_FIND_COORDINATOR = 10
_WRITE_TXN_MARKERS = 27
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

    def unpack(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return int(value)

    def string(self) -> str | None:
        size = self.unpack(">h")
        if size < 0:
            return None
        text = self.data[self.pos : self.pos + size].decode()
        self.pos += size
        return text

    def ints(self) -> tuple[int, ...]:
        return tuple(self.unpack(">i") for _ in range(self.unpack(">i")))

    def uvarint(self) -> int:
        value = shift = 0
        while True:
            byte = self.data[self.pos]
            self.pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def compact_string(self) -> str | None:
        size = self.uvarint() - 1
        if size < 0:
            return None
        text = self.data[self.pos : self.pos + size].decode()
        self.pos += size
        return text

    def skip_tags(self) -> None:
        for _ in range(self.uvarint()):
            self.uvarint()  # tag
            self.pos += self.uvarint()  # its size, then the data


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack(">h", len(raw)) + raw


def _uvarint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _compact_string(text: str) -> bytes:
    raw = text.encode()
    return _uvarint(len(raw) + 1) + raw


_NO_TAGS = b"\x00"


def _call(
    port: int, api_key: int, version: int, body: bytes, timeout: float, *, flexible: bool = False
) -> _Reader | None:
    """Send one request and return a reader past the response header, or None.

    Request header v1 (v2 when ``flexible``: with tagged fields); response header v0 (v1: tagged fields).
    """
    header = struct.pack(">hhi", api_key, version, 7) + _string(_CLIENT_ID.decode())
    request = header + (_NO_TAGS if flexible else b"") + body
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
    if reader.unpack(">i") != 7:
        return None
    if flexible:
        reader.skip_tags()
    return reader


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
        for _ in range(reader.unpack(">i")):
            node = reader.unpack(">i")
            reader.string()  # host
            brokers[node] = reader.unpack(">i")
            reader.string()  # rack
        controller = reader.unpack(">i")
        partitions: dict[tuple[str, int], PartitionState] = {}
        errors: dict[str, int] = {}
        for _ in range(reader.unpack(">i")):
            error = reader.unpack(">h")
            name = reader.string() or ""
            reader.unpack(">b")  # is_internal
            if error:
                errors[name] = error
            for _ in range(reader.unpack(">i")):
                p_error = reader.unpack(">h")
                index = reader.unpack(">i")
                leader = reader.unpack(">i")
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
        reader.unpack(">i")  # throttle time
        error = reader.unpack(">h")
        reader.string()  # error message
        node = reader.unpack(">i")
    except struct.error:
        return None
    return node if error == 0 else None


def write_txn_markers(
    port: int,
    *,
    producer_id: int,
    producer_epoch: int,
    coordinator_epoch: int,
    commit: bool,
    partitions: Sequence[tuple[str, int]],
    timeout: float = 5.0,
) -> dict[tuple[str, int], int] | None:
    """End one producer's transaction on ``partitions`` led by the broker at ``127.0.0.1:port``.

    What a transaction coordinator sends when a transaction is decided (``commit``: a commit marker, else
    an abort marker), and what ``kafka-transactions.sh abort`` sends. Returns the error code per partition
    (0: written), or None when the broker does not answer.
    """
    topics: dict[str, list[int]] = {}
    for topic, partition in partitions:
        topics.setdefault(topic, []).append(partition)
    marker = struct.pack(">qhb", producer_id, producer_epoch, commit) + _uvarint(len(topics) + 1)
    for topic, indexes in topics.items():
        marker += _compact_string(topic) + _uvarint(len(indexes) + 1)
        marker += b"".join(struct.pack(">i", index) for index in indexes) + _NO_TAGS
    marker += struct.pack(">i", coordinator_epoch) + _NO_TAGS
    body = _uvarint(2) + marker + _NO_TAGS
    reader = _call(port, _WRITE_TXN_MARKERS, 1, body, timeout, flexible=True)
    if reader is None:
        return None
    errors: dict[tuple[str, int], int] = {}
    try:
        for _ in range(reader.uvarint() - 1):
            reader.unpack(">q")  # producer ID
            for _ in range(reader.uvarint() - 1):
                name = reader.compact_string() or ""
                for _ in range(reader.uvarint() - 1):
                    index = reader.unpack(">i")
                    errors[(name, index)] = reader.unpack(">h")
                    reader.skip_tags()
                reader.skip_tags()
            reader.skip_tags()
    except (struct.error, IndexError):
        return None
    return errors
