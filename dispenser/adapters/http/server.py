"""One aiohttp server: Leaf's HTTP API (``http.port``) and the operations endpoints beside it.

Leaf's ``/api/{segment,snowflake}/get/{key}`` and ``/decodeSnowflakeId`` answered as Leaf answers them,
plus a batch form (``?count=N``); every ID request goes through the service's :class:`Answerer`, as a
NATS request does. ``/healthz`` and ``/readyz`` are served by every :class:`HttpServer`, ``/metrics`` (and
the status page beside it, :mod:`~dispenser.adapters.http.status`) by those given it.
Leaf's answers and ours side by side: ``docs/http.md``.
"""

from __future__ import annotations

import datetime
import html
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from multidict import MultiMapping

from dispenser.adapters.http.access import Caller, HttpAccess
from dispenser.adapters.http.guard import SERVER_HEADER, GuardedSite, fit_connections
from dispenser.adapters.http.negotiation import id_media_type, prefers_html
from dispenser.adapters.http.status import StatusSource, add_status_routes
from dispenser.core.errors import (
    BadRequest,
    ClockMovedBackwards,
    DispenserError,
    InvalidRequest,
    InvalidTag,
    OverBudget,
    Unauthorized,
    Unavailable,
    UnknownTag,
)
from dispenser.messages import DecodeReply, IdRequest, query_request
from dispenser.service.answering import Answer, Answerer

__all__ = ["ERROR_CODE_HEADER", "HttpServer", "LeafApi", "Operations", "leaf_result_id"]

log = logging.getLogger(__name__)

ERROR_CODE_HEADER = "Dispenser-Error-Code"
"""The response header that carries an error's code (``unknown_tag``, ``unavailable``…), in both forms."""

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus' text exposition format."""

_ONE = IdRequest()
_BATCH_PARAMETERS = ("count", "format")
"""Either of these in the query selects the batch form (a JSON reply); without them, Leaf's plain text."""

# What Spring Boot 1.5 (Leaf's server) answers for the exceptions Leaf's controllers throw.
_LEAF_EXCEPTION = "com.sankuai.inf.leaf.server.exception.LeafServerException"
_MISSING_PARAMETER = "org.springframework.web.bind.MissingServletRequestParameterException"
_NOT_ACCEPTABLE = "org.springframework.web.HttpMediaTypeNotAcceptableException"
_DECODE_ERROR = "snowflake Id反解析发生异常!"
"""Leaf's ``errorMsg`` when ``snowflakeId`` is not a number (Chinese: "decoding the snowflake ID failed!")."""
_JAVA_LONG = re.compile(r"[+-]?0*([0-9]{1,19})")
"""What Java's ``Long.parseLong`` accepts within 64 bits (Python's ``int`` accepts more: spaces, underscores,
and refuses over 4,300 digits with an error of its own), the digits after any leading zeros captured."""
_DECIMAL = re.compile(r"[0-9]{1,20}")
"""A ``count`` in a query: decimal digits only (``1e3``, ``1.0`` and ``+5`` are refused, as over NATS)."""
_QUERY_PARAMETERS = frozenset({"count", "format", "request_id"})
_HEADERS = {"Server": SERVER_HEADER}
_RETRY_AFTER_CAP = 3600


@dataclass(frozen=True, slots=True)
class Operations:
    """What the operations endpoints read of the worker."""

    metrics: Callable[[], bytes] | None = None
    """The Prometheus text exposition, for ``/metrics`` (and ``/``, as the metrics port always had)."""
    not_ready: Callable[[], Sequence[str]] = tuple
    """Why the worker cannot answer now: ``/readyz`` answers 503 with these reasons; none: ready."""
    cannot_issue: Callable[[], Sequence[str]] = tuple
    """Which kinds it cannot hand out IDs of now, and why (it still answers, with coded errors): in
    ``/readyz``'s body, and a 503 for ``/readyz?issue=1`` (a probe that wants the stricter meaning)."""
    status: StatusSource | None = None
    """The status page, ``/status`` and ``/status.json``: served only with ``/metrics`` (it names the same
    tags and volumes), never without it."""


