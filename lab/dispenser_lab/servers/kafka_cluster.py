"""Three (or more) combined KRaft Kafka nodes on 127.0.0.1, each broker and controller, each killable alone.

Every member is a :class:`~dispenser_lab.servers.kafka.KafkaBroker` with its own node ID, sharing the
controller quorum and the cluster ID, configured for high availability (``docs/ha.md``):
replication factor 3 and ``min.insync.replicas`` 2 for new and internal topics (the consumer offsets and
the transaction log), a 3 s broker session (heartbeat 0.5 s) so that a killed broker's partitions get
new leaders in ~5 s rather than ~10 s, and a 5 s limit on the brokers' requests to the controller (30 s by
default: a frozen controller held admin requests that long). The log cleaner's buffer stays at 16 MiB (256
MiB heaps).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from dispenser_lab.servers.group import ServerGroup
from dispenser_lab.servers.kafka import KAFKA_VERSION, KafkaBroker, new_cluster_id
from dispenser_lab.servers.kafka_wire import Metadata, PartitionState, find_coordinator, metadata
from dispenser_lab.servers.process import LOOPBACK, ServerStartError, free_port

__all__ = ["INTERNAL_TOPICS", "KafkaCluster"]

INTERNAL_TOPICS = ("__consumer_offsets", "__transaction_state")
"""Kafka's own topics, replicated like ours (the group and transaction coordinators live on them)."""

_GROUP, _TRANSACTION = 0, 1


def _replication_settings(size: int, version: str) -> dict[str, str]:
    factor = str(min(3, size))
    min_isr = str(max(1, min(3, size) - 1))
    settings = {
        "default.replication.factor": factor,
        "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": factor,
        "transaction.state.log.replication.factor": factor,
        "transaction.state.log.min.isr": min_isr,
    }
    if not version.startswith("3."):
        settings["share.coordinator.state.topic.replication.factor"] = factor
        settings["share.coordinator.state.topic.min.isr"] = min_isr
    return settings


