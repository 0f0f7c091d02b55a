"""The baseline of ``dispenser bench http``: a trivial aiohttp handler in a process of its own.

``python -m dispenser_lab.bench.http_echo --port 8081``

The same library, route shape and settings as the worker's server (no access log, uvloop, keep-alive),
answering every ``/api/{kind}/get/{key}`` with a constant plain-text ID: the fastest an aiohttp handler
can answer that path, and so the ceiling the dispenser's HTTP API is measured against. It runs until
SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from dispenser.runner import run_async

__all__ = ["main", "serve"]

ANSWER = b"1234567890123456789"
"""As many digits as a snowflake ID (the segment IDs of the bench are shorter)."""


async def serve(host: str, port: int) -> None:
    """Answer until SIGTERM or SIGINT."""

    async def get(_request: web.Request) -> web.Response:
        # Built as the worker builds its answer (from bytes, the cheapest way aiohttp has), so that the
        # comparison measures the worker's own work, not a choice of constructor.
        return web.Response(body=ANSWER, content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_route("*", "/api/{kind}/get/{key}", get)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments and serve on uvloop (as ``dispenser serve`` does)."""
    parser = argparse.ArgumentParser(prog="python -m dispenser_lab.bench.http_echo", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    run_async(serve(args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
