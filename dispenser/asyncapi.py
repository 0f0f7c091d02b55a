"""The AsyncAPI 3.0 document of every NATS subject and Kafka topic (``docs/asyncapi.yaml``), built from the code.

Subjects, settings, header names and payload schemas all come from the code (:mod:`dispenser.messages`,
:class:`~dispenser.config.Config`, the adapters), one small piece per channel; :func:`to_yaml` writes it
with PyYAML. ``dispenser schemas --check`` fails when it drifts. See ``docs/protocol.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
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
from dispenser.config import Config, KafkaConfig, NatsConfig
from dispenser.messages import (
    DECODE_TAG,
    MSGPACK,
    WIRE_TYPES,
    clock_subject,
    id_subject,
    rate_subject,
    residue_check_subject,
    residue_subject,
)
from dispenser.service.enrichment import Placement, RejectionCode

__all__ = ["ASYNCAPI_VERSION", "asyncapi_document", "draft7", "is_current", "to_yaml"]

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


@dataclass(frozen=True)
class _Part:
    """One channel of the document, the operations on it and the component messages it brings in."""

    name: str
    channel: dict[str, Any]
    operations: dict[str, Any] = field(default_factory=dict)
    messages: dict[str, Any] = field(default_factory=dict)


def _channel(
    address: str | None,
    title: str,
    description: str,
    *,
    server: str,
    messages: tuple[str, ...],
    parameters: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A channel on ``server`` (``nats`` or ``kafka``) carrying the component ``messages`` of those names."""
    channel: dict[str, Any] = {"address": address, "title": title, "description": description}
    if parameters:
        channel["parameters"] = {name: {"description": text} for name, text in parameters.items()}
    channel["servers"] = [_ref("servers", server)]
    channel["messages"] = {name: _ref("components/messages", name) for name in messages}
    return channel


def _operation(action: str, channel: str, summary: str, **more: Any) -> dict[str, Any]:
    return {"action": action, "channel": _ref("channels", channel), "summary": summary, **more}


def _nats_reply(*messages: str) -> dict[str, Any]:
    """An operation's reply, sent to the requester's inbox (the ``natsReplies`` channel)."""
    return {
        "channel": _ref("channels", "natsReplies"),
        "messages": [_ref("channels/natsReplies/messages", name) for name in messages],
    }


_TAG = "The business tag (`leaf_alloc.biz_tag`); it may contain dots."


def _tag_key() -> dict[str, Any]:
    """The Kafka binding of a message keyed by tag."""
    return {"kafka": {"key": _string("The tag."), "bindingVersion": "0.5.0"}}


def _nats_content_type() -> dict[str, Any]:
    return _string(f"`{MSGPACK}`: the body is msgpack, and so is the reply (JSON otherwise).", enum=[MSGPACK])


def _queue(nats: NatsConfig) -> dict[str, Any]:
    return {"nats": {"queue": nats.queue_group, "bindingVersion": "0.1.0"}}


# -- NATS ------------------------------------------------------------------------------------------------


def _segment_ids(nats: NatsConfig) -> _Part:
    channel = _channel(
        id_subject(nats.subject_prefix, "segment", "{tag}"),
        "Segment IDs",
        "IDs of a tag from PostgreSQL segments (Leaf-segment). The workers share the subjects in a queue "
        "group. Prefix: `nats.subject_prefix`; queue group: `nats.queue_group`.",
        server="nats",
        messages=("idRequest",),
        parameters={"tag": _TAG},
    )
    serve = _operation(
        "receive",
        "segmentIds",
        "Answer with IDs, ranges or an error; never silence.",
        bindings=_queue(nats),
        reply=_nats_reply("reply"),
    )
    id_request = {
        "name": "IdRequest",
        "title": "ID request",
        "summary": 'Empty, or {"count": n, "format": "ids"|"ranges", "request_id": "…"}; an empty body is one ID.',
        "contentType": _JSON,
        "headers": _headers({NATS_CONTENT_TYPE: _nats_content_type()}),
        "payload": _ref("components/schemas", "IdRequest"),
        "examples": [
            {"name": "ids", "payload": {"count": 3}},
            {"name": "retryable", "payload": {"count": 1000, "format": "ranges", "request_id": "9b1f2c"}},
        ],
    }
    return _Part("segmentIds", channel, {"serveSegmentIds": serve}, {"idRequest": id_request})


