"""Reading the transaction markers a restarted broker dropped out of its log (the test kit's repair of them)."""

from __future__ import annotations

import struct
from pathlib import Path

from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.util import calc_crc32c

from dispenser_lab.servers.kafka_markers import DroppedMarkers, dropped_markers, lost_markers

# Trimmed from a broker log of a kill -9 and restart (Kafka 4.4.0), where the test then hung.
_LOG = """\
2026-11-25 04:30:45,545 INFO kafka.coordinator.transaction.TransactionStateManager: [Transaction State Manager 1]: Finished loading 4 transaction metadata from __transaction_state-0 in 77 milliseconds, of which 1 milliseconds was spent in the scheduler.
2026-11-25 04:30:45,555 INFO kafka.coordinator.transaction.TransactionStateManager: [Transaction State Manager 1]: Sending txn markers for TransactionalIdCoordinatorEpochAndTransitMetadata[transactionalId=stop-063f10d956.0, coordinatorEpoch=3, result=COMMIT, txnMetadata=TransactionMetadata(transactionalId=stop-063f10d956.0, producerId=17, prevProducerId=17, nextProducerId=-1, producerEpoch=2, lastProducerEpoch=-1, txnTimeoutMs=60000, state=PREPARE_COMMIT, pendingState=Optional[COMPLETE_COMMIT], topicPartitions=[__consumer_offsets-0, orders.enriched-3a6a904c65-0, orders.raw-b7b74b4608.dlq-0], txnStartTimestamp=1795581039216, txnLastUpdateTimestamp=1795581039226, clientTransactionVersion=TV_0), transitMetadata=TxnTransitMetadata[producerId=17]]
2026-11-25 04:30:45,555 INFO kafka.coordinator.transaction.TransactionStateManager: [Transaction State Manager 1]: Sending txn markers for TransactionalIdCoordinatorEpochAndTransitMetadata[transactionalId=other.1, coordinatorEpoch=3, result=ABORT, txnMetadata=TransactionMetadata(transactionalId=other.1, producerId=18, prevProducerId=18, nextProducerId=-1, producerEpoch=0, lastProducerEpoch=-1, txnTimeoutMs=60000, state=PREPARE_ABORT, pendingState=Optional[COMPLETE_ABORT], topicPartitions=[t-2], txnStartTimestamp=1, txnLastUpdateTimestamp=1, clientTransactionVersion=TV_0), transitMetadata=TxnTransitMetadata[producerId=18]]
2026-11-25 04:30:47,919 INFO kafka.coordinator.transaction.TransactionMarkerChannelManager: [Transaction Marker Channel Manager 1]: Couldn't find leader endpoint for partitions Set(__consumer_offsets-0, orders.enriched-3a6a904c65-0, orders.raw-b7b74b4608.dlq-0) while trying to send transaction markers for stop-063f10d956.0, these partitions are likely deleted already and hence can be skipped
2026-11-25 04:30:47,931 INFO kafka.coordinator.transaction.TransactionCoordinator: [TransactionCoordinator id=1] Resigned as the txn coordinator for partition 0 at epoch Some(1)
"""


def test_a_dropped_commit_is_read_with_its_producer_epochs_and_partitions(tmp_path: Path) -> None:
    log = tmp_path / "kafka.log"
    log.write_text(_LOG)
    assert dropped_markers(log) == [
        DroppedMarkers(
            transactional_id="stop-063f10d956.0",
            producer_id=17,
            producer_epoch=2,
            coordinator_epoch=3,
            commit=True,
            partitions=(
                ("__consumer_offsets", 0),
                ("orders.enriched-3a6a904c65", 0),
                ("orders.raw-b7b74b4608.dlq", 0),
            ),
        )
    ]


def test_markers_sent_normally_are_not_reported(tmp_path: Path) -> None:
    log = tmp_path / "kafka.log"
    log.write_text("\n".join(line for line in _LOG.splitlines() if "Couldn't find" not in line))
    assert dropped_markers(log) == []
    assert dropped_markers(tmp_path / "missing.log") == []


# -- markers lost without a word: read from the broker's files ------------------------------------------

