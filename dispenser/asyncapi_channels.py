"""The channels and operations of the AsyncAPI document (:mod:`dispenser.asyncapi`), one small piece per channel.

Each piece takes its subject or topic, header names and settings from the code (:mod:`dispenser.messages`,
:class:`~dispenser.config.Config`, the adapters); :func:`channel_parts` lists them in the document's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, get_args

from dispenser.adapters.kafka.enrich_settings import EnrichSettings
from dispenser.adapters.kafka.headers import (
    CONTENT_TYPE,
    CORRELATION_ID,
    ERROR_MESSAGE_HEADER,
    REPLY_PARTITION,
    REPLY_TOPIC,
    SOURCE_HEADER,
    SOURCE_OFFSET_HEADER,
    SOURCE_PARTITION_HEADER,
    SOURCE_TOPIC_HEADER,
)
from dispenser.adapters.kafka.headers import ERROR_CODE_HEADER as DEAD_LETTER_CODE_HEADER
from dispenser.adapters.kafka.headers import ERROR_CODE_HEADER as KAFKA_ERROR_CODE_HEADER
from dispenser.adapters.nats.micro import ERROR_CODE_HEADER, ERROR_HEADER
from dispenser.adapters.nats.service import CONTENT_TYPE as NATS_CONTENT_TYPE
from dispenser.config import Config, KafkaConfig, NatsConfig
from dispenser.messages import (
    DECODE_TAG,
    MSGPACK,
    clock_subject,
    id_subject,
    rate_subject,
    residue_check_subject,
    residue_subject,
)
from dispenser.service.enrichment import Placement, RejectionCode

__all__ = ["JSON", "Part", "channel_parts"]

JSON: Final = "application/json"
"""The document's default content type (``defaultContentType``), and that of its JSON messages."""


def _ref(section: str, name: str) -> dict[str, str]:
    return {"$ref": f"#/{section}/{name}"}


def _string(description: str, **more: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **more}


def _headers(properties: dict[str, dict[str, Any]], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    return schema


@dataclass(frozen=True)
class Part:
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


def _between_workers(
    name: str,
    address: str,
    title: str,
    description: str,
    *,
    operations: dict[str, tuple[str, str]],
    message: tuple[str, dict[str, Any]],
    server: str = "nats",
    reply: str | None = None,
    parameters: dict[str, str] | None = None,
) -> Part:
    """A channel the workers talk to each other on, carrying one ``message`` (its key and definition).

    ``operations`` maps each operation's name to its action and summary; with ``reply``, each is answered
    on the requester's inbox with the message of that name.
    """
    key, definition = message
    channel = _channel(address, title, description, server=server, messages=(key,), parameters=parameters)
    more = {"reply": _nats_reply(reply)} if reply else {}
    ops = {op: _operation(action, name, summary, **more) for op, (action, summary) in operations.items()}
    return Part(name, channel, ops, {key: definition})


# -- NATS ------------------------------------------------------------------------------------------------


def _segment_ids(nats: NatsConfig) -> Part:
    channel = _channel(
        id_subject(nats.subject_prefix, "segment", "{tag}"),
        "Segment IDs",
        "IDs of a tag from PostgreSQL segments (Leaf-segment). The workers share the subjects in a queue "
        "group. Prefix: `nats.subject_prefix`; queue group: `nats.queue_group`. A daily tag's IDs are "
        "`YYYYMMDD * 10**width + counter`, the counter from 1 each midnight in the tag's zone, and its "
        "replies are the same messages (docs/daily.md); `day_exhausted` (507) when a day's counter has no "
        "digits left. An ordered tag is answered by its lease holder alone: the other workers republish its "
        "requests, reply subject kept, on `<prefix>.ordered.<tag>`, which only the holder subscribes; "
        "`unavailable` (503) while no worker holds it (docs/ordered.md). A permuted tag's IDs are "
        "`epoch * 10**18 + FF3-1(key, counter)`, 19 digits in no order, given one by one (in `ranges`, one "
        "`[id, id]` range per ID; at most 10,000 a request in either format), in replies with "
        '`"permuted": true`; `unavailable` (503) from a worker without the tag\'s key file (docs/permuted.md).',
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
        "summary": 'Empty, or {"count": n, "format": "ids"|"ranges"|"sqids", "request_id": "…"}; empty: one ID.',
        "contentType": JSON,
        "headers": _headers({NATS_CONTENT_TYPE: _nats_content_type()}),
        "payload": _ref("components/schemas", "IdRequest"),
        "examples": [
            {"name": "ids", "payload": {"count": 3}},
            {"name": "retryable", "payload": {"count": 1000, "format": "ranges", "request_id": "9b1f2c"}},
            {"name": "sqids", "payload": {"count": 2, "format": "sqids"}},
        ],
    }
    return Part("segmentIds", channel, {"serveSegmentIds": serve}, {"idRequest": id_request})


def _snowflake_ids(nats: NatsConfig) -> Part:
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
    return Part("snowflakeIds", channel, {"serveSnowflakeIds": serve})


def _snowflake_decode(nats: NatsConfig) -> Part:
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
        "contentType": JSON,
        "payload": _ref("components/schemas", "DecodeRequest"),
        "examples": [{"payload": {"id": 1852331557490475008}}],
    }
    return Part("snowflakeDecode", channel, {"decodeSnowflakeIds": decode}, {"decodeRequest": decode_request})