def _snowflake_ids(nats: NatsConfig) -> _Part:
    channel = _channel(
        id_subject(nats.subject_prefix, "snowflake", "{tag}"),
        "Snowflake IDs",
        "Snowflake IDs (any tag; the tag names the demand in rate events and metrics).",
        server="nats",
        messages=("idRequest",),
        parameters={"tag": _TAG},
    )
    serve = _operation(
        "receive",
        "snowflakeIds",
        "Answer with snowflake IDs, ranges or an error.",
        bindings=_queue(nats),
        reply=_nats_reply("reply"),
    )
    return _Part("snowflakeIds", channel, {"serveSnowflakeIds": serve})


def _snowflake_decode(nats: NatsConfig) -> _Part:
    channel = _channel(
        id_subject(nats.subject_prefix, "snowflake", DECODE_TAG),
        "Decode a snowflake ID",
        f"Takes a snowflake ID apart with the worker's layout and epoch (so `{DECODE_TAG}` is no tag of "
        "its own).",
        server="nats",
        messages=("decodeRequest",),
    )
    decode = _operation(
        "receive",
        "snowflakeDecode",
        "Answer with the ID's time, worker and sequence.",
        bindings=_queue(nats),
        reply=_nats_reply("decodeReply"),
    )
    decode_request = {
        "name": "DecodeRequest",
        "title": "Decode request",
        "contentType": _JSON,
        "payload": _ref("components/schemas", "DecodeRequest"),
        "examples": [{"payload": {"id": 1852331557490475008}}],
    }
    return _Part(
        "snowflakeDecode", channel, {"decodeSnowflakeIds": decode}, {"decodeRequest": decode_request}
    )


def _nats_replies() -> _Part:
    channel = _channel(
        None,
        "NATS replies",
        "The requester's reply subject (its inbox), as NATS request/reply sets it.",
        server="nats",
        messages=("reply", "decodeReply", "clockReading", "residueClaims"),
    )
    error = {"code": "unknown_tag", "message": "unknown tag 'order'", "retryable": False}
    reply = {
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
                NATS_CONTENT_TYPE: _nats_content_type(),
            }
        ),
        "payload": _ref("components/schemas", "Reply"),
        "examples": [
            {"name": "ids", "payload": {"tag": "order", "ids": [1001, 1002, 1003]}},
            {"name": "ranges", "payload": {"tag": "order", "ranges": [[1001, 1500]], "request_id": "9b1f2c"}},
            {
                "name": "error",
                "headers": {ERROR_HEADER: "unknown tag 'order'", ERROR_CODE_HEADER: "404"},
                "payload": {"tag": "order", "error": error},
            },
        ],
    }
    messages = {
        "reply": reply,
        "decodeReply": _payload_message("DecodeReply", "Decode reply"),
        "clockReading": _payload_message("ClockReading", "Clock reading"),
        "residueClaims": _payload_message("ResidueClaims", "Residue claims"),
    }
    return _Part("natsReplies", channel, messages=messages)


def _rate_events(nats: NatsConfig) -> _Part:
    prefix = nats.subject_prefix
    channel = _channel(
        rate_subject(prefix, "{tag}"),
        "Consumption-rate events",
        "Every `rate.interval` seconds each worker publishes one event per tag it serves; peers size "
        "their segments from them, `dispenser watch` shows them (it subscribes to "
        f"`{rate_subject(prefix, '>')}`).",
        server="nats",
        messages=("rateEvent",),
        parameters={"tag": _TAG},
    )
    operations = {
        "publishRates": _operation(
            "send", "rateEvents", "This worker's rate of each tag, every `rate.interval` seconds."
        ),
        "followRates": _operation(
            "receive", "rateEvents", "The peers' rates (every worker listens; so does `dispenser watch`)."
        ),
    }
    return _Part(
        "rateEvents", channel, operations, {"rateEvent": _payload_message("RateEvent", "Rate event")}
    )


