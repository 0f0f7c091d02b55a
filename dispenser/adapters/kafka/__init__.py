"""Apache Kafka (aiokafka): connecting, the request/reply service and the client's side, rate events, enrichment."""

__all__ = ["client_transport", "connection", "enrich", "headers", "offsets", "rates", "requests"]
