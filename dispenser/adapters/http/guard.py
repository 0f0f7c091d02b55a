"""What one HTTP client may cost the others at the connection level: sockets, time, CPU and the log.

aiohttp's defaults suit a server behind a trusted proxy, not one any caller on the network can reach: an idle
connection is kept an hour (3,630 s), nothing bounds how many are open (1,100 idle sockets under the usual
1,024 file-descriptor limit took the HTTP API, ``/healthz`` on the metrics port and the grant file with
them), a compressed body the routes never read is inflated while it is drained (1 GiB of zeros: ~2 s of the
event loop's CPU), and every malformed request is logged at ERROR with a traceback (3 MB of log for 5,000
bad requests). Here:

* :class:`GuardedHandler` (aiohttp's connection protocol, subclassed): a request's head must arrive within
  ``head_timeout`` of its first byte; a parse error is answered in JSON with ``Dispenser-Error-Code`` and
  logged in one INFO line (at most one a second, with a count of those left out).
* :class:`GuardedSite`: the listening socket; past ``max_connections`` open connections a new one is
  answered 503 ``too_many_connections`` and closed at once.
* :func:`handler_settings`: keep-alive, no lingering read of unread bodies, no decompression.
* :func:`raise_open_files_limit` and :func:`fit_connections`: the soft ``RLIMIT_NOFILE`` raised to the hard
  limit, and the connection cap lowered to leave room for everything else the worker opens.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable, Coroutine
from http import HTTPStatus
from typing import Any, cast

import msgspec
from aiohttp import web
from aiohttp.web_request import BaseRequest

__all__ = [
    "FD_RESERVE",
    "GuardedHandler",
    "GuardedSite",
    "LogLimiter",
    "fit_connections",
    "handler_settings",
    "raise_open_files_limit",
]

log = logging.getLogger(__name__)

ERROR_CODE_HEADER = "Dispenser-Error-Code"

FD_RESERVE = 256
"""File descriptors kept out of the HTTP API's reach: the probes' port, NATS, Kafka, the PostgreSQL pool, the
state files, a few for logging. The API's connection cap is lowered to leave them."""

SERVER_HEADER = "leaf-dispenser"
"""The ``Server`` header: the product, not the library and its version."""


def handler_settings(keepalive_timeout: float) -> dict[str, Any]:
    """The connection settings (aiohttp's) for a server any caller can reach.

    * ``keepalive_timeout``: an idle connection (before its first request too) is closed after it.
    * ``auto_decompress=False``: a body is never inflated (the ID routes read none), so a compressed bomb
      costs its compressed size and no CPU.
    * ``lingering_time=1``: a body the route did not read is drained, as raw bytes, for at most a second
      after the answer, then the connection is closed (nginx's "lingering close": closing at once with
      unread bytes would make the kernel reset the connection and could drop the answer at the client).
    """
    return {
        "keepalive_timeout": keepalive_timeout,
        "lingering_time": 1.0,
        "auto_decompress": False,
        "access_log": None,  # one line per ID request would cost more than the answer (and say little)
    }


class LogLimiter:
    """At most one log line per ``interval`` seconds for one kind of event, with a count of those left out."""

    __slots__ = ("_clock", "_interval", "_last", "_left_out", "_logger")

    def __init__(
        self, logger: logging.Logger, interval: float = 1.0, clock: Callable[[], float] = time.monotonic
    ):
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._last = float("-inf")
        self._left_out = 0

    def log(self, level: int, message: str, *args: object) -> None:
        """Log ``message % args`` at ``level``, unless a line went out less than ``interval`` ago."""
        now = self._clock()
        if now - self._last < self._interval:
            self._left_out += 1
            return
        if self._left_out:
            message += " (and %d more like it since the last line)"
            args = (*args, self._left_out)
        self._last = now
        self._left_out = 0
        self._logger.log(level, message, *args)


_bad_requests = LogLimiter(log)
_refusals = LogLimiter(log, interval=10.0)
_cut_off = LogLimiter(log)