@dataclass(frozen=True, slots=True)
class LeafApi:
    """What Leaf's API answers from."""

    dispatchers: Mapping[str, Answerer]
    """By generator kind (``segment``, ``snowflake``): a kind missing here has no route (404)."""
    decode: Callable[[int], DecodeReply] | None = None
    """Takes a snowflake ID apart with the configured layout (raises ``InvalidId``); ``None``: no
    ``/decodeSnowflakeId``."""


def leaf_result_id(kind: str, exc: DispenserError) -> int:
    """The id of Leaf's ``Result`` for an error, as Leaf's generators number their failures.

    Segment: -2 the key does not exist, -3 neither segment could be loaded from the database, -1 the rest
    (Leaf: the cache never loaded). Snowflake: -3 the clock went back more than Leaf waits out, -1 the rest.
    """
    if kind == "segment":
        if isinstance(exc, UnknownTag | InvalidTag):
            return -2
        if isinstance(exc, Unavailable):
            return -3
        return -1
    if isinstance(exc, ClockMovedBackwards):
        return -3
    return -1


def _spring_error(status: int, reason: str, path: str, message: str, exception: str | None) -> dict[str, Any]:
    """The body of Spring Boot 1.5's error page for a client that does not ask for HTML."""
    body: dict[str, Any] = {"timestamp": int(time.time() * 1000), "status": status, "error": reason}
    if exception is not None:
        body["exception"] = exception
    body["message"] = message
    body["path"] = path
    return body


def _plain(snowflake_or_segment_id: int, media_type: str = "text/plain") -> web.Response:
    """An ID as Leaf answers it: the decimal digits, as the media type the caller accepts (``negotiation``)."""
    # From bytes: half the cost of text= (which encodes through the charset lookup), measured ~1.8 µs. The
    # Server header given here costs nothing measurable (1.46 against 1.62 µs for the response without it).
    return web.Response(
        body=str(snowflake_or_segment_id).encode(),
        content_type=media_type,
        charset="utf-8",
        headers=_HEADERS,
    )


def _not_acceptable(path: str) -> web.Response:
    """Spring's answer to an ``Accept`` it cannot parse; asked before an ID is taken, so none is spent."""
    message = "Could not parse Accept header"
    body = _spring_error(406, "Not Acceptable", path, message, _NOT_ACCEPTABLE)
    return _json(body, 406, {ERROR_CODE_HEADER: "invalid"})


def _whitelabel(status: int, reason: str, message: str) -> web.Response:
    """Spring Boot's error page for a browser (an ``Accept`` that asks for ``text/html`` first)."""
    moment = time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime())
    page = (
        "<html><body><h1>Whitelabel Error Page</h1><p>This application has no explicit mapping for /error, "
        "so you are seeing this as a fallback.</p>"
        f"<div id='created'>{moment}</div><div>There was an unexpected error (type={reason}, "
        f"status={status}).</div><div>{html.escape(message)}</div></body></html>"
    )
    return web.Response(text=page, status=status, content_type="text/html", charset="utf-8", headers=_HEADERS)


def _json(body: object, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body),
        status=status,
        content_type="application/json",
        charset="utf-8",  # as Spring's Jackson converter names it
        headers=_HEADERS if headers is None else {**_HEADERS, **headers},
    )