def _snowflake_clock(nats: NatsConfig) -> _Part:
    channel = _channel(
        clock_subject(nats.subject_prefix),
        "Snowflake clock check",
        "A starting snowflake worker asks every live one for its clock (no queue group: all answer) and "
        "refuses to start when its own is too far from their mean (`snowflake.peer_threshold_ms`). The "
        "check and the answers carry each worker's claim on its ID (datacenter, worker and the node bits "
        "it puts in its IDs): a worker that hears a live peer whose node bits can compose one of its IDs "
        "issues no snowflake ID (`worker_id_in_use`); a starting worker checks twice, "
        "`snowflake.peer_check_timeout` apart, and serving workers check again every "
        "`snowflake.peer_recheck_interval`.",
        server="nats",
        messages=("clockCheck",),
    )
    operations = {
        "answerClockChecks": _operation(
            "receive",
            "snowflakeClock",
            "Every snowflake worker answers with its clock and worker ID.",
            reply=_nats_reply("clockReading"),
        ),
        "checkPeerClocks": _operation(
            "send",
            "snowflakeClock",
            "At start-up (twice, a window apart) and every `snowflake.peer_recheck_interval`, ask the live "
            "snowflake workers for their clocks and claims (`snowflake.peer_check_timeout` to answer).",
            reply=_nats_reply("clockReading"),
        ),
    }
    clock_check = {
        "name": "ClockCheck",
        "title": "Clock check",
        "summary": "The checking worker's claim (a clock reading; empty from an observer such as "
        "`dispenser check`), with a reply subject.",
    }
    return _Part("snowflakeClock", channel, operations, {"clockCheck": clock_check})


def _segment_residues(nats: NatsConfig) -> _Part:
    channel = _channel(
        residue_subject(nats.subject_prefix),
        "Segment residue claims",
        "A segment worker announces the residue class of a tag in its database (PostgreSQL's system "
        "identifier and the database's name) when it starts serving the tag, and when it refuses one. Every "
        "segment worker listens (no queue group); a worker whose database serves a class of the same tag "
        "that shares IDs with another database's refuses it (`residue_overlap`; docs/datacenters.md).",
        server="nats",
        messages=("residueAnnouncement",),
    )
    operations = {
        "announceResidues": _operation(
            "send", "segmentResidues", "This worker's claim on a tag's class, at the tag's first segment."
        ),
        "followResidues": _operation("receive", "segmentResidues", "The other workers' claims."),
    }
    message = _payload_message("ResidueClaims", "Residue claims", name="ResidueAnnouncement")
    return _Part("segmentResidues", channel, operations, {"residueAnnouncement": message})


def _segment_residue_checks(nats: NatsConfig) -> _Part:
    channel = _channel(
        residue_check_subject(nats.subject_prefix),
        "Segment residue check",
        "A segment worker asks every live one for its tags' classes: at start-up (within "
        "`segment.residue_check_window`) and every `segment.residue_recheck_interval`. Every segment "
        "worker answers, with its claims when it is on another database; `dispenser check` asks as an "
        "observer.",
        server="nats",
        messages=("residueCheck",),
    )
    operations = {
        "answerResidueChecks": _operation(
            "receive",
            "segmentResidueChecks",
            "Every segment worker answers, with its claims when it is on another database.",
            reply=_nats_reply("residueClaims"),
        ),
        "checkResidues": _operation(
            "send",
            "segmentResidueChecks",
            "Ask the other databases' workers for their claims (this worker's own sent along).",
            reply=_nats_reply("residueClaims"),
        ),
    }
    message = _payload_message("ResidueClaims", "Residue check", name="ResidueCheck")
    return _Part("segmentResidueChecks", channel, operations, {"residueCheck": message})


# -- Kafka -----------------------------------------------------------------------------------------------


