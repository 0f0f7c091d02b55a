"""``leaf.snowflake.decode`` and ``dispenser decode``: take a snowflake ID apart with the configured layout."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec

from dispenser.core.errors import BadRequest, InvalidRequest, MalformedRequest
from dispenser.core.snowflake import SnowflakeLayout
from dispenser.messages import DecodeReply, DecodeRequest, ErrorBody, encode_reply
from dispenser.service.dispatch import Answer

__all__ = ["decode_handler", "decode_id"]

_decoder = msgspec.json.Decoder(DecodeRequest)


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
    )


def decode_handler(layout: SnowflakeLayout) -> Callable[[bytes], Awaitable[Answer]]:
    """A request handler: body ``{"id": N}`` in, :class:`DecodeReply` out (errors in its ``error``)."""

    async def handle(body: bytes) -> Answer:
        snowflake_id = 0
        try:
            try:
                request = _decoder.decode(body)
            except msgspec.ValidationError as exc:
                raise InvalidRequest(str(exc)) from None
            except msgspec.DecodeError as exc:
                raise MalformedRequest(str(exc)) from None
            snowflake_id = request.id
            return Answer(encode_reply(decode_id(layout, snowflake_id)))
        except BadRequest as exc:
            error = ErrorBody(code=exc.code, message=exc.message, retryable=False)
            return Answer(encode_reply(DecodeReply(id=snowflake_id, error=error)), exc)

    return handle