def _error_headers(error: DispenserError) -> dict[str, str]:
    """``Dispenser-Error-Code``, and what HTTP says beside some errors (``Retry-After``, ``WWW-Authenticate``)."""
    headers = {**_HEADERS, ERROR_CODE_HEADER: error.code}
    if isinstance(error, OverBudget) and error.retryable:
        headers["Retry-After"] = str(min(_RETRY_AFTER_CAP, max(1, int(error.retry_after + 0.999))))
    elif isinstance(error, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def _query(query: MultiMapping[str]) -> dict[str, str]:
    """The query of an ID request, checked as strictly as a NATS body is.

    Raises:
        InvalidRequest: a parameter given twice (a proxy that reads the last would see another request than
            this worker), or a ``count`` that is not plain decimal digits.
    """
    params: dict[str, str] = {}
    for name, value in query.items():
        if name not in params:
            params[name] = value
        elif name in _QUERY_PARAMETERS:
            raise InvalidRequest(f"parameter {name!r} is given more than once")
    count = params.get("count")
    if count is not None and not _DECIMAL.fullmatch(count):
        raise InvalidRequest(f"count must be decimal digits, got {count[:40]!r}")
    return params


class HttpServer:
    """An aiohttp server on ``host:port``: the operations endpoints, and Leaf's API when given one.

    Every connection is guarded (:mod:`dispenser.adapters.http.guard`): idle and head timeouts, a cap on open
    connections, no decompression, parse errors answered in JSON and logged in one line.

    Args:
        host: the address to listen on.
        port: the port (0: a free one; :attr:`port` says which once started).
        operations: what ``/metrics``, ``/healthz`` and ``/readyz`` read.
        leaf: Leaf's API; ``None``: operations only (the metrics port).
        access: who may take which IDs, and how many (``http.callers``, the budgets); ``None``: anyone, any
            number (the metrics port has no ID routes).
        max_connections: open connections at once (lowered to fit ``open_files``).
        open_files: the process's file-descriptor limit, for :func:`~dispenser.adapters.http.guard.fit_connections`.
        keepalive_timeout: seconds an idle connection is kept.
        head_timeout: seconds from a request's first byte to the end of its head.
        reuse_port: share the port with the host's other worker processes (``SO_REUSEPORT``).
    """

    def __init__(
        self,
        host: str,
        port: int,
        operations: Operations,
        leaf: LeafApi | None = None,
        *,
        access: HttpAccess | None = None,
        max_connections: int = 4096,
        open_files: int | None = None,
        keepalive_timeout: float = 75.0,
        head_timeout: float = 10.0,
        reuse_port: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        self._reuse_port = reuse_port
        self.app = web.Application()
        self._runner: web.AppRunner | None = None
        self._site: GuardedSite | None = None
        self._access = access
        self.max_connections = (
            max_connections if open_files is None else fit_connections(max_connections, open_files)
        )
        self._timeouts = (keepalive_timeout, head_timeout)
        self._add_operations(operations)
        if leaf is not None:
            self._add_leaf(leaf)
        # Last: every other path answers as Spring Boot answers a path it has no mapping for.
        self.app.router.add_route("*", "/{path:.*}", self._not_found)

    async def start(self) -> None:
        """Listen; a port that is taken raises ``OSError``."""
        runner = web.AppRunner(self.app, handle_signals=False, shutdown_timeout=5.0)
        await runner.setup()
        self._runner = runner
        keepalive_timeout, head_timeout = self._timeouts
        site = GuardedSite(
            runner,
            self.host,
            self.port,
            max_connections=self.max_connections,
            keepalive_timeout=keepalive_timeout,
            head_timeout=head_timeout,
            reuse_port=self._reuse_port,
        )
        await site.start()
        self._site = site
        self.port = site.port

    async def stop(self) -> None:
        """Stop listening, let requests in flight finish (5 s at most), close the connections."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    @property
    def url(self) -> str:
        """``http://host:port`` (after :meth:`start`)."""
        return f"http://{self.host}:{self.port}"

    @property
    def refused(self) -> int:
        """Connections refused at the cap (``too_many_connections``) since the start."""
        return 0 if self._site is None else self._site.refused

    # -- operations --------------------------------------------------------------------------------

    def _add_operations(self, operations: Operations) -> None:
        router = self.app.router
        metrics = operations.metrics
        not_ready = operations.not_ready
        if metrics is not None:

            async def scrape(_request: web.Request) -> web.Response:
                return web.Response(
                    body=metrics(), headers={"Content-Type": METRICS_CONTENT_TYPE, **_HEADERS}
                )

            router.add_get("/metrics", scrape)
            router.add_get("/", scrape)
            if operations.status is not None:
                add_status_routes(router, operations.status)

        async def healthz(_request: web.Request) -> web.Response:
            # Alive: the event loop answers. Nothing else is checked, so that a restart is never the
            # answer to a dependency being down (that is what /readyz says).
            return web.Response(text="ok\n", headers=_HEADERS)

        cannot_issue = operations.cannot_issue

        async def readyz(request: web.Request) -> web.Response:
            reasons = list(not_ready())
            if reasons:
                return _json({"status": "not ready", "reasons": reasons}, 503)
            short = list(cannot_issue())
            if not short:
                return _json({"status": "ready"})
            strict = request.query.get("issue") not in (None, "", "0", "false")
            return _json({"status": "ready", "cannot_issue": short}, 503 if strict else 200)

        router.add_get("/healthz", healthz)
        router.add_get("/readyz", readyz)

    async def _not_found(self, request: web.Request) -> web.Response:
        if prefers_html(request.headers.get("Accept")):
            return _whitelabel(404, "Not Found", "No message available")
        body = _spring_error(404, "Not Found", request.path, "No message available", None)
        return _json(body, 404)

    # -- Leaf's API --------------------------------------------------------------------------------

    def _add_leaf(self, leaf: LeafApi) -> None:
        router = self.app.router
        for kind, dispatcher in leaf.dispatchers.items():
            # Any method, as Leaf's @RequestMapping without a method; with a trailing slash too, as Spring
            # matches it (useTrailingSlashMatch).
            handler = self._id_handler(kind, dispatcher)
            router.add_route("*", f"/api/{kind}/get/{{key}}", handler)
            router.add_route("*", f"/api/{kind}/get/{{key}}/", handler)
        if leaf.decode is not None:
            router.add_route("*", "/decodeSnowflakeId", self._decode_handler(leaf.decode))

    def _id_handler(
        self, kind: str, dispatcher: Answerer
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        answer_now = dispatcher.answer_now
        answer_later = dispatcher.answer
        access = self._access
        guarded = access is not None and not access.open

        async def get(request: web.Request) -> web.Response:
            tag = request.match_info["key"]
            accept = request.headers.get("Accept")
            media_type = id_media_type(accept)
            if media_type is None:
                return _not_acceptable(request.path)
            caller = None
            if guarded:
                assert access is not None
                found = access.identify(request, kind, tag)
                if isinstance(found, DispenserError):
                    return self._refused(dispatcher, kind, tag, found)
                caller = found
            if "?" in request.raw_path:  # the request target as sent: cheaper than parsing the query
                return await self._with_query(kind, dispatcher, request, tag, caller, media_type=media_type)
            # The hot path: one ID, no query, answered inline when the buffer has it. (Not counted in the
            # caller's budget: a request per ID is bounded by the requests a caller can send.)
            answer = answer_now(tag, _ONE, encode=False) or await answer_later(tag, _ONE, encode=False)
            ranges = answer.ranges
            if ranges is None:
                return self._leaf_error(kind, request.path, answer, accept)
            return _plain(ranges[0][0], media_type)

        return get

    @staticmethod
    def _refused(dispatcher: Answerer, kind: str, tag: str, error: DispenserError) -> web.Response:
        """An access error (unauthorized, forbidden, over_budget), in either form: its own status, the NATS body."""
        answer = dispatcher.error(tag, error)
        return web.Response(
            body=answer.body,
            status=error.status,
            content_type="application/json",
            headers=_error_headers(error),
        )

    async def _with_query(
        self,
        kind: str,
        dispatcher: Answerer,
        request: web.Request,
        tag: str,
        caller: Caller | None,
        *,
        media_type: str,
    ) -> web.Response:
        raw = request.query
        batch = any(name in raw for name in _BATCH_PARAMETERS)
        try:
            query = _query(raw)
            if batch:
                id_request = query_request(query)
            else:  # Leaf's form: other parameters are ignored, as Leaf ignores them
                request_id = query.get("request_id")
                id_request = _ONE if request_id is None else query_request({"request_id": request_id})
        except DispenserError as exc:
            answer = dispatcher.error(tag, exc)
        else:
            if self._access is not None:
                over = self._access.spend(request, caller, id_request.count)
                if over is not None:
                    return self._refused(dispatcher, kind, tag, over)
            answer = dispatcher.answer_now(tag, id_request, encode=batch) or await dispatcher.answer(
                tag, id_request, encode=batch
            )
        error = answer.error
        if batch:
            if error is None:
                return web.Response(body=answer.body, content_type="application/json", headers=_HEADERS)
            return web.Response(
                body=answer.body,
                status=error.status,
                content_type="application/json",
                headers=_error_headers(error),
            )
        if answer.ranges is None:
            return self._leaf_error(kind, request.path, answer, request.headers.get("Accept"))
        return _plain(answer.ranges[0][0], media_type)

    @staticmethod
    def _leaf_error(kind: str, path: str, answer: Answer, accept: str | None) -> web.Response:
        error = answer.error
        if error is None:  # not reachable: an answer without IDs is an error answer
            raise RuntimeError("an answer with neither IDs nor an error")
        if prefers_html(accept):
            message = f"Result{{id={leaf_result_id(kind, error)}, status=EXCEPTION}}"
            response = _whitelabel(500, "Internal Server Error", message)
            response.headers.update(_error_headers(error))
            return response
        body = _spring_error(
            500,
            "Internal Server Error",
            path,
            f"Result{{id={leaf_result_id(kind, error)}, status=EXCEPTION}}",
            _LEAF_EXCEPTION,
        )
        body |= {"code": error.code, "retryable": error.retryable, "detail": error.message}
        return _json(body, 500, _error_headers(error))

    @staticmethod
    def _decode_handler(
        decode: Callable[[int], DecodeReply],
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def decode_snowflake_id(request: web.Request) -> web.Response:
            text = request.query.get("snowflakeId")
            if text is None:
                message = "Required String parameter 'snowflakeId' is not present"
                body = _spring_error(400, "Bad Request", request.path, message, _MISSING_PARAMETER)
                return _json(body, 400, {ERROR_CODE_HEADER: "invalid"})
            # int() of the digits only: Python refuses a string of over 4,300 digits with a ValueError of its
            # own, and Java's Long.parseLong accepts any number of leading zeros.
            digits = _JAVA_LONG.fullmatch(text)
            value = None if digits is None else int(digits.group(1)) * (-1 if text.startswith("-") else 1)
            try:
                if value is None or not -(2**63) <= value < 2**63:
                    raise BadRequest(f"{text!r} is not a 64-bit integer")
                fields = decode(value)
            except BadRequest as exc:
                # Leaf answers a bad number with 200 and this map; the code and detail are ours.
                return _json({"errorMsg": _DECODE_ERROR, "code": exc.code, "detail": exc.message})
            timestamp_ms = fields.timestamp_ms or 0
            moment = datetime.datetime.fromtimestamp(timestamp_ms / 1000, datetime.UTC)
            shown = f"{moment:%Y-%m-%d %H:%M:%S}.{timestamp_ms % 1000:03d}"
            return _json(
                {
                    "timestamp": f"{timestamp_ms}({shown})",
                    "sequenceId": str(fields.sequence),
                    "workerId": str(fields.worker_id),
                }
            )

        return decode_snowflake_id
