"""Apache Kafka (aiokafka): client options and headers, request/reply, and exactly-once enrichment."""

__all__ = ["clients", "enrich", "offsets", "rates", "requests"]
