"""A worker over HTTP: Leaf's API (docs/http.md), with the operations endpoints beside it."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Mapping

from dispenser.adapters.http import HttpServer, LeafApi, Operations
from dispenser.adapters.http.access import HttpAccess
from dispenser.adapters.http.guard import FD_RESERVE, raise_open_files_limit
from dispenser.app.parts import Off
from dispenser.app.snowflake import Snowflake
from dispenser.config import Config
from dispenser.core.errors import DispenserError
from dispenser.registries import layout_of
from dispenser.service.decode import decode_id
from dispenser.service.dispatch import Dispatcher

__all__ = ["start_http"]

log = logging.getLogger("dispenser.app")  # the lines the worker's wiring has always logged under


async def start_http(
    stack: contextlib.AsyncExitStack,
    config: Config,
    port: int,
    dispatchers: Mapping[str, Dispatcher],
    ops: Operations,
    *,
    snowflake: Snowflake | Off,
    with_metrics: bool,
) -> HttpServer:
    """Leaf's HTTP API on ``port`` (``http.port``), answered by the same dispatchers as NATS and Kafka.

    Args:
        stack: where its clean-up goes.
        config: the configuration.
        port: ``http.port``.
        dispatchers: by kind.
        ops: what the operations endpoints read.
        snowflake: the snowflake part (``/decodeSnowflakeId`` decodes with its layout).
        with_metrics: serve ``/metrics`` too (``metrics.port`` is ``http.port``); else it names every tag
            and its volume, not for every caller.
    """
    http = config.http
    decode = None
    try:  # Leaf decodes with its layout whether or not snowflake is on; so does this, with ours
        layout = layout_of(config.snowflake) if isinstance(snowflake, Off) else snowflake.generator.layout
        decode = functools.partial(decode_id, layout)
    except DispenserError as exc:  # a broken layout of a generator that is off: no decode, no exit
        log.warning("no /decodeSnowflakeId: %s", exc)
    access = HttpAccess.from_config(http)
    server = HttpServer(
        http.host,
        port,
        ops if with_metrics else dataclasses.replace(ops, metrics=None),
        LeafApi(dispatchers, decode=decode),
        access=access,
        max_connections=http.max_connections,
        open_files=raise_open_files_limit(),
        keepalive_timeout=http.keepalive_timeout,
        head_timeout=http.head_timeout,
        # The worker processes of one host (worker.processes) share the port; the kernel spreads connections.
        reuse_port=config.worker.processes != 1,
    )
    if server.max_connections < http.max_connections:
        log.warning(
            "http.max_connections lowered from %d to %d to fit the open files limit (ulimit -n) with %d to spare",
            http.max_connections,
            server.max_connections,
            FD_RESERVE,
        )
    stack.push_async_callback(server.stop)
    await server.start()
    log.info(
        "serving Leaf's HTTP API on %s (%s; %s)",
        server.url,
        ", ".join(f"/api/{kind}/get/<key>" for kind in dispatchers) or "no generator",
        f"callers: {', '.join(access.names())}" if not access.open else "open to anyone who reaches it",
    )
    return server