def _nats_replies() -> Part:
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
        "summary": "Exactly one of ids, ranges (inclusive, increasing), sqids (12-character strings) or error.",
        "contentType": JSON,
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
            {"name": "sqids", "payload": {"tag": "order", "sqids": ["p5drq7BwsFlD"], "permuted": True}},
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
    return Part("natsReplies", channel, messages=messages)


def _rate_events(nats: NatsConfig) -> Part:
    prefix = nats.subject_prefix
    return _between_workers(
        "rateEvents",
        rate_subject(prefix, "{tag}"),
        "Consumption-rate events",
        "Every `rate.interval` seconds each worker publishes one event per tag it serves; peers size "
        "their segments from them, `dispenser watch` shows them (it subscribes to "
        f"`{rate_subject(prefix, '>')}`).",
        operations={
            "publishRates": ("send", "This worker's rate of each tag, every `rate.interval` seconds."),
            "followRates": ("receive", "The peers' rates (every worker listens; so does `dispenser watch`)."),
        },
        message=("rateEvent", _payload_message("RateEvent", "Rate event")),
        parameters={"tag": _TAG},
    )


def _snowflake_clock(nats: NatsConfig) -> Part:
    clock_check = {
        "name": "ClockCheck",
        "title": "Clock check",
        "summary": "The checking worker's claim (a clock reading; empty from an observer such as "
        "`dispenser check`), with a reply subject.",
    }
    return _between_workers(
        "snowflakeClock",
        clock_subject(nats.subject_prefix),
        "Snowflake clock check",
        "A starting snowflake worker asks every live one for its clock (no queue group: all answer) and "
        "refuses to start when its own is too far from their mean (`snowflake.peer_threshold_ms`). The "
        "check and the answers carry each worker's claim on its ID (datacenter, worker and the node bits "
        "it puts in its IDs): a worker that hears a live peer whose node bits can compose one of its IDs "
        "issues no snowflake ID (`worker_id_in_use`); a starting worker checks twice, "
        "`snowflake.peer_check_timeout` apart, and serving workers check again every "
        "`snowflake.peer_recheck_interval`.",
        operations={
            "answerClockChecks": ("receive", "Every snowflake worker answers with its clock and worker ID."),
            "checkPeerClocks": (
                "send",
                "At start-up (twice, a window apart) and every `snowflake.peer_recheck_interval`, ask the "
                "live snowflake workers for their clocks and claims (`snowflake.peer_check_timeout` to "
                "answer).",
            ),
        },
        message=("clockCheck", clock_check),
        reply="clockReading",
    )


