"""Transaction markers a restarted Kafka broker's coordinator dropped, found in its log and written after all.

:func:`dropped_markers` reads the coordinator's "Couldn't find leader endpoint" events from the broker's
log; :func:`write_markers` writes the markers as the coordinator decided them, to each partition's leader.
Why a restart leaves hanging transactions, and the operator's repair: ``docs/kafka.md``.
"""

from __future__ import annotations

import logging
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dispenser_lab.servers.kafka_wire import metadata, write_txn_markers

__all__ = ["DroppedMarkers", "dropped_in", "dropped_markers", "lost_markers", "write_markers"]

log = logging.getLogger(__name__)

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


_refused: set[DroppedMarkers] = set()
"""Markers whose refusal was logged (once each: the caller retries every half second)."""


def _partition(name: str) -> tuple[str, int]:
    topic, _, index = name.strip().rpartition("-")
    return topic, int(index)


def dropped_markers(log_path: Path) -> list[DroppedMarkers]:
    """Every transaction whose markers the broker logging to ``log_path`` skipped, in log order."""
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return dropped_in(text)


def dropped_in(text: str) -> list[DroppedMarkers]:
    """:func:`dropped_markers` of a broker log already read."""
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
            # Said, not only retried: 47 (INVALID_PRODUCER_EPOCH) means the producer ID wrote there with a
            # newer epoch first, and that epoch's marker decided these records too (docs/kafka.md).
            if dropped not in _refused:
                _refused.add(dropped)
                log.warning("the dropped markers of %s were refused: %s", dropped, errors)
            return False
    return True


def lost_markers(data_dir: Path, coordinator_epoch: int) -> list[DroppedMarkers]:
    """Transactions decided by their coordinator but left undecided on partitions, read from the broker's files.

    What :func:`dropped_markers` finds in the log, and more: a single node restarted (cleanly, too) has
    also come back without the markers of a transaction it had recorded as complete, on every one of its
    partitions, and logged nothing about it (a run of the restart test, 2026-11-27: ``CompleteCommit`` in
    ``__transaction_state``, no marker after the records in the output, dead-letter and
    ``__consumer_offsets`` partitions, whose later offsets were written again). Found here as a
    ``kafka-transactions.sh find-hanging`` would: per producer ID, the records after its last marker on
    each partition; the decision is the coordinator's, the first commit or abort it recorded after the
    producer epoch's last ``Ongoing`` state. A transaction it still records as ongoing is left alone
    (live, or for its timeout to abort). ``coordinator_epoch``: the coordinator's current epoch, which
    the markers carry.
    """
    open_at: dict[int, dict[tuple[str, int], int]] = {}  # producer ID → partition → epoch of its open records
    for directory in sorted(data_dir.iterdir()):
        name = directory.name
        if not directory.is_dir() or name.startswith(("__cluster_metadata", "__transaction_state")):
            continue
        topic, _, index = name.rpartition("-")
        if not index.isdigit():
            continue
        for pid, epoch in _open_transactions(directory).items():
            open_at.setdefault(pid, {})[(topic, int(index))] = epoch
    if not open_at:
        return []
    decided, ids = _decisions(data_dir / "__transaction_state-0")
    found = []
    for pid, partitions in sorted(open_at.items()):
        for epoch in sorted(set(partitions.values())):
            commit = decided.get((pid, epoch))
            if commit is None or pid not in ids:
                continue
            found.append(
                DroppedMarkers(
                    transactional_id=ids[pid],
                    producer_id=pid,
                    producer_epoch=epoch,
                    coordinator_epoch=coordinator_epoch,
                    commit=commit,
                    partitions=tuple(sorted(tp for tp, e in partitions.items() if e == epoch)),
                )
            )
    return found


def _batches(directory: Path) -> Iterator[Any]:
    """The record batches of a partition directory's log segments, in order (aiokafka's readers).

    A batch still being written ends the reading: the next call reads it.
    """
    from aiokafka.record.memory_records import MemoryRecords  # noqa: PLC0415  (only the repair needs it)

    for segment in sorted(directory.glob("*.log")):
        records = MemoryRecords(segment.read_bytes())
        while records.has_next():
            batch = records.next_batch()
            if batch is None:
                return
            yield batch


def _open_transactions(directory: Path) -> dict[int, int]:
    """Producer ID → epoch, for the producers with transactional records after their last marker here."""
    open_: dict[int, int] = {}
    for batch in _batches(directory):
        if not batch.is_transactional:
            continue
        if batch.is_control_batch:
            open_.pop(batch.producer_id, None)
        else:
            open_[batch.producer_id] = batch.producer_epoch
    return open_


_ONGOING, _PREPARE_COMMIT, _PREPARE_ABORT, _COMPLETE_COMMIT, _COMPLETE_ABORT = 1, 2, 3, 4, 5


def _decisions(directory: Path) -> tuple[dict[tuple[int, int], bool | None], dict[int, str]]:
    """From ``__transaction_state``: (producer ID, epoch) → committed, aborted or None (still ongoing); IDs.

    A commit or abort decides every epoch of its producer ID recorded ongoing before it.
    """
    decided: dict[tuple[int, int], bool | None] = {}
    ongoing: dict[int, set[int]] = {}  # producer ID → its epochs recorded ongoing and not decided since
    ids: dict[int, str] = {}
    for batch in _batches(directory):
        for record in batch:
            key, value = record.key, record.value
            if key is None or value is None or len(value) < 17:
                continue
            (size,) = struct.unpack_from(">h", key, 2)
            pid, epoch = struct.unpack_from(">qh", value, 2)
            state = value[16]
            ids[pid] = key[4 : 4 + size].decode()
            if state == _ONGOING:
                decided[(pid, epoch)] = None
                ongoing.setdefault(pid, set()).add(epoch)
            elif state in (_PREPARE_COMMIT, _PREPARE_ABORT, _COMPLETE_COMMIT, _COMPLETE_ABORT):
                commit = state in (_PREPARE_COMMIT, _COMPLETE_COMMIT)
                for open_epoch in ongoing.pop(pid, set()):
                    decided[(pid, open_epoch)] = commit
    return decided, ids
