"""Reading the transaction markers a restarted broker dropped out of its log (the test kit's repair of them)."""

from __future__ import annotations

from pathlib import Path

from dispenser.testing.servers.kafka_markers import DroppedMarkers, dropped_markers

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