def _segment_residues(nats: NatsConfig) -> Part:
    return _between_workers(
        "segmentResidues",
        residue_subject(nats.subject_prefix),
        "Segment residue claims",
        "A segment worker announces the residue class of a tag in its database (PostgreSQL's system "
        "identifier and the database's name) when it starts serving the tag, and when it refuses one. Every "
        "segment worker listens (no queue group); a worker whose database serves a class of the same tag "
        "that shares IDs with another database's refuses it (`residue_overlap`; docs/datacenters.md).",
        operations={
            "announceResidues": ("send", "This worker's claim on a tag's class, at the tag's first segment."),
            "followResidues": ("receive", "The other workers' claims."),
        },
        message=(
            "residueAnnouncement",
            _payload_message("ResidueClaims", "Residue claims", name="ResidueAnnouncement"),
        ),
    )


def _segment_residue_checks(nats: NatsConfig) -> Part:
    return _between_workers(
        "segmentResidueChecks",
        residue_check_subject(nats.subject_prefix),
        "Segment residue check",
        "A segment worker asks every live one for its tags' classes: at start-up (within "
        "`segment.residue_check_window`) and every `segment.residue_recheck_interval`. Every segment "
        "worker answers, with its claims when it is on another database; `dispenser check` asks as an "
        "observer.",
        operations={
            "answerResidueChecks": (
                "receive",
                "Every segment worker answers, with its claims when it is on another database.",
            ),
            "checkResidues": (
                "send",
                "Ask the other databases' workers for their claims (this worker's own sent along).",
            ),
        },
        message=("residueCheck", _payload_message("ResidueClaims", "Residue check", name="ResidueCheck")),
        reply="residueClaims",
    )


# -- Kafka -----------------------------------------------------------------------------------------------


def _kafka_requests(kafka: KafkaConfig) -> Part:
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
        "contentType": JSON,
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
    return Part("kafkaRequests", channel, {"serveKafkaRequests": serve}, {"kafkaIdRequest": request})


def _kafka_replies(kafka: KafkaConfig) -> Part:
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
        "contentType": JSON,
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
    return Part("kafkaReplies", channel, messages={"kafkaReply": reply})


def _kafka_rate_events(config: Config) -> Part:
    event = _payload_message("RateEvent", "Rate event on Kafka", name="KafkaRateEvent") | {
        "bindings": _tag_key()
    }
    return _between_workers(
        "kafkaRateEvents",
        config.rate.kafka_topic,
        "Consumption-rate events on Kafka",
        "The rate events again, keyed by tag, when `kafka.enabled` (`rate.kafka_topic`); a worker without "
        "NATS listens to its peers here.",
        operations={
            "publishKafkaRates": ("send", "The rate events, on Kafka too."),
            "followKafkaRates": (
                "receive",
                "The peers' rates, read by a worker with NATS off (from the topic's end).",
            ),
        },
        message=("kafkaRateEvent", event),
        server="kafka",
    )


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


def _enrich_input() -> Part:
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
    return Part("enrichInput", channel, {"enrichRecords": consume}, {"inputRecord": record})


def _enrich_output() -> Part:
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
    return Part("enrichOutput", channel, {"sendEnrichedRecords": send}, {"enrichedRecord": record})


def _enrich_dead_letters() -> Part:
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
    return Part("enrichDeadLetters", channel, {"sendDeadLetters": send}, {"deadLetter": letter})


def _payload_message(schema: str, title: str, *, name: str | None = None) -> dict[str, Any]:
    """A JSON message whose payload is the wire Struct ``schema``."""
    return {
        "name": name or schema,
        "title": title,
        "contentType": JSON,
        "payload": _ref("components/schemas", schema),
    }


# -- the document's order -------------------------------------------------------------------------------


def channel_parts(config: Config) -> list[Part]:
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