def _kafka_requests(kafka: KafkaConfig) -> _Part:
    channel = _channel(
        kafka.request_topic,
        "Kafka ID requests",
        "ID requests, keyed by tag (`kafka.request_topic`); the workers share its partitions as the "
        f"consumer group `kafka.group_id` (`{kafka.group_id}`).",
        server="kafka",
        messages=("kafkaIdRequest",),
    )
    group = {"kafka": {"groupId": {"type": "string", "enum": [kafka.group_id]}, "bindingVersion": "0.5.0"}}
    reply_address = {
        "location": f"$message.header#/{REPLY_TOPIC}",
        "description": "The request's reply topic; without the header, `kafka.reply_topic`.",
    }
    serve = _operation(
        "receive",
        "kafkaRequests",
        "Answer each request on its reply topic, as Spring's ReplyingKafkaTemplate expects.",
        bindings=group,
        reply={"address": reply_address, "channel": _ref("channels", "kafkaReplies")},
    )
    request = {
        "name": "KafkaIdRequest",
        "title": "Kafka ID request",
        "summary": "Keyed by tag; the NATS request plus tag and kind, every field optional (an empty value "
        "is one segment ID of the tag named by the key).",
        "contentType": _JSON,
        "headers": _headers(
            {
                REPLY_TOPIC: _string("The topic the reply goes to (default `kafka.reply_topic`)."),
                REPLY_PARTITION: {
                    "description": "The reply's partition: a 4-byte big-endian int, as Spring writes it "
                    "(ASCII digits accepted)."
                },
                CORRELATION_ID: {"description": "Copied to the reply byte for byte."},
                CONTENT_TYPE: _string(
                    f"`{MSGPACK}`: the value is msgpack, and so is the reply.", enum=[MSGPACK]
                ),
            }
        ),
        "correlationId": _ref("components/correlationIds", "kafkaCorrelationId"),
        "payload": _ref("components/schemas", "KafkaIdRequest"),
        "bindings": _tag_key(),
        "examples": [{"payload": {"tag": "order", "kind": "segment", "count": 100}}],
    }
    return _Part("kafkaRequests", channel, {"serveKafkaRequests": serve}, {"kafkaIdRequest": request})


def _kafka_replies(kafka: KafkaConfig) -> _Part:
    channel = _channel(
        kafka.reply_topic,
        "Kafka replies",
        f"Where a reply goes: the request's `{REPLY_TOPIC}` header, else `kafka.reply_topic` (this address).",
        server="kafka",
        messages=("kafkaReply",),
    )
    reply = {
        "name": "KafkaReply",
        "title": "Kafka reply",
        "summary": "The NATS reply, keyed as the request was; `kind_not_served` when the request names a "
        "generator the worker does not run.",
        "contentType": _JSON,
        "headers": _headers(
            {
                CORRELATION_ID: {"description": "The request's, byte for byte."},
                KAFKA_ERROR_CODE_HEADER: _string("Error replies only: the error's code (as in the body)."),
                CONTENT_TYPE: _string(f"`{MSGPACK}` when the request was msgpack.", enum=[MSGPACK]),
            }
        ),
        "correlationId": _ref("components/correlationIds", "kafkaCorrelationId"),
        "payload": _ref("components/schemas", "Reply"),
        "bindings": _tag_key(),
    }
    return _Part("kafkaReplies", channel, messages={"kafkaReply": reply})


def _kafka_rate_events(config: Config) -> _Part:
    channel = _channel(
        config.rate.kafka_topic,
        "Consumption-rate events on Kafka",
        "The rate events again, keyed by tag, when `kafka.enabled` (`rate.kafka_topic`); a worker without "
        "NATS listens to its peers here.",
        server="kafka",
        messages=("kafkaRateEvent",),
    )
    operations = {
        "publishKafkaRates": _operation("send", "kafkaRateEvents", "The rate events, on Kafka too."),
        "followKafkaRates": _operation(
            "receive",
            "kafkaRateEvents",
            "The peers' rates, read by a worker with NATS off (from the topic's end).",
        ),
    }
    event = _payload_message("RateEvent", "Rate event on Kafka", name="KafkaRateEvent") | {
        "bindings": _tag_key()
    }
    return _Part("kafkaRateEvents", channel, operations, {"kafkaRateEvent": event})


# -- dispenser enrich ------------------------------------------------------------------------------------

# The topics are the command's arguments: the document names them by parameter.
_ENRICH: Final = EnrichSettings(
    input_topic="{input}", output_topic="{output}", tag="", placement=Placement("field", ("id",))
)
_INPUT = "The input topic (`--in`)."


def _source() -> dict[str, Any]:
    return _string(
        "`<topic>/<partition>/<offset>` of the input record (`enrich.source_header`).",
        examples=["orders.raw/0/1234"],
    )


