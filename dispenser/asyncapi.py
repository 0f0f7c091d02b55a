"""The AsyncAPI 3.0 document of every NATS subject and Kafka topic (``docs/asyncapi.yaml``), built from the code.

Nothing in it is written by hand twice: the subjects come from :mod:`dispenser.messages`' subject
functions and the default settings (:class:`~dispenser.config.Config`), the header names from the adapters
that set and read them, the payload schemas from the same msgspec Structs as ``schemas/*.schema.json``
(:data:`~dispenser.messages.WIRE_TYPES`; in the draft-07 dialect of AsyncAPI's schemas, :func:`draft7`).
``dispenser schemas`` writes it, ``dispenser schemas --check``
fails when it drifts, and ``tests/unit/test_asyncapi.py`` validates it against the AsyncAPI 3.0.0 schema.

The document describes the dispenser's side: it *receives* ID requests and *sends* replies, rate events
and enriched records. Addresses are those of the default configuration (prefix ``leaf``); the settings
that change them are named in each channel's description.

YAML is written by :func:`to_yaml` (a small emitter for JSON-like data), so that the command needs no YAML
library at run time.
"""

from __future__ import annotations

import math
import re
from typing import Any, Final, get_args

import msgspec

from dispenser import __version__
from dispenser.adapters.kafka.clients import CONTENT_TYPE, CORRELATION_ID, REPLY_PARTITION, REPLY_TOPIC
from dispenser.adapters.kafka.enrich import (
    ERROR_CODE_HEADER as DEAD_LETTER_CODE_HEADER,
)
from dispenser.adapters.kafka.enrich import (
    ERROR_MESSAGE_HEADER,
    SOURCE_HEADER,
    SOURCE_OFFSET_HEADER,
    SOURCE_PARTITION_HEADER,
    SOURCE_TOPIC_HEADER,
    EnrichSettings,
)
from dispenser.adapters.kafka.requests import ERROR_CODE_HEADER as KAFKA_ERROR_CODE_HEADER
from dispenser.adapters.nats.micro import ERROR_CODE_HEADER, ERROR_HEADER
from dispenser.adapters.nats.service import CONTENT_TYPE as NATS_CONTENT_TYPE
from dispenser.config import Config
from dispenser.messages import (
    DECODE_TAG,
    MSGPACK,
    WIRE_TYPES,
    clock_subject,
    id_subject,
    rate_subject,
)
from dispenser.service.enrichment import Placement, RejectionCode

__all__ = ["ASYNCAPI_VERSION", "asyncapi_document", "draft7", "to_yaml"]

ASYNCAPI_VERSION: Final = "3.0.0"
"""The AsyncAPI version the document follows (its schema is vendored in ``tests/data/``)."""

_JSON: Final = "application/json"


def _ref(section: str, name: str) -> dict[str, str]:
    return {"$ref": f"#/{section}/{name}"}


def _string(description: str, **more: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **more}