def _error_body(code: str, message: str, retryable: bool = False) -> bytes:
    return msgspec.json.encode({"error": {"code": code, "message": message, "retryable": retryable}})


# What aiohttp's parser answers, by status: the code a client sees in the body and in Dispenser-Error-Code.
_PARSE_ERROR_CODES = {400: "malformed", 413: "too_large", 414: "too_large", 431: "too_large"}
# What the router answers (a path or method with no route, ``OPTIONS *``, ``CONNECT``), by status.
_ROUTER_CODES = {404: "not_found", 405: "method_not_allowed"}


# aiohttp's own methods, called without super()'s lookup on the per-request path.
_data_received = web.RequestHandler.data_received
_finish_response = web.RequestHandler.finish_response


class GuardedHandler(web.RequestHandler):
    """aiohttp's connection protocol, with a deadline for each request's head and parse errors in JSON.

    The head deadline runs from the first byte of a request that has not been parsed yet to the end of its
    head; aiohttp's keep-alive timer covers a connection that sends nothing at all.
    """

    __slots__ = ("_head_timeout", "_head_timer")

    def __init__(
        self, manager: web.Server, *, loop: asyncio.AbstractEventLoop, head_timeout: float, **kwargs: Any
    ):
        super().__init__(manager, loop=loop, **kwargs)
        self._head_timeout = head_timeout
        self._head_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        """Parse what arrived; start the head deadline at the first byte of a request not yet parsed.

        Pipelined requests that arrive in one chunk are parsed one head at a time: aiohttp's parser drops
        the requests it has already parsed in a chunk when a later one in it is malformed, so the good ones
        before a bad one would get no answer.
        """
        end = data.find(b"\r\n\r\n") + 4
        if 3 < end < len(data):  # more after the first head: pipelined requests (or a body)
            while 3 < end < len(data):
                self._parse(data[:end])
                data = data[end:]
                end = data.find(b"\r\n\r\n") + 4
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        # aiohttp counts the requests it has parsed on this connection: a change means a head arrived.
        parsed = self._request_count
        _data_received(self, data)
        if self._request_count != parsed:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
        elif self._head_timer is None and self.transport is not None:
            self._head_timer = self._loop.call_later(self._head_timeout, self._head_expired, parsed)

    def _head_expired(self, parsed: int) -> None:
        self._head_timer = None
        if self._request_count == parsed and self.transport is not None:
            peer = self.transport.get_extra_info("peername")
            _cut_off.log(
                logging.INFO,
                "closed an HTTP connection from %s: no complete request head within %.3g s (http.head_timeout)",
                peer[0] if peer else "?",
                self._head_timeout,
            )
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        """The connection closed: no deadline left to run."""
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> Coroutine[Any, Any, tuple[web.StreamResponse, bool]]:
        """Send the answer; one aiohttp raised itself (no route for ``OPTIONS *``, ``CONNECT``) in JSON.

        A plain function returning aiohttp's coroutine, not a coroutine of its own: this runs for every
        answer, and an extra coroutine frame cost ~0.5 µs of the ~37 µs a request costs the server.
        """
        if isinstance(resp, web.HTTPException) and ERROR_CODE_HEADER not in resp.headers:
            code = _ROUTER_CODES.get(resp.status, "bad_request")
            resp = web.Response(
                status=resp.status,
                body=_error_body(code, resp.reason),
                content_type="application/json",
                headers={ERROR_CODE_HEADER: code, "Server": SERVER_HEADER},
            )
        return _finish_response(self, request, resp, start_time)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request aiohttp could not parse (or a handler that failed): one INFO line, a JSON answer.

        A client's malformed request is the client's problem: it gets a coded answer, and the log one line
        without a traceback (an unexpected 500 from a handler keeps its traceback, at ERROR).
        """
        peer = request.remote or "?"
        if status >= 500:
            self.logger.error("HTTP request from %s failed", peer, exc_info=exc)
            code, text = "internal", HTTPStatus(status).phrase
        else:
            code = _PARSE_ERROR_CODES.get(status, "bad_request")
            text = (getattr(exc, "message", None) or message or HTTPStatus(status).phrase).splitlines()[0]
            _bad_requests.log(logging.INFO, "bad HTTP request from %s: %d %s", peer, status, text[:200])
        if request.writer.output_size > 0:  # part of an answer is out: the connection is all we can close
            raise ConnectionError("the answer was under way when the request failed")
        response = web.Response(
            status=status,
            body=_error_body(code, text),
            content_type="application/json",
            headers={ERROR_CODE_HEADER: code, "Server": SERVER_HEADER},
        )
        response.force_close()
        return response


class _Refusal(asyncio.Protocol):
    """A connection past the cap: answered 503 at once and closed, without reading what it sends."""

    _ANSWER = b"".join(
        [
            b"HTTP/1.1 503 Service Unavailable\r\n",
            b"Content-Type: application/json\r\n",
            f"{ERROR_CODE_HEADER}: too_many_connections\r\n".encode(),
            b"Retry-After: 1\r\n",
            b"Connection: close\r\n",
        ]
    )

    def __init__(self, cap: int) -> None:
        self._body = _error_body(
            "too_many_connections", f"this worker holds its limit of {cap} HTTP connections", retryable=True
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(
            asyncio.Transport, transport
        )  # uvloop's transports are no asyncio.Transport subclass
        body = self._body
        transport.write(self._ANSWER + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        transport.close()


class GuardedSite(web.BaseSite):
    """A TCP site whose connections are :class:`GuardedHandler` s, at most ``max_connections`` open at once.

    ``reuse_port``: bind with ``SO_REUSEPORT``, so that the worker processes of one host listen on one port
    and the kernel spreads the connections among them (``dispenser serve --processes``); off, a port that
    is taken is an error, as it should be for a single worker.
    """

    __slots__ = ("_bound_port", "_handler", "_host", "_port", "_reuse_port", "max_connections", "refused")

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        max_connections: int,
        head_timeout: float,
        keepalive_timeout: float,
        reuse_port: bool = False,
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._reuse_port = reuse_port
        self._bound_port = port
        self.max_connections = max_connections
        self.refused = 0
        """Connections answered ``too_many_connections`` since the start."""
        self._handler = handler_settings(keepalive_timeout) | {"head_timeout": head_timeout}

    @property
    def name(self) -> str:
        """``http://host:port``."""
        return f"http://{self._host}:{self._bound_port}"

    @property
    def port(self) -> int:
        """The port listened on (the one chosen, for port 0, once started)."""
        return self._bound_port

    async def start(self) -> None:
        """Listen (``OSError`` if the port is taken)."""
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        settings = self._handler
        cap = self.max_connections

        def connection() -> asyncio.Protocol:
            if len(server.connections) >= cap:
                self.refused += 1
                _refusals.log(
                    logging.WARNING,
                    "HTTP connection limit reached (%d open, http.max_connections): refusing new connections",
                    cap,
                )
                return _Refusal(cap)
            return GuardedHandler(server, loop=loop, **settings)

        self._server = await loop.create_server(
            connection, self._host, self._port, backlog=self._backlog, reuse_port=self._reuse_port or None
        )
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]


def raise_open_files_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; the soft limit now in force.

    The usual soft limit (1,024) is far below what a server needs and below the hard limit (often 524,288
    or more), which an unprivileged process may raise its soft limit to. Never lowers the limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20  # Linux's default nr_open: setting "unlimited" is refused
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return soft if soft != resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    except (ValueError, OSError) as exc:  # a container's seccomp profile, or nr_open below the hard limit
        log.warning("could not raise the open files limit from %d to %d: %s", soft, hard, exc)
        return soft
    log.debug("raised the open files limit from %d to %d", soft, hard)
    return hard


def fit_connections(max_connections: int, open_files: int, reserve: int = FD_RESERVE) -> int:
    """The connection cap that leaves ``reserve`` descriptors free under an ``open_files`` limit (>= 1)."""
    return max(1, min(max_connections, open_files - reserve))