class KafkaCluster(ServerGroup[KafkaBroker]):
    """``size`` Kafka nodes (broker + controller each) forming one KRaft cluster; member ``n`` is node ``n``.

    Example::

        with KafkaCluster(tmp_path) as cluster:
            producer = AIOKafkaProducer(bootstrap_servers=cluster.bootstrap)
            cluster.leader_of("orders").kill()        # kill -9 of the partition leader
            cluster.start()                           # it rejoins (its replicas catch up)

    Args:
        workdir: Holds one directory per member (``kafka1``, ``kafka2``…).
        size: Number of nodes (3: one may fail with replication factor 3 and two replicas in sync).
        version: The Kafka release.
        start_timeout: Seconds each member may take to list itself in its metadata.
        proxied_at: One port per member: member ``n`` also gets a plaintext client listener advertised at
            ``127.0.0.1:proxied_at[n - 1]``, where a fault proxy to its :attr:`~KafkaBroker.proxied_port`
            is to listen (:attr:`proxied_bootstrap`; see :class:`KafkaBroker`). The members replicate and
            elect past the proxies: cutting one cuts the clients' path to that broker only.
        stop_timeout: Seconds each member may take to stop after SIGTERM before it is killed. Members
            stopped together cannot all shut down cleanly (the last ones lose the controller quorum and
            wait for it: 15 s measured with 20 s here), so the default is short; a killed member recovers
            its logs at the next start.
    """

    def __init__(
        self,
        workdir: Path,
        size: int = 3,
        *,
        version: str = KAFKA_VERSION,
        start_timeout: float = 90.0,
        stop_timeout: float = 5.0,
        proxied_at: Sequence[int] | None = None,
    ) -> None:
        if proxied_at is not None and len(proxied_at) != size:
            raise ValueError(f"proxied_at needs one port per member ({size}), got {len(proxied_at)}")
        self.workdir = Path(workdir)
        self.start_timeout = start_timeout
        controllers = {n: free_port() for n in range(1, size + 1)}
        voters = ",".join(f"{n}@{LOOPBACK}:{port}" for n, port in controllers.items())
        cluster_id = new_cluster_id()
        settings = _replication_settings(size, version) | {
            # Each broker forwards admin requests (CreateTopics) to the active controller over a channel
            # whose requests wait this long: 30 s by default, which a frozen controller held every topic
            # creation for (the channel stays on the old controller until its request times out).
            "controller.socket.timeout.ms": "5000",
        }
        super().__init__(
            [
                KafkaBroker(
                    self.workdir / f"kafka{n}",
                    free_port(),
                    version=version,
                    config=settings,
                    node_id=n,
                    controller_port=port,
                    voters=voters,
                    cluster_id=cluster_id,
                    start_timeout=start_timeout,
                    stop_timeout=stop_timeout,
                    proxied_at=None if proxied_at is None else proxied_at[n - 1],
                )
                for n, port in controllers.items()
            ]
        )

    @property
    def bootstrap(self) -> str:
        """Every member's ``127.0.0.1:PORT``, comma-separated (``kafka.bootstrap_servers``)."""
        return ",".join(m.bootstrap for m in self.members)

    @property
    def proxied_bootstrap(self) -> str:
        """Every member's proxied address (``proxied_at``), comma-separated.

        Raises:
            ValueError: the cluster was made without ``proxied_at``.
        """
        return ",".join(m.proxied_bootstrap for m in self.members)

    def metadata(self, topics: Iterable[str] = ()) -> Metadata:
        """Metadata (of ``topics``) from the first running member that answers.

        Raises:
            ServerStartError: No running member answered.
        """
        for member in self.running:
            answer = metadata(member.port, list(topics))
            if answer is not None:
                return answer
        raise ServerStartError("no Kafka member answered a metadata request")

    def partition(self, topic: str, partition: int = 0, timeout: float = 10.0) -> PartitionState:
        """The partition's leader and replicas as the cluster sees them now.

        A topic just created may not be in every broker's metadata yet (it reaches them from the
        controller a moment later): up to ``timeout`` seconds are given for it to show.

        Raises:
            KeyError: The cluster has no such partition.
        """
        deadline = time.monotonic() + timeout
        while True:
            state = self.metadata([topic]).partitions.get((topic, partition))
            if state is not None:
                return state
            if time.monotonic() >= deadline:
                raise KeyError((topic, partition))
            time.sleep(0.05)

    def leader_of(self, topic: str, partition: int = 0, timeout: float = 30.0) -> KafkaBroker:
        """The member leading ``topic``'s ``partition`` (waiting up to ``timeout`` s for it to have a live one).

        Raises:
            ServerStartError: No running member leads it within ``timeout`` seconds.
        """
        return self._member_of(
            lambda: self._leader(topic, partition), f"a leader of {topic}-{partition}", timeout
        )

    def transaction_coordinator(self, transactional_id: str, timeout: float = 30.0) -> KafkaBroker:
        """The member coordinating ``transactional_id``'s transactions (FindCoordinator).

        Raises:
            ServerStartError: No running member is named within ``timeout`` seconds.
        """
        return self._member_of(
            lambda: self._coordinator(transactional_id, _TRANSACTION),
            f"the transaction coordinator of {transactional_id!r}",
            timeout,
        )

    def group_coordinator(self, group_id: str, timeout: float = 30.0) -> KafkaBroker:
        """The member coordinating consumer group ``group_id`` (FindCoordinator).

        Raises:
            ServerStartError: No running member is named within ``timeout`` seconds.
        """
        return self._member_of(
            lambda: self._coordinator(group_id, _GROUP), f"the coordinator of group {group_id!r}", timeout
        )

    def wait_in_sync(self, topics: Iterable[str] = (), timeout: float | None = None) -> None:
        """Wait until every partition of ``topics`` and of Kafka's internal topics has all replicas in sync.

        Call it after restarting a member and before killing another: a second kill while the first one's
        replicas are still catching up leaves fewer than ``min.insync.replicas`` and stops writes.

        Raises:
            ServerStartError: Still not so after ``timeout`` seconds (``start_timeout`` by default).
        """
        names = [*INTERNAL_TOPICS, *topics]
        deadline = time.monotonic() + (self.start_timeout if timeout is None else timeout)
        while True:
            lagging: dict[tuple[str, int], tuple[int, ...]] = {}
            try:
                answer = self.metadata(names)
            except ServerStartError:
                answer = None
            if answer is not None:
                lagging = {key: s.isr for key, s in answer.partitions.items() if len(s.isr) < len(s.replicas)}
                present = {name for name, _ in answer.partitions}
                if not lagging and present.issuperset(topics):
                    return
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"Kafka replicas not in sync after the wait: {lagging or 'no metadata'}"
                )
            time.sleep(0.1)

    def _leader(self, topic: str, partition: int) -> int | None:
        try:
            state = self.partition(topic, partition)
        except (KeyError, ServerStartError):
            return None
        return state.leader if state.leader >= 0 else None

    def _coordinator(self, key: str, key_type: int) -> int | None:
        for member in self.running:
            node = find_coordinator(member.port, key, key_type)
            if node is not None:
                return node
        return None

    def _member_of(self, ask: Callable[[], int | None], what: str, timeout: float) -> KafkaBroker:
        deadline = time.monotonic() + timeout
        while True:
            node = ask()
            if node is not None and 1 <= node <= len(self.members) and self.member(node).running:
                return self.member(node)
            if time.monotonic() >= deadline:
                raise ServerStartError(f"no running Kafka member is {what} after {timeout:g} s (got {node})")
            time.sleep(0.1)

    def __repr__(self) -> str:
        return f"KafkaCluster(bootstrap={self.bootstrap!r}, running={[m.pid for m in self.members]})"