def _headers(properties: dict[str, dict[str, Any]], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


def draft7(schema: Any) -> Any:
    """``schema`` (msgspec's JSON Schema 2020-12) in the draft-07 dialect AsyncAPI 3.0 schemas are read in.

    Only tuples differ in what msgspec writes: 2020-12's ``prefixItems`` with ``items: false`` becomes
    draft-07's ``items: [...]`` with ``additionalItems: false`` (a draft-07 reader would take ``items:
    false`` for "no items at all", and reject every range).
    """
    if isinstance(schema, list):
        return [draft7(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    converted = {key: draft7(value) for key, value in schema.items()}
    if "prefixItems" in converted:
        converted["items"] = converted.pop("prefixItems")
        converted["additionalItems"] = schema.get("items", True)
    return converted


def _payload_schemas() -> dict[str, Any]:
    """The wire Structs' schemas as components, referring to each other under ``#/components/schemas``."""
    _, components = msgspec.json.schema_components(
        WIRE_TYPES.values(), ref_template="#/components/schemas/{name}"
    )
    return {name: draft7(schema) for name, schema in sorted(components.items())}


def asyncapi_document(config: Config | None = None) -> dict[str, Any]:
    """The AsyncAPI 3.0 document for `config` (default: the default configuration, as in the docs)."""
    config = config or Config()
    nats, kafka = config.nats, config.kafka
    prefix = nats.subject_prefix
    enrich = EnrichSettings(
        input_topic="{input}", output_topic="{output}", tag="", placement=Placement("field", ("id",))
    )
    tag_parameter = {"description": "The business tag (`leaf_alloc.biz_tag`); it may contain dots."}
    nats_server = [_ref("servers", "nats")]
    kafka_server = [_ref("servers", "kafka")]
    queue = {"nats": {"queue": nats.queue_group, "bindingVersion": "0.1.0"}}
    tag_key = {"kafka": {"key": _string("The tag."), "bindingVersion": "0.5.0"}}
    nats_content_type = _string(
        f"`{MSGPACK}`: the body is msgpack, and so is the reply (JSON otherwise).", enum=[MSGPACK]
    )

    channels: dict[str, Any] = {
        "segmentIds": {
            "address": id_subject(prefix, "segment", "{tag}"),
            "title": "Segment IDs",
            "description": "IDs of a tag from PostgreSQL segments (Leaf-segment). The workers share the "
            "subjects in a queue group. Prefix: `nats.subject_prefix`; queue group: `nats.queue_group`.",
            "parameters": {"tag": tag_parameter},
            "servers": nats_server,
            "messages": {"idRequest": _ref("components/messages", "idRequest")},
        },
        "snowflakeIds": {
            "address": id_subject(prefix, "snowflake", "{tag}"),
            "title": "Snowflake IDs",
            "description": "Snowflake IDs (any tag; the tag names the demand in rate events and metrics).",
            "parameters": {"tag": tag_parameter},
            "servers": nats_server,
            "messages": {"idRequest": _ref("components/messages", "idRequest")},
        },
        "snowflakeDecode": {
            "address": id_subject(prefix, "snowflake", DECODE_TAG),
            "title": "Decode a snowflake ID",
            "description": "Takes a snowflake ID apart with the worker's layout and epoch (so `"
            f"{DECODE_TAG}` is no tag of its own).",
            "servers": nats_server,
            "messages": {"decodeRequest": _ref("components/messages", "decodeRequest")},
        },
        "natsReplies": {
            "address": None,
            "title": "NATS replies",
            "description": "The requester's reply subject (its inbox), as NATS request/reply sets it.",
            "servers": nats_server,
            "messages": {
                "reply": _ref("components/messages", "reply"),
                "decodeReply": _ref("components/messages", "decodeReply"),
                "clockReading": _ref("components/messages", "clockReading"),
            },
        },
        "rateEvents": {
            "address": rate_subject(prefix, "{tag}"),
            "title": "Consumption-rate events",
            "description": "Every `rate.interval` seconds each worker publishes one event per tag it "
            f"serves; peers size their segments from them, `dispenser watch` shows them (it subscribes "
            f"to `{rate_subject(prefix, '>')}`).",
            "parameters": {"tag": tag_parameter},
            "servers": nats_server,
            "messages": {"rateEvent": _ref("components/messages", "rateEvent")},
        },
        "snowflakeClock": {
            "address": clock_subject(prefix),
            "title": "Snowflake clock check",
            "description": "A starting snowflake worker asks every live one for its clock (no queue "
            "group: all answer) and refuses to start when its own is too far from their mean "
            "(`snowflake.peer_threshold_ms`). The check and the answers carry each worker's claim on its "
            "(datacenter, worker) ID: a worker that hears a live peer claim its own issues no snowflake ID "
            "(`worker_id_in_use`); serving workers check again every `snowflake.peer_recheck_interval`.",
            "servers": nats_server,
            "messages": {"clockCheck": _ref("components/messages", "clockCheck")},
        },
        "kafkaRequests": {
            "address": kafka.request_topic,
            "title": "Kafka ID requests",
            "description": "ID requests, keyed by tag (`kafka.request_topic`); the workers share its "
            f"partitions as the consumer group `kafka.group_id` (`{kafka.group_id}`).",
            "servers": kafka_server,
            "messages": {"kafkaIdRequest": _ref("components/messages", "kafkaIdRequest")},
        },
        "kafkaReplies": {
            "address": kafka.reply_topic,
            "title": "Kafka replies",
            "description": f"Where a reply goes: the request's `{REPLY_TOPIC}` header, else "
            "`kafka.reply_topic` (this address).",
            "servers": kafka_server,
            "messages": {"kafkaReply": _ref("components/messages", "kafkaReply")},
        },
        "kafkaRateEvents": {
            "address": config.rate.kafka_topic,
            "title": "Consumption-rate events on Kafka",
            "description": "The rate events again, keyed by tag, when `kafka.enabled` "
            "(`rate.kafka_topic`); a worker without NATS listens to its peers here.",
            "servers": kafka_server,
            "messages": {"kafkaRateEvent": _ref("components/messages", "kafkaRateEvent")},
        },
        "enrichInput": {
            "address": enrich.input_topic,
            "title": "Records to enrich",
            "description": "`dispenser enrich --in`: any records.",
            "parameters": {"input": {"description": "The input topic (`--in`)."}},
            "servers": kafka_server,
            "messages": {"inputRecord": _ref("components/messages", "inputRecord")},
        },
        "enrichOutput": {
            "address": enrich.output_topic,
            "title": "Enriched records",
            "description": "`dispenser enrich --out`: every input record that took an ID, exactly once "
            "(Kafka transactions: read it with `isolation.level=read_committed`).",
            "parameters": {"output": {"description": "The output topic (`--out`)."}},
            "servers": kafka_server,
            "messages": {"enrichedRecord": _ref("components/messages", "enrichedRecord")},
        },
        "enrichDeadLetters": {
            "address": enrich.dlq,
            "title": "Dead letters",
            "description": "`dispenser enrich --dlq` (default shown): records that cannot take an ID, "
            "unchanged, with headers saying why and where they came from; in the same transactions.",
            "parameters": {"input": {"description": "The input topic (`--in`)."}},
            "servers": kafka_server,
            "messages": {"deadLetter": _ref("components/messages", "deadLetter")},
        },
    }

    def reply_to(*messages: str) -> dict[str, Any]:
        return {
            "channel": _ref("channels", "natsReplies"),
            "messages": [_ref("channels/natsReplies/messages", name) for name in messages],
        }

    operations: dict[str, Any] = {
        "serveSegmentIds": {
            "action": "receive",
            "channel": _ref("channels", "segmentIds"),
            "summary": "Answer with IDs, ranges or an error; never silence.",
            "bindings": queue,
            "reply": reply_to("reply"),
        },
        "serveSnowflakeIds": {
            "action": "receive",
            "channel": _ref("channels", "snowflakeIds"),
            "summary": "Answer with snowflake IDs, ranges or an error.",
            "bindings": queue,
            "reply": reply_to("reply"),
        },
        "decodeSnowflakeIds": {
            "action": "receive",
            "channel": _ref("channels", "snowflakeDecode"),
            "summary": "Answer with the ID's time, worker and sequence.",
            "bindings": queue,
            "reply": reply_to("decodeReply"),
        },
        "publishRates": {
            "action": "send",
            "channel": _ref("channels", "rateEvents"),
            "summary": "This worker's rate of each tag, every `rate.interval` seconds.",
        },
        "followRates": {
            "action": "receive",
            "channel": _ref("channels", "rateEvents"),
            "summary": "The peers' rates (every worker listens; so does `dispenser watch`).",
        },
        "answerClockChecks": {
            "action": "receive",
            "channel": _ref("channels", "snowflakeClock"),
            "summary": "Every snowflake worker answers with its clock and worker ID.",
            "reply": reply_to("clockReading"),
        },
        "checkPeerClocks": {
            "action": "send",
            "channel": _ref("channels", "snowflakeClock"),
            "summary": "At start-up and every `snowflake.peer_recheck_interval`, ask the live snowflake "
            "workers for their clocks and claims (`snowflake.peer_check_timeout` to answer).",
            "reply": reply_to("clockReading"),
        },
        "serveKafkaRequests": {
            "action": "receive",
            "channel": _ref("channels", "kafkaRequests"),
            "summary": "Answer each request on its reply topic, as Spring's ReplyingKafkaTemplate expects.",
            "bindings": {
                "kafka": {"groupId": {"type": "string", "enum": [kafka.group_id]}, "bindingVersion": "0.5.0"}
            },
            "reply": {
                "address": {
                    "location": f"$message.header#/{REPLY_TOPIC}",
                    "description": "The request's reply topic; without the header, `kafka.reply_topic`.",
                },
                "channel": _ref("channels", "kafkaReplies"),
            },
        },
        "publishKafkaRates": {
            "action": "send",
            "channel": _ref("channels", "kafkaRateEvents"),
            "summary": "The rate events, on Kafka too.",
        },
        "followKafkaRates": {
            "action": "receive",
            "channel": _ref("channels", "kafkaRateEvents"),
            "summary": "The peers' rates, read by a worker with NATS off (from the topic's end).",
        },
        "enrichRecords": {
            "action": "receive",
            "channel": _ref("channels", "enrichInput"),
            "summary": "Consume in the group `enrich.group_id` "
            f"(default `{enrich.group}`), one transaction per input partition and batch.",
        },
        "sendEnrichedRecords": {
            "action": "send",
            "channel": _ref("channels", "enrichOutput"),
            "summary": "Each record with its ID in place, in the transaction that commits its input offset.",
        },
        "sendDeadLetters": {
            "action": "send",
            "channel": _ref("channels", "enrichDeadLetters"),
            "summary": "Records that cannot take an ID, in the same transaction.",
        },
    }

    source = _string(
        "`<topic>/<partition>/<offset>` of the input record (`enrich.source_header`).",
        examples=["orders.raw/0/1234"],
    )
    messages: dict[str, Any] = {
        "idRequest": {
            "name": "IdRequest",
            "title": "ID request",
            "summary": 'Empty, or {"count": n, "format": "ids"|"ranges", "request_id": "…"}; an empty body is one ID.',
            "contentType": _JSON,
            "headers": _headers({NATS_CONTENT_TYPE: nats_content_type}),
            "payload": _ref("components/schemas", "IdRequest"),
            "examples": [
                {"name": "ids", "payload": {"count": 3}},
                {"name": "retryable", "payload": {"count": 1000, "format": "ranges", "request_id": "9b1f2c"}},
            ],
        },
        "reply": {
            "name": "Reply",
            "title": "ID reply",
            "summary": "Exactly one of ids, ranges (inclusive, increasing) or error.",
            "contentType": _JSON,
            "headers": _headers(
                {
                    ERROR_HEADER: _string("Error replies only: the error's message (NATS services, ADR-32)."),
                    ERROR_CODE_HEADER: _string(
                        "Error replies only: an HTTP-like status (400, 404, 413, 503, 507, …).",
                        pattern="^[0-9]{3}$",
                    ),
                    NATS_CONTENT_TYPE: nats_content_type,
                }
            ),
            "payload": _ref("components/schemas", "Reply"),
            "examples": [
                {"name": "ids", "payload": {"tag": "order", "ids": [1001, 1002, 1003]}},
                {
                    "name": "ranges",
                    "payload": {"tag": "order", "ranges": [[1001, 1500]], "request_id": "9b1f2c"},
                },
                {
                    "name": "error",
                    "headers": {ERROR_HEADER: "unknown tag 'order'", ERROR_CODE_HEADER: "404"},
                    "payload": {
                        "tag": "order",
                        "error": {
                            "code": "unknown_tag",
                            "message": "unknown tag 'order'",
                            "retryable": False,
                        },
                    },
                },
            ],
        },
        "decodeRequest": {
            "name": "DecodeRequest",
            "title": "Decode request",
            "contentType": _JSON,
            "payload": _ref("components/schemas", "DecodeRequest"),
            "examples": [{"payload": {"id": 1852331557490475008}}],
        },
        "decodeReply": {
            "name": "DecodeReply",
            "title": "Decode reply",
            "contentType": _JSON,
            "payload": _ref("components/schemas", "DecodeReply"),
        },
        "rateEvent": {
            "name": "RateEvent",
            "title": "Rate event",
            "contentType": _JSON,
            "payload": _ref("components/schemas", "RateEvent"),
        },
        "clockCheck": {
            "name": "ClockCheck",
            "title": "Clock check",
            "summary": "The checking worker's claim (a clock reading; empty from an observer such as "
            "`dispenser check`), with a reply subject.",
        },
        "clockReading": {
            "name": "ClockReading",
            "title": "Clock reading",
            "contentType": _JSON,
            "payload": _ref("components/schemas", "ClockReading"),
        },
        "kafkaIdRequest": {
            "name": "KafkaIdRequest",
            "title": "Kafka ID request",
            "summary": "Keyed by tag; the NATS request plus tag and kind, every field optional (an empty "
            "value is one segment ID of the tag named by the key).",
            "contentType": _JSON,
            "headers": _headers(
                {
                    REPLY_TOPIC: _string("The topic the reply goes to (default `kafka.reply_topic`)."),
                    REPLY_PARTITION: {
                        "description": "The reply's partition: a 4-byte big-endian int, as Spring writes "
                        "it (ASCII digits accepted)."
                    },
                    CORRELATION_ID: {"description": "Copied to the reply byte for byte."},
                    CONTENT_TYPE: _string(
                        f"`{MSGPACK}`: the value is msgpack, and so is the reply.", enum=[MSGPACK]
                    ),
                }
            ),
            "correlationId": _ref("components/correlationIds", "kafkaCorrelationId"),
            "payload": _ref("components/schemas", "KafkaIdRequest"),
            "bindings": tag_key,
            "examples": [{"payload": {"tag": "order", "kind": "segment", "count": 100}}],
        },
        "kafkaReply": {
            "name": "KafkaReply",
            "title": "Kafka reply",
            "summary": "The NATS reply, keyed as the request was; `kind_not_served` when the request "
            "names a generator the worker does not run.",
            "contentType": _JSON,
            "headers": _headers(
                {
                    CORRELATION_ID: {"description": "The request's, byte for byte."},
                    KAFKA_ERROR_CODE_HEADER: _string(
                        "Error replies only: the error's code (as in the body)."
                    ),
                    CONTENT_TYPE: _string(f"`{MSGPACK}` when the request was msgpack.", enum=[MSGPACK]),
                }
            ),
            "correlationId": _ref("components/correlationIds", "kafkaCorrelationId"),
            "payload": _ref("components/schemas", "Reply"),
            "bindings": tag_key,
        },
        "kafkaRateEvent": {
            "name": "KafkaRateEvent",
            "title": "Rate event on Kafka",
            "contentType": _JSON,
            "payload": _ref("components/schemas", "RateEvent"),
            "bindings": tag_key,
        },
        "inputRecord": {
            "name": "InputRecord",
            "title": "Record to enrich",
            "summary": "Any record. With `--field` its value must be a JSON object (with the path's "
            "parents); with `--header` or `--key` the value is not read.",
            "payload": {"description": "Any value."},
        },
        "enrichedRecord": {
            "name": "EnrichedRecord",
            "title": "Enriched record",
            "summary": "The input record with its ID: in a JSON field (`--field`, the value re-encoded), "
            "a header (`--header`, ASCII decimal) or the key (`--key`, ASCII decimal); other keys and "
            "headers unchanged.",
            "headers": _headers({SOURCE_HEADER: source}),
            "payload": {"description": "The input value, with the ID in it when placed in a field."},
        },
        "deadLetter": {
            "name": "DeadLetter",
            "title": "Dead letter",
            "summary": "The input record's key, value and headers, plus why and where from.",
            "headers": _headers(
                {
                    DEAD_LETTER_CODE_HEADER: _string(
                        "Why the record took no ID.", enum=list(get_args(RejectionCode))
                    ),
                    ERROR_MESSAGE_HEADER: _string("The same, for a person."),
                    SOURCE_TOPIC_HEADER: _string("The input record's topic."),
                    SOURCE_PARTITION_HEADER: _string("Its partition, ASCII decimal.", pattern="^[0-9]+$"),
                    SOURCE_OFFSET_HEADER: _string("Its offset, ASCII decimal.", pattern="^[0-9]+$"),
                    SOURCE_HEADER: source,
                },
                required=(
                    DEAD_LETTER_CODE_HEADER,
                    ERROR_MESSAGE_HEADER,
                    SOURCE_TOPIC_HEADER,
                    SOURCE_PARTITION_HEADER,
                    SOURCE_OFFSET_HEADER,
                ),
            ),
            "payload": {"description": "The input value, unchanged."},
        },
    }

    return {
        "asyncapi": ASYNCAPI_VERSION,
        "id": "urn:leaf-dispenser",
        "info": {
            "title": "Leaf dispenser",
            "version": __version__,
            "description": "Unique 64-bit IDs over NATS and Kafka (Leaf's segment and snowflake "
            "generators). Generated by `dispenser schemas` from the code: do not edit. The payload "
            "schemas are those of `schemas/*.schema.json`. NATS services discovery (`$SRV.PING`, "
            "`$SRV.INFO`, `$SRV.STATS`) follows ADR-32 and is not repeated here.",
            "license": {"name": "Apache-2.0", "url": "https://www.apache.org/licenses/LICENSE-2.0"},
            "externalDocs": {
                "description": "NATS services (ADR-32): discovery subjects and error headers",
                "url": "https://github.com/nats-io/nats-architecture-and-design/blob/main/adr/ADR-32.md",
            },
        },
        "defaultContentType": _JSON,
        "servers": {
            "nats": {
                "host": _host(nats.url),
                "protocol": "nats",
                "description": "`nats.url` (default shown); user/password, token, nkey, creds and TLS "
                "as configured (docs/security.md).",
            },
            "kafka": {
                "host": kafka.bootstrap_servers.split(",")[0],
                "protocol": "kafka",
                "description": "`kafka.bootstrap_servers` (default shown); SASL and TLS as configured.",
            },
        },
        "channels": channels,
        "operations": operations,
        "components": {
            "schemas": _payload_schemas(),
            "messages": messages,
            "correlationIds": {
                "kafkaCorrelationId": {
                    "description": "Spring's correlation header, copied from the request to its reply.",
                    "location": f"$message.header#/{CORRELATION_ID}",
                }
            },
        },
    }


def _host(url: str) -> str:
    """``host:port`` of the first URL of a comma-separated list."""
    first = url.split(",", maxsplit=1)[0].strip()
    return first.split("://", 1)[-1]


# -- YAML ------------------------------------------------------------------------------------------------

_PLAIN = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$./-]*$")
_RESERVED = {"y", "n", "yes", "no", "true", "false", "on", "off", "null", "~"}
# What a YAML reader takes as it is inside double quotes (YAML 1.1's printable set, which PyYAML checks).
_PRINTABLE = re.compile("[\t\x20-\x7e\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
# Printable, but line breaks to YAML: escaped, or a reader would fold them.
_ESCAPES |= {"\x85": "\\N", "\u2028": "\\L", "\u2029": "\\P"}


def _scalar(value: object) -> str:
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        # YAML 1.1 reads 1e-05 as a string: its floats have a point (and a signed exponent, as repr's).
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa}.0{e}{exponent}" if e and "." not in mantissa else text
    if isinstance(value, str):
        if _PLAIN.match(value) and value.lower() not in _RESERVED:
            return value
        return '"' + "".join(_escape(char) for char in value) + '"'
    raise TypeError(f"cannot write {type(value).__name__} as YAML")


def _escape(char: str) -> str:
    if char in _ESCAPES:
        return _ESCAPES[char]
    if _PRINTABLE.match(char):
        return char
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _lines(value: object, indent: str) -> list[str]:
    """The block lines of a mapping or sequence (non-empty), each starting with ``indent``."""
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"YAML keys here are strings, not {type(key).__name__}")
            head = f"{indent}{_scalar(key)}:"
            if isinstance(item, dict | list) and item:
                lines.append(head)
                lines += _lines(item, indent + "  ")
            else:
                lines.append(f"{head} {_inline(item)}")
    else:
        assert isinstance(value, list)
        for item in value:
            if isinstance(item, dict | list) and item:
                nested = _lines(item, indent + "  ")
                lines.append(f"{indent}- {nested[0].lstrip()}")
                lines += nested[1:]
            else:
                lines.append(f"{indent}- {_inline(item)}")
    return lines


def _inline(value: object) -> str:
    if isinstance(value, dict):
        assert not value
        return "{}"
    if isinstance(value, list):
        assert not value
        return "[]"
    return _scalar(value)


def to_yaml(document: dict[str, Any] | list[Any]) -> str:
    """``document`` (JSON-like: dicts with string keys, lists, strings, numbers, booleans, None) as block YAML.

    Every string that a YAML reader could take for something else (a number, a boolean, null, or text
    with punctuation) is double-quoted, so that ``yaml.safe_load(to_yaml(d)) == d``.
    """
    if not document:
        return _inline(document) + "\n"
    return "\n".join(_lines(document, "")) + "\n"
