"""The settings of one ``dispenser enrich`` stream, and what its enricher did (:mod:`~dispenser.adapters.kafka.enrich`)."""

from __future__ import annotations

from dataclasses import dataclass

from dispenser.config import EnrichConfig
from dispenser.messages import Kind
from dispenser.service.enrichment import Placement

__all__ = ["EnrichSettings", "EnrichStats"]


@dataclass(frozen=True, slots=True)
class EnrichSettings:
    """One enrichment stream: topics, where the ID goes, which tag and generator, and the batching."""

    input_topic: str
    output_topic: str
    tag: str
    placement: Placement
    kind: Kind = "segment"
    """Which generator gives the IDs."""
    dlq_topic: str | None = None
    """Default ``<input>.dlq``."""
    group_id: str | None = None
    """Default ``leaf-enrich.<input>``."""
    transactional_id_prefix: str | None = None
    """Default: the group ID."""
    commit_records: int = 1000
    commit_interval: float = 0.1
    max_record_bytes: int = 1_000_000
    transaction_timeout_ms: int = 60_000
    source_header: bool = True
    """Add ``leaf-source: <topic>/<partition>/<offset>`` to every output (dead letters always get it)."""
    fetch_deadline: float = 2.0
    """Seconds one attempt to take IDs may wait before it is retried."""

    @classmethod
    def build(cls, config: EnrichConfig, **stream: object) -> EnrichSettings:
        """Settings from the ``[enrich]`` section plus the stream's own (CLI) options."""
        return cls(
            group_id=config.group_id,
            transactional_id_prefix=config.transactional_id_prefix,
            commit_records=config.commit_records,
            commit_interval=config.commit_interval,
            max_record_bytes=config.max_record_bytes,
            transaction_timeout_ms=config.transaction_timeout_ms,
            source_header=config.source_header,
            **stream,  # type: ignore[arg-type]
        )

    @property
    def dlq(self) -> str:
        """The dead-letter topic."""
        return self.dlq_topic or f"{self.input_topic}.dlq"

    @property
    def group(self) -> str:
        """The consumer group of this stream's enrichers."""
        return self.group_id or f"leaf-enrich.{self.input_topic}"

    def transactional_id(self, partition: int) -> str:
        """The stable transactional ID of the producer that owns input ``partition``."""
        return f"{self.transactional_id_prefix or self.group}.{partition}"


@dataclass
class EnrichStats:
    """What the enricher did (records counted when their transaction commits)."""

    enriched: int = 0
    dead_lettered: int = 0
    transactions: int = 0
    aborted: int = 0
    id_waits: int = 0
    """Times taking IDs failed and was retried (store unavailable, unknown tag…)."""