def _enrich_input() -> _Part:
    channel = _channel(
        _ENRICH.input_topic,
        "Records to enrich",
        "`dispenser enrich --in`: any records.",
        server="kafka",
        messages=("inputRecord",),
        parameters={"input": _INPUT},
    )
    consume = _operation(
        "receive",
        "enrichInput",
        f"Consume in the group `enrich.group_id` (default `{_ENRICH.group}`), one transaction per input "
        "partition and batch.",
    )
    record = {
        "name": "InputRecord",
        "title": "Record to enrich",
        "summary": "Any record. With `--field` its value must be a JSON object (with the path's parents); "
        "with `--header` or `--key` the value is not read.",
        "payload": {"description": "Any value."},
    }
    return _Part("enrichInput", channel, {"enrichRecords": consume}, {"inputRecord": record})


def _enrich_output() -> _Part:
    channel = _channel(
        _ENRICH.output_topic,
        "Enriched records",
        "`dispenser enrich --out`: every input record that took an ID, exactly once (Kafka transactions: "
        "read it with `isolation.level=read_committed`).",
        server="kafka",
        messages=("enrichedRecord",),
        parameters={"output": "The output topic (`--out`)."},
    )
    send = _operation(
        "send",
        "enrichOutput",
        "Each record with its ID in place, in the transaction that commits its input offset.",
    )
    record = {
        "name": "EnrichedRecord",
        "title": "Enriched record",
        "summary": "The input record with its ID: in a JSON field (`--field`, the value re-encoded), a "
        "header (`--header`, ASCII decimal) or the key (`--key`, ASCII decimal); other keys and headers "
        "unchanged.",
        "headers": _headers({SOURCE_HEADER: _source()}),
        "payload": {"description": "The input value, with the ID in it when placed in a field."},
    }
    return _Part("enrichOutput", channel, {"sendEnrichedRecords": send}, {"enrichedRecord": record})


def _enrich_dead_letters() -> _Part:
    channel = _channel(
        _ENRICH.dlq,
        "Dead letters",
        "`dispenser enrich --dlq` (default shown): records that cannot take an ID, unchanged, with headers "
        "saying why and where they came from; in the same transactions.",
        server="kafka",
        messages=("deadLetter",),
        parameters={"input": _INPUT},
    )
    send = _operation("send", "enrichDeadLetters", "Records that cannot take an ID, in the same transaction.")
    why = {
        DEAD_LETTER_CODE_HEADER: _string("Why the record took no ID.", enum=list(get_args(RejectionCode))),
        ERROR_MESSAGE_HEADER: _string("The same, for a person."),
        SOURCE_TOPIC_HEADER: _string("The input record's topic."),
        SOURCE_PARTITION_HEADER: _string("Its partition, ASCII decimal.", pattern="^[0-9]+$"),
        SOURCE_OFFSET_HEADER: _string("Its offset, ASCII decimal.", pattern="^[0-9]+$"),
    }
    letter = {
        "name": "DeadLetter",
        "title": "Dead letter",
        "summary": "The input record's key, value and headers, plus why and where from.",
        "headers": _headers(why | {SOURCE_HEADER: _source()}, required=tuple(why)),
        "payload": {"description": "The input value, unchanged."},
    }
    return _Part("enrichDeadLetters", channel, {"sendDeadLetters": send}, {"deadLetter": letter})


def _payload_message(schema: str, title: str, *, name: str | None = None) -> dict[str, Any]:
    """A JSON message whose payload is the wire Struct ``schema``."""
    return {
        "name": name or schema,
        "title": title,
        "contentType": _JSON,
        "payload": _ref("components/schemas", schema),
    }


# -- the document ----------------------------------------------------------------------------------------


def _parts(config: Config) -> list[_Part]:
    """Every channel, in the document's order: NATS, the Kafka requests and rates, ``dispenser enrich``."""
    nats, kafka = config.nats, config.kafka
    return [
        _segment_ids(nats),
        _snowflake_ids(nats),
        _snowflake_decode(nats),
        _nats_replies(),
        _rate_events(nats),
        _snowflake_clock(nats),
        _segment_residues(nats),
        _segment_residue_checks(nats),
        _kafka_requests(kafka),
        _kafka_replies(kafka),
        _kafka_rate_events(config),
        _enrich_input(),
        _enrich_output(),
        _enrich_dead_letters(),
    ]


