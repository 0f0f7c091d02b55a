"""The Kafka record headers the dispenser reads and writes: names only, no driver.

Kept apart from the modules that import aiokafka so that the AsyncAPI document (``dispenser schemas``) can
name them in a base install, which has no Kafka driver.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CONTENT_TYPE",
    "CORRELATION_ID",
    "ERROR_CODE_HEADER",
    "ERROR_MESSAGE_HEADER",
    "REPLY_PARTITION",
    "REPLY_TOPIC",
    "SOURCE_HEADER",
    "SOURCE_OFFSET_HEADER",
    "SOURCE_PARTITION_HEADER",
    "SOURCE_TOPIC_HEADER",
]

REPLY_TOPIC: Final = "kafka_replyTopic"
"""Spring's header naming the topic the reply goes to."""
REPLY_PARTITION: Final = "kafka_replyPartition"
"""Spring's header naming the reply partition: a 4-byte big-endian int (ASCII digits accepted too)."""
CORRELATION_ID: Final = "kafka_correlationId"
"""Spring's header the requester matches replies by; copied back byte for byte."""
CONTENT_TYPE: Final = "content-type"
"""``application/msgpack`` selects msgpack for the request and its reply (JSON otherwise)."""

ERROR_CODE_HEADER: Final = "leaf-error-code"
"""On error replies and dead letters (the body says the same), so a consumer can route them without decoding."""
ERROR_MESSAGE_HEADER: Final = "leaf-error-message"
"""On a dead letter: the error's message."""
SOURCE_HEADER: Final = "leaf-source"
"""Added to every enriched output and dead letter: ``<topic>/<partition>/<offset>`` of the input record."""
SOURCE_TOPIC_HEADER: Final = "leaf-source-topic"
SOURCE_PARTITION_HEADER: Final = "leaf-source-partition"
SOURCE_OFFSET_HEADER: Final = "leaf-source-offset"
