"""Wire messages: every request and reply is a msgspec Struct, with encoders and decoders built once.

JSON by default, msgpack for a request with ``Content-Type: application/msgpack``. The NATS subjects are
built here too (:func:`id_subject`, :func:`rate_subject`, :func:`clock_subject`), so that the workers,
the clients and the AsyncAPI document spell them the same way. The rules for changing a message:
``docs/protocol.md`` ("Evolving the messages").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from dispenser.core.errors import InvalidRequest, MalformedRequest
from dispenser.core.ids import Kind

__all__ = [
    "DECODE_TAG",
    "MSGPACK",
    "REQUEST_ID_MAX_LENGTH",
    "REQUEST_ID_PATTERN",
    "WIRE_TYPES",
    "ClockReading",
    "DecodeReply",
    "DecodeRequest",
    "ErrorBody",
    "IdRequest",
    "JsonReplies",
    "KafkaIdRequest",
    "Kind",
    "RateEvent",
    "Reply",
    "ReplyFormat",
    "ResidueClaims",
    "TagResidue",
    "clock_subject",
    "decode_kafka_request",
    "decode_request",
    "encode_reply",
    "id_subject",
    "json_schemas",
    "query_request",
    "rate_subject",
    "residue_check_subject",
    "residue_subject",
    "strict_decode",
]

T = TypeVar("T")

MSGPACK: Final = "application/msgpack"
"""The ``Content-Type`` header value that selects msgpack for the request and its reply."""

DECODE_TAG: Final = "decode"
"""The snowflake "tag" whose subject takes IDs apart instead (``<prefix>.snowflake.decode``)."""


def id_subject(prefix: str, kind: str, tag: str) -> str:
    """Where ID requests for ``tag`` go: ``<prefix>.<kind>.<tag>`` (workers subscribe to ``tag=">"``)."""
    return f"{prefix}.{kind}.{tag}"


def rate_subject(prefix: str, tag: str) -> str:
    """Where rate events of ``tag`` are published: ``<prefix>.rate.<tag>`` (listeners: ``tag=">"``)."""
    return f"{prefix}.rate.{tag}"


def residue_subject(prefix: str) -> str:
    """Where segment workers announce their tags' residue classes: ``<prefix>.segment-residue``."""
    return f"{prefix}.segment-residue"


def residue_check_subject(prefix: str) -> str:
    """Where segment workers answer a peer's check of the classes: ``<prefix>.segment-residue-check``."""
    return f"{prefix}.segment-residue-check"


def clock_subject(prefix: str) -> str:
    """Where snowflake workers answer a starting peer's clock check: ``<prefix>.snowflake-clock``."""
    return f"{prefix}.snowflake-clock"


Format = Literal["ids", "ranges"]
"""The formats the clients ask for."""
ReplyFormat = Literal["ids", "ranges", "sqids"]
"""The formats a request may ask for: the clients' and ``sqids`` (each ID as a 12-character string)."""
REQUEST_ID_MAX_LENGTH: Final = 128
"""The longest ``request_id`` (the ``dispenser_request.request_id`` column is ``varchar(128)``)."""
REQUEST_ID_PATTERN: Final = r"^[!-~]+$(?!\n)"
"""A ``request_id`` is printable ASCII without space: ``!`` (0x21) to ``~`` (0x7E), nothing else.

It is a key in a store every caller shares: a NUL (which PostgreSQL refuses in text), a control character,
or invalid UTF-8 that a URL decoder turned into U+FFFD (``%ff``, ``%fe`` and ``%c0`` would be one key) never
becomes one. ``(?!\n)``: Python's ``$`` also matches before a final newline (JSON Schema's, ECMA-262's,
does not; there the lookahead is always true)."""
RequestId = Annotated[str, Meta(min_length=1, max_length=REQUEST_ID_MAX_LENGTH, pattern=REQUEST_ID_PATTERN)]
_REQUEST_ID_RULE: Final = (
    f"request_id must be 1 to {REQUEST_ID_MAX_LENGTH} characters of printable ASCII from '!' to '~' "
    "(no space, control or non-ASCII character)"
)


