"""Transaction markers a restarted Kafka broker's coordinator dropped, found in its log and written after all.

:func:`dropped_markers` reads the coordinator's "Couldn't find leader endpoint" events from the broker's
log; :func:`write_markers` writes the markers as the coordinator decided them, to each partition's leader.
Why a restart leaves hanging transactions, and the operator's repair: ``docs/kafka.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dispenser.testing.servers.kafka_wire import metadata, write_txn_markers

__all__ = ["DroppedMarkers", "dropped_markers", "write_markers"]

_SENDING = re.compile(
    r"Sending txn markers for TransactionalIdCoordinatorEpochAndTransitMetadata\["
    r"transactionalId=(?P<id>[^,]+), coordinatorEpoch=(?P<coordinator_epoch>\d+), result=(?P<result>\w+), "
    r"txnMetadata=TransactionMetadata\(transactionalId=[^,]+, producerId=(?P<producer_id>\d+), "
    r".*?, producerEpoch=(?P<producer_epoch>\d+),"
)
_DROPPED = re.compile(
    r"Couldn't find leader endpoint for partitions Set\((?P<partitions>[^)]*)\) "
    r"while trying to send transaction markers for (?P<id>[^,\s]+)"
)


@dataclass(frozen=True)
class DroppedMarkers:
    """One transaction whose markers the coordinator skipped on some partitions."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    coordinator_epoch: int
    commit: bool
    """What the coordinator decided (and recorded as complete)."""
    partitions: tuple[tuple[str, int], ...]


def _partition(name: str) -> tuple[str, int]:
    topic, _, index = name.strip().rpartition("-")
    return topic, int(index)


def dropped_markers(log_path: Path) -> list[DroppedMarkers]:
    """Every transaction whose markers the broker logging to ``log_path`` skipped, in log order."""
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    sending: dict[str, re.Match[str]] = {}
    found: list[DroppedMarkers] = []
    for line in text.splitlines():
        if (match := _SENDING.search(line)) is not None:
            sending[match["id"]] = match
        elif (match := _DROPPED.search(line)) is not None and match["id"] in sending:
            decided = sending[match["id"]]
            found.append(
                DroppedMarkers(
                    transactional_id=match["id"],
                    producer_id=int(decided["producer_id"]),
                    producer_epoch=int(decided["producer_epoch"]),
                    coordinator_epoch=int(decided["coordinator_epoch"]),
                    commit=decided["result"] == "COMMIT",
                    partitions=tuple(_partition(name) for name in match["partitions"].split(",")),
                )
            )
    return found


def write_markers(port: int, dropped: DroppedMarkers) -> bool:
    """Write ``dropped``'s markers to its partitions' leaders, asking the broker at ``port`` who they are.

    True when every partition took its marker; False when a leader is unknown or refused (try again).
    """
    topics = sorted({topic for topic, _ in dropped.partitions})
    answer = metadata(port, topics)
    if answer is None:
        return False
    by_leader: dict[int, list[tuple[str, int]]] = {}
    for tp in dropped.partitions:
        state = answer.partitions.get(tp)
        if state is None or state.leader not in answer.brokers:
            return False
        by_leader.setdefault(answer.brokers[state.leader], []).append(tp)
    for leader_port, partitions in by_leader.items():
        errors = write_txn_markers(
            leader_port,
            producer_id=dropped.producer_id,
            producer_epoch=dropped.producer_epoch,
            coordinator_epoch=dropped.coordinator_epoch,
            commit=dropped.commit,
            partitions=partitions,
        )
        if errors is None or any(errors.get(tp, -1) != 0 for tp in partitions):
            return False
    return True
