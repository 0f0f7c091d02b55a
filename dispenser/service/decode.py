"""``leaf.snowflake.decode`` and ``dispenser decode``: take a snowflake ID apart with the configured layout."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec

from dispenser.core.errors import BadRequest, MessageTooLarge
from dispenser.core.snowflake import SnowflakeLayout
from dispenser.messages import DecodeReply, DecodeRequest, ErrorBody, encode_reply, strict_decode
from dispenser.service.answering import Answer

__all__ = ["decode_handler", "decode_id"]

_json_decoder = msgspec.json.Decoder(DecodeRequest)
_msgpack_decoder = msgspec.msgpack.Decoder(DecodeRequest)


def decode_id(layout: SnowflakeLayout, snowflake_id: int) -> DecodeReply:
    """The fields of ``snowflake_id`` under ``layout``.

    Raises:
        InvalidId: the number is negative or wider than the layout.
    """
    fields = layout.decompose(snowflake_id)
    return DecodeReply(
        id=snowflake_id,
        timestamp_ms=fields.timestamp_ms,
        time=fields.datetime.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        worker_id=fields.worker_id,
        sequence=fields.sequence,
        # Only a layout with datacenter bits has the field (Leaf's layout decodes as before).
        datacenter_id=fields.datacenter_id if layout.datacenter_bits else None,
    )


def decode_handler(
    layout: SnowflakeLayout, max_body_bytes: int = 4096
) -> Callable[[bytes, bool], Awaitable[Answer]]:
    """A request handler: body ``{"id": N}`` in, :class:`DecodeReply` out (errors in its ``error``).

    The body goes through the same checks as an ID request's: the size limit first (before anything
    decodes it), then JSON or msgpack (``msgpack``: the request's ``Content-Type``), the reply in kind.
    """

    async def handle(body: bytes, msgpack: bool = False) -> Answer:
        snowflake_id = 0
        try:
            if len(body) > max_body_bytes:
                raise MessageTooLarge(len(body), max_body_bytes)
            request = strict_decode(_msgpack_decoder if msgpack else _json_decoder, body)
            snowflake_id = request.id
            return Answer(encode_reply(decode_id(layout, snowflake_id), msgpack))
        except BadRequest as exc:
            error = ErrorBody(code=exc.code, message=exc.message, retryable=False)
            return Answer(encode_reply(DecodeReply(id=snowflake_id, error=error), msgpack), exc)

    return handle