class IdRequest(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Ask for IDs of the tag named by the subject. An empty body means ``{"count": 1}``."""

    count: int = 1
    """How many IDs (at least 1; at most the worker's limit for the format)."""
    request_id: RequestId | None = None
    """Idempotency key: a retry with the same key within the worker's TTL gets the same IDs. 1 to 128
    characters of printable ASCII without space (``!`` to ``~``); unguessable (a UUID), since any caller
    who sends the same key within the TTL gets the same IDs: it is not a credential."""
    format: ReplyFormat = "ids"
    """``ids``: a list of IDs; ``ranges``: inclusive ``[first, last]`` pairs, for large batches; ``sqids``: each
    ID as a 12-character Sqids string, in ``sqids`` (docs/permuted.md, "The string form")."""


class KafkaIdRequest(IdRequest, forbid_unknown_fields=True, omit_defaults=True):
    """An ID request on a Kafka request topic: the NATS request plus what the NATS subject carries.

    The tag may also come from the record's key alone (requests are keyed by tag, so that one tag's
    requests keep their order); when both are there, the body wins.
    """

    tag: str | None = None
    """The business tag; default: the record key."""
    kind: Kind = "segment"
    """Which generator answers: ``segment`` (PostgreSQL segments) or ``snowflake``."""


class ErrorBody(Struct, frozen=True):
    """Why a request failed."""

    code: str
    """Stable machine-readable code, e.g. ``unknown_tag``, ``invalid_count``, ``unavailable``."""
    message: str
    """What went wrong, for a person."""
    retryable: bool
    """Whether sending the same request again later may succeed."""


class Reply(Struct, omit_defaults=True):
    """The answer to an :class:`IdRequest`: exactly one of ``ids``, ``ranges``, ``sqids`` or ``error`` is set."""

    tag: str
    ids: list[int] | None = None
    ranges: list[tuple[int, int]] | None = None
    error: ErrorBody | None = None
    request_id: str | None = None
    permuted: bool = False
    """``true``: the IDs are a permuted tag's (``docs/permuted.md``), in no order, one ``[id, id]`` range per
    ID in the ``ranges`` format; the buffered client keeps them as a list, not as ranges above those it
    holds. Absent (false) for every other reply."""
    sqids: list[str] | None = None
    """The IDs in the ``sqids`` format, in the order ``ids`` would give them: each decodes to its ID
    (``dispenser decode``); hides nothing of a plain tag's counter."""


class DecodeRequest(Struct, forbid_unknown_fields=True):
    """Ask a snowflake worker to take an ID apart (subject ``leaf.snowflake.decode``)."""

    id: Annotated[int, Meta(ge=0)]


class DecodeReply(Struct, omit_defaults=True):
    """A snowflake ID's fields, read with the worker's layout and epoch."""

    id: int
    timestamp_ms: int | None = None
    """Unix time of the ID, in milliseconds."""
    time: str | None = None
    """The same as an ISO 8601 UTC timestamp."""
    worker_id: int | None = None
    sequence: int | None = None
    error: ErrorBody | None = None
    datacenter_id: int | None = None
    """The datacenter field (only when the layout has datacenter bits)."""


class RateEvent(Struct, kw_only=True):
    """A worker's consumption rate of one tag, published every few seconds (``<prefix>.rate.<tag>``).

    Workers size their segments from their peers' events; ``dispenser watch`` shows them.
    """

    tag: str
    kind: Kind
    worker: str
    """Who measured: ``<host>:<pid>:<random>``, unique per worker process."""
    time: float
    """Unix time of the measurement, in seconds."""
    window_s: int
    """Seconds averaged in ``ids_per_s`` and ``requests_per_s`` (and in each peak candidate)."""
    ids_per_s: float
    requests_per_s: float
    peak_ids_per_s: float
    """The highest rate sustained within the retention (default: the last 24 hours): the lowest ``window_s``
    average over ``rate.peak_sustain`` windows, at its highest (docs/operations.md)."""
    step: int | None = None
    """The size of the last segment fetched (segment kind)."""
    configured_step: int | None = None
    """The tag's ``leaf_alloc.step``: the floor of the adaptive step."""
    ids_buffered: int = 0
    """IDs this worker can hand out without the database (both buffers)."""
    runway_s: float | None = None
    """Seconds until the buffers run dry at the peak rate (or the current one, if higher) if the database
    went away now (``null``: no demand, no end in sight)."""
    fetches: int = 0
    """Segments fetched since the worker started."""
    fetches_per_min: float | None = None
    """Segments fetched per minute over the last minute (or since the worker started, if later): the
    database round trips this worker spends on the tag (segment kind; ``null`` from workers older than
    this field)."""
    ids_total: int = 0
    """IDs handed out since the worker started."""
    datacenter: str = ""
    """The worker's datacenter (``nats.datacenter``; "": not set, or a worker older than this field)."""


BitPosition = Annotated[int, Meta(ge=0, le=64)]
"""A bit position or width within a 64-bit ID."""


class ClockReading(Struct):
    """A snowflake worker's answer to a peer's check on ``<prefix>.snowflake-clock``, and its own check's body.

    An empty check body is an observer's, such as ``dispenser check``'s.

    ``datacenter_id``, ``worker_id``, the node bits, ``nonce`` and ``state`` are the worker's claim on its ID:
    a worker that hears a live peer claim node bits that can compose one of its own IDs refuses to issue
    (docs/snowflake.md).
    """

    wall_ms: int
    """The worker's wall clock, Unix milliseconds, when it answered."""
    worker_id: int
    """The worker ID it issues under."""
    datacenter_id: int = 0
    """The datacenter ID folded into its IDs (0 without datacenter bits)."""
    nonce: str = ""
    """Random per run of the worker, so that a worker tells its own claim from another's ("": an older worker)."""
    state: str = ""
    """``starting`` (checking its peers), ``serving``, or ``refused`` (found its ID held by a live peer)."""
    address: str = ""
    """The worker's registry address, for the messages."""
    node_shift: BitPosition | None = None
    """The lowest bit of the node field (datacenter and worker IDs side by side) in the worker's IDs: its
    layout's ``sequence_bits``. The five ``node_*``/``id_bits``/``epoch_ms`` fields say where the worker's
    IDs can fall, on its layout; a peer whose node bits can compose one same ID refuses, whatever the two
    (datacenter, worker) pairs (``null``: a worker older than these fields, compared by its pair)."""
    node_width: BitPosition | None = None
    """The node field's width: ``datacenter_bits + worker_bits``."""
    node_value: Annotated[int, Meta(ge=0)] | None = None
    """The node field's value: ``datacenter_id << worker_bits | worker_id``."""
    id_bits: BitPosition | None = None
    """How wide the worker's IDs are (timestamp, node and sequence bits; 63 for a full layout)."""
    epoch_ms: int | None = None
    """The layout's epoch, Unix milliseconds (said for the messages: another epoch does not keep IDs apart)."""


class TagResidue(Struct, kw_only=True):
    """One tag's residue class in a worker's database (``offset`` modulo ``stride``; Leaf's tag: 0 mod 1)."""

    tag: str
    stride: int
    offset: int
    state: str = "serving"
    """``serving``, or ``refused`` (another database serves an intersecting class of the tag)."""
    issued: bool = True
    """Whether the worker handed out IDs of the tag under this class (false: refused at its first segment)."""


class ResidueClaims(Struct, kw_only=True):
    """A segment worker's claims on its tags' classes.

    Announced on ``<prefix>.segment-residue`` when the worker starts serving a tag or refuses one; sent as a
    check on ``<prefix>.segment-residue-check`` (with a reply subject: every worker answers, with its
    claims when it is on another database; an observer such as ``dispenser check`` sends no ``worker``),
    and as the answers. Two databases must never serve one tag in classes that share an ID
    (docs/datacenters.md).
    """

    worker: str = ""
    """Who: ``<host>:<pid>:<random>``, as in its rate events ("": an observer)."""
    datacenter: str = ""
    """``nats.datacenter``."""
    system_identifier: str = ""
    """The worker's PostgreSQL system identifier ("": not known yet)."""
    database: str = ""
    """The worker's database name (with the system identifier: which database its tags' rows are in)."""
    claims: list[TagResidue] = msgspec.field(default_factory=list)
    """The tags it claims (it serves, or refused), each with its class."""


WIRE_TYPES: Final[dict[str, type[Struct]]] = {
    "id-request": IdRequest,
    "kafka-id-request": KafkaIdRequest,
    "reply": Reply,
    "decode-request": DecodeRequest,
    "decode-reply": DecodeReply,
    "rate-event": RateEvent,
    "clock-reading": ClockReading,
    "residue-claims": ResidueClaims,
}
"""Every wire message, by the name of its schema file under ``schemas/`` (``<name>.schema.json``)."""

_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()
_json_request = msgspec.json.Decoder(IdRequest)
_msgpack_request = msgspec.msgpack.Decoder(IdRequest)
_DEFAULT_REQUEST = IdRequest()
_json_kafka_request = msgspec.json.Decoder(KafkaIdRequest)
_msgpack_kafka_request = msgspec.msgpack.Decoder(KafkaIdRequest)
_DEFAULT_KAFKA_REQUEST = KafkaIdRequest()


def strict_decode(decoder: msgspec.json.Decoder[T] | msgspec.msgpack.Decoder[T], data: bytes) -> T:
    """Decode a request body with ``decoder``; a bad body is our coded error, msgspec's message kept.

    The one place where msgspec's errors become the client's error codes (msgspec's messages already name
    the path, e.g. ``Expected `int` >= 1 - at `$.count```, so they are passed through).

    Raises:
        InvalidRequest: well-formed, but a field has the wrong type or value, or is unknown (``invalid``).
        MalformedRequest: not JSON (or msgpack) at all (``malformed``).
    """
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: first
        raise _invalid(exc) from None
    except msgspec.DecodeError as exc:
        raise MalformedRequest(str(exc)) from None


def decode_request(data: bytes, msgpack: bool = False) -> IdRequest:
    """Decode a request body; an empty body is one ID.

    Raises:
        InvalidRequest, MalformedRequest: see :func:`strict_decode`.
    """
    if not data:
        return _DEFAULT_REQUEST
    return strict_decode(_msgpack_request if msgpack else _json_request, data)


def query_request(params: Mapping[str, str]) -> IdRequest:
    """The request that URL query parameters spell (``?count=100&format=ranges&request_id=r-1``).

    The same fields, limits and errors as a JSON body: Leaf's HTTP API (``dispenser.adapters.http``) takes
    its batch form this way. No parameters: one ID.

    Raises:
        InvalidRequest: a value has the wrong type or is out of bounds, or a parameter is unknown (a
            misspelt ``cuont`` must not silently become one ID).
    """
    if not params:
        return _DEFAULT_REQUEST
    try:
        # strict=False: query values are strings ("100" is the int 100), as environment values are.
        return msgspec.convert(dict(params), IdRequest, strict=False)
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: msgspec.ValidationError) -> InvalidRequest:
    """The error for a failed validation: msgspec's words, or the rule's for a ``request_id`` out of its alphabet."""
    detail = str(exc)
    if detail.startswith("Expected `str` matching regex") and detail.endswith("- at `$.request_id`"):
        detail = f"{_REQUEST_ID_RULE} - at `$.request_id`"
    return InvalidRequest(detail)


def decode_kafka_request(data: bytes, msgpack: bool = False) -> KafkaIdRequest:
    """Decode a Kafka request body; an empty body is one segment ID of the tag named by the key.

    Raises:
        InvalidRequest, MalformedRequest: see :func:`strict_decode`.
    """
    if not data:
        return _DEFAULT_KAFKA_REQUEST
    return strict_decode(_msgpack_kafka_request if msgpack else _json_kafka_request, data)


def encode_reply(reply: Struct, msgpack: bool = False) -> bytes:
    """Encode any reply Struct in the client's encoding."""
    return (_msgpack_encoder if msgpack else _json_encoder).encode(reply)


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schema of every wire message, by file name under ``schemas/``."""
    return {f"{name}.schema.json": msgspec.json.schema(cls) for name, cls in WIRE_TYPES.items()}


_BLOCK: Final = 1000
"""IDs per block of reply text (:class:`JsonReplies`): the last three digits of an ID are its place in it."""
_SUFFIXES: Final = [b"%03d," % k for k in range(_BLOCK)]
_COLUMNS: Final = {digit: bytes([digit]) * _BLOCK for digit in b"0123456789"}
"""A block's digit column (one digit of the prefix, every ID of the block) is one of these, assigned at once."""
_MAX_BLOCK_TAGS: Final = 128
"""Tags whose block of text is kept (~15-20 KB each; cleared when full)."""


class _Block:
    """The text of 1,000 consecutive IDs sharing every digit but the last three, each followed by a comma."""

    __slots__ = ("base", "head", "prefix", "stride", "text")

    def __init__(self, head: bytes, number: int) -> None:
        prefix = b"%d" % number
        self.head = head
        """``{"tag":"…","ids":[``, msgspec's own text up to the list."""
        self.prefix = bytes(len(prefix))  # every column differs: all are written by move()
        self.stride = len(prefix) + 4
        self.text = bytearray(b"".join(bytes(self.stride - 4) + suffix for suffix in _SUFFIXES))
        self.base = 0
        self.move(number)

    def move(self, number: int) -> None:
        """Make it the block of the IDs ``number * 1000`` to ``number * 1000 + 999``, as wide as the current.

        Consecutive blocks differ in their prefix's last digit or few: rewrite only the digit columns that
        differ, each one strided assignment in C.
        """
        prefix = b"%d" % number
        text, stride = self.text, self.stride
        for column, (old, new) in enumerate(zip(self.prefix, prefix, strict=True)):
            if old != new:
                text[column::stride] = _COLUMNS[new]
        self.prefix = prefix
        self.base = number * _BLOCK


class JsonReplies:
    """Successful JSON replies of the hot path, written without a :class:`Reply` or a list of IDs.

    The bytes are exactly those of ``encode_reply(Reply(tag=tag, ids=...))`` (and of ``ranges=``): a
    property test holds them equal. 100 IDs cost ~1 µs instead of ~3.5 (a list of 100 ints, then msgspec
    writing each): the IDs of one request are consecutive, so their text is a slice of a block of 1,000
    kept per tag, whose prefix digits change only every 1,000 IDs. A reply with a ``request_id`` goes
    through msgspec, as do IDs below 1,000 (no common prefix).
    """

    __slots__ = ("_blocks", "_ranges_heads")

    def __init__(self) -> None:
        self._blocks: dict[str, _Block] = {}
        self._ranges_heads: dict[str, bytes] = {}

    def ids(self, tag: str, first: int, last: int) -> bytes:
        """``{"tag": tag, "ids": [first, …, last]}`` as msgspec writes it."""
        block = self._blocks.get(tag)
        if block is not None:
            base = block.base
            if base <= first and last < base + _BLOCK:  # nearly every request: one slice of one block
                stride = block.stride
                return (
                    block.head + block.text[(first - base) * stride : (last - base + 1) * stride - 1] + b"]}"
                )
        if first < _BLOCK:
            return _json_encoder.encode(Reply(tag=tag, ids=list(range(first, last + 1))))
        head = self._block(tag, first // _BLOCK).head
        parts: list[bytes | bytearray] = []
        while first <= last:
            block = self._block(tag, first // _BLOCK)
            base = block.base
            high = min(last, base + _BLOCK - 1)
            parts.append(block.text[(first - base) * block.stride : (high - base + 1) * block.stride])
            first = high + 1
        parts[-1] = parts[-1][:-1]  # no comma after the last ID
        return head + b"".join(parts) + b"]}"

    def one_range(self, tag: str, first: int, last: int) -> bytes:
        """``{"tag": tag, "ranges": [[first, last]]}`` as msgspec writes it."""
        head = self._ranges_heads.get(tag)
        if head is None:
            if len(self._ranges_heads) >= _MAX_BLOCK_TAGS:
                self._ranges_heads.clear()
            head = self._ranges_heads[tag] = _json_encoder.encode(Reply(tag=tag, ranges=[]))[:-2]
        return b"%b[%d,%d]]}" % (head, first, last)

    def _block(self, tag: str, number: int) -> _Block:
        block = self._blocks.get(tag)
        if block is None or block.stride != len(b"%d" % number) + 4:
            if block is None and len(self._blocks) >= _MAX_BLOCK_TAGS:
                self._blocks.clear()
            # msgspec's own text up to the empty list's ']}'.
            head = _json_encoder.encode(Reply(tag=tag, ids=[]))[:-2]
            block = self._blocks[tag] = _Block(head, number)
        elif block.base != number * _BLOCK:
            block.move(number)
        return block