_ONGOING, _PREPARE_ABORT, _COMPLETE_COMMIT, _COMPLETE_ABORT = 1, 3, 4, 5


def _batch(
    offset: int, pid: int, epoch: int, *, key: bytes | None, value: bytes, control: bool = False
) -> bytes:
    """One record batch as a partition's log holds it (a control batch: a transaction marker)."""
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=1,
        producer_id=pid,
        producer_epoch=epoch,
        base_sequence=0,
        batch_size=1 << 16,
    )
    builder.append(0, timestamp=1, key=key, value=value, headers=[])
    data = bytearray(builder.build())
    struct.pack_into(">q", data, 0, offset)
    if control:  # attributes bit 5; the CRC (at byte 17) covers the attributes (byte 21) onwards
        struct.pack_into(">h", data, 21, struct.unpack_from(">h", data, 21)[0] | 0x20)
        struct.pack_into(">I", data, 17, calc_crc32c(bytes(data[21:])))
    return bytes(data)


def _marker(offset: int, pid: int, epoch: int, *, commit: bool) -> bytes:
    return _batch(offset, pid, epoch, key=struct.pack(">hh", 0, int(commit)), value=b"\0" * 6, control=True)


def _state(offset: int, transactional_id: str, pid: int, epoch: int, state: int) -> bytes:
    """A ``__transaction_state`` record: the coordinator's state of one transactional ID."""
    name = transactional_id.encode()
    key = struct.pack(">hh", 0, len(name)) + name
    return _batch(
        offset, -1, -1, key=key, value=struct.pack(">hqhib", 1, pid, epoch, 60_000, state) + b"\0" * 8
    )


def _files(tmp_path: Path, partitions: dict[str, list[bytes]]) -> Path:
    for name, batches in partitions.items():
        directory = tmp_path / name
        directory.mkdir()
        (directory / "00000000000000000000.log").write_bytes(b"".join(batches))
    return tmp_path


def test_records_left_after_a_committed_transaction_are_found_with_its_decision(tmp_path: Path) -> None:
    """Records after the producer's last marker, their transaction recorded committed: a commit is due there."""
    data = _files(
        tmp_path,
        {
            "out-0": [
                _batch(0, 7, 1, key=None, value=b"a"),
                _marker(1, 7, 1, commit=True),
                _batch(2, 7, 1, key=None, value=b"lost its marker"),
            ],
            "out.dlq-0": [_batch(0, 7, 1, key=None, value=b"a"), _marker(1, 7, 1, commit=True)],
            "__transaction_state-0": [
                _state(0, "t.0", 7, 1, _ONGOING),
                _state(1, "t.0", 7, 1, _COMPLETE_COMMIT),
                _state(2, "t.0", 7, 1, _ONGOING),
                _state(3, "t.0", 7, 1, _COMPLETE_COMMIT),
            ],
        },
    )
    assert lost_markers(data, 6) == [
        DroppedMarkers(
            "t.0", producer_id=7, producer_epoch=1, coordinator_epoch=6, commit=True, partitions=(("out", 0),)
        )
    ]


def test_a_transaction_fenced_while_open_is_found_aborted_and_an_ongoing_one_is_left_alone(
    tmp_path: Path,
) -> None:
    data = _files(
        tmp_path,
        {
            "out-0": [_batch(0, 7, 1, key=None, value=b"fenced")],
            "out-1": [_batch(0, 8, 0, key=None, value=b"live")],
            "__transaction_state-0": [
                _state(0, "t.0", 7, 1, _ONGOING),
                _state(1, "t.1", 8, 0, _ONGOING),
                _state(2, "t.0", 7, 2, _PREPARE_ABORT),  # InitProducerId of a new owner: epoch 2
                _state(3, "t.0", 7, 2, _COMPLETE_ABORT),
            ],
        },
    )
    assert lost_markers(data, 6) == [
        DroppedMarkers(
            "t.0",
            producer_id=7,
            producer_epoch=1,
            coordinator_epoch=6,
            commit=False,
            partitions=(("out", 0),),
        )
    ]
