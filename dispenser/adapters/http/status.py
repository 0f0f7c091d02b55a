"""``/status`` and ``/status.json``: the worker's status page, served where ``/metrics`` is.

The page names every tag and its volume, as ``/metrics`` does, so it goes only where ``/metrics`` goes:
``metrics.port``, or ``http.port`` when it is the metrics port (never to every caller of the API). The page
and its snapshot are :mod:`dispenser.status`'s; this module only answers them.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from dispenser.adapters.http.guard import SERVER_HEADER

__all__ = ["StatusSource", "add_status_routes"]


class StatusSource(Protocol):
    """The status page and its data, read anew at each request (:class:`dispenser.status.StatusPage`)."""

    @property
    def content_security_policy(self) -> str:
        """The page's ``Content-Security-Policy`` (its own inline style and script only)."""
        ...

    def html(self) -> str:
        """The page."""
        ...

    def json(self) -> bytes:
        """The snapshot in JSON."""
        ...


def add_status_routes(router: web.UrlDispatcher, source: StatusSource) -> None:
    """Answer ``GET /status`` (HTML) and ``GET /status.json`` from ``source``."""
    common = {
        "Server": SERVER_HEADER,
        "Cache-Control": "no-store",  # a live view: never a stale copy from a cache
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
    }
    page_headers = {
        **common,
        "Content-Security-Policy": source.content_security_policy,
        "X-Frame-Options": "DENY",  # frame-ancestors 'none' for browsers without CSP level 2
    }

    async def page(_request: web.Request) -> web.Response:
        return web.Response(
            text=source.html(), content_type="text/html", charset="utf-8", headers=page_headers
        )

    async def data(_request: web.Request) -> web.Response:
        return web.Response(body=source.json(), content_type="application/json", headers=common)

    router.add_get("/status", page)
    router.add_get("/status.json", data)