def _info() -> dict[str, Any]:
    return {
        "title": "Leaf dispenser",
        "version": __version__,
        "description": "Unique 64-bit IDs over NATS and Kafka (Leaf's segment and snowflake generators). "
        "Generated by `dispenser schemas` from the code: do not edit. The payload schemas are those of "
        "`schemas/*.schema.json`. NATS services discovery (`$SRV.PING`, `$SRV.INFO`, `$SRV.STATS`) "
        "follows ADR-32 and is not repeated here.",
        "license": {"name": "Apache-2.0", "url": "https://www.apache.org/licenses/LICENSE-2.0"},
        "externalDocs": {
            "description": "NATS services (ADR-32): discovery subjects and error headers",
            "url": "https://github.com/nats-io/nats-architecture-and-design/blob/main/adr/ADR-32.md",
        },
    }


def _servers(config: Config) -> dict[str, Any]:
    return {
        "nats": {
            "host": _host(config.nats.url),
            "protocol": "nats",
            "description": "`nats.url` (default shown); user/password, token, nkey, creds and TLS as "
            "configured (docs/security.md).",
        },
        "kafka": {
            "host": config.kafka.bootstrap_servers.split(",")[0],
            "protocol": "kafka",
            "description": "`kafka.bootstrap_servers` (default shown); SASL and TLS as configured.",
        },
    }


def asyncapi_document(config: Config | None = None) -> dict[str, Any]:
    """The AsyncAPI 3.0 document for `config` (default: the default configuration, as in the docs)."""
    config = config or Config()
    parts = _parts(config)
    messages: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for part in parts:
        # A name given twice would silently drop a definition: the pieces must not overlap.
        assert not messages.keys() & part.messages.keys(), part.name
        assert not operations.keys() & part.operations.keys(), part.name
        messages |= part.messages
        operations |= part.operations
    correlation = {
        "description": "Spring's correlation header, copied from the request to its reply.",
        "location": f"$message.header#/{CORRELATION_ID}",
    }
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "id": "urn:leaf-dispenser",
        "info": _info(),
        "defaultContentType": _JSON,
        "servers": _servers(config),
        "channels": {part.name: part.channel for part in parts},
        "operations": operations,
        "components": {
            "schemas": _payload_schemas(),
            "messages": messages,
            "correlationIds": {"kafkaCorrelationId": correlation},
        },
    }


def _host(url: str) -> str:
    """``host:port`` of the first URL of a comma-separated list."""
    first = url.split(",", maxsplit=1)[0].strip()
    return first.split("://", 1)[-1]


def to_yaml(document: dict[str, Any] | list[Any]) -> str:
    """``document`` (JSON-like: dicts with string keys, lists, strings, numbers, booleans, None) as block YAML.

    Written by PyYAML's pure-Python safe dumper (its output does not depend on whether libyaml is
    installed), keys in the document's order, lines folded near 100 characters, so that
    ``yaml.safe_load(to_yaml(d)) == d``. PyYAML is needed only by ``dispenser schemas``, a developer's
    command, so it is imported here rather than made a dependency of the product.
    """
    import yaml  # noqa: PLC0415 - a developer's dependency (the [test] extra), not the product's

    class Dumper(yaml.SafeDumper):
        pass

    def represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
        # PyYAML writes NEL, LS and PS raw inside single quotes when allow_unicode is set, and its reader
        # then folds them like line breaks ({'\x85': None} came back as {' ': None}): double quotes
        # escape them.
        style = '"' if _UNICODE_BREAKS.intersection(text) else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)

    Dumper.add_representer(str, represent_str)
    # No anchors and aliases (&id001, *id001) where a value appears twice: a reader sees each in place.
    Dumper.ignore_aliases = lambda self, data: True  # type: ignore[method-assign]
    return yaml.dump(
        document, Dumper=Dumper, sort_keys=False, allow_unicode=True, default_flow_style=False, width=100
    )


def is_current(text: str) -> bool:
    """Whether the YAML ``text`` is the document :func:`asyncapi_document` builds (as data, not as text)."""
    import yaml  # noqa: PLC0415 - see to_yaml

    return bool(yaml.safe_load(text) == json.loads(json.dumps(asyncapi_document())))


_UNICODE_BREAKS: Final = frozenset("\x85\u2028\u2029")
