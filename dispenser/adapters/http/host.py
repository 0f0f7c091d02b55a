"""The host's operations endpoints when ``dispenser serve`` runs several worker processes (``metrics.port``).

``/metrics`` asks every serving process for its own (each on a loopback port of its own) when scraped and
answers them merged (the merge is given: the Prometheus adapter's); ``/readyz`` asks each process's
``/readyz`` and answers for the host with the meaning each has alone; ``/healthz`` is the supervisor's
event loop answering. Why this and not Prometheus' multiprocess mode: docs/operations.md, "Processes per
host".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from dispenser.adapters.http.guard import SERVER_HEADER, GuardedSite

__all__ = ["ChildProbe", "HostOperations"]

log = logging.getLogger(__name__)

_ASK_TIMEOUT = 2.0
"""Seconds a process's ``/metrics`` or ``/readyz`` may take (a process that does not answer is left out)."""
_CONNECTIONS = 128
_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_HEADERS = {"Server": SERVER_HEADER}


@dataclass(frozen=True, slots=True)
class ChildProbe:
    """One running worker process, as the host's endpoints see it."""

    name: str
    """Its index, as the ``process`` label and the reasons name it."""
    metrics_port: int | None
    """Its ``/metrics`` (and probes) on the loopback; ``None``: none (yet)."""
    serving: bool
    """Whether it has started serving (reported to the supervisor)."""


class HostOperations:
    """``/metrics``, ``/healthz`` and ``/readyz`` of a host of worker processes, on ``host:port``.

    Args:
        host: the address to listen on (``metrics.host``).
        port: ``metrics.port`` (0: a free one; :attr:`port` says which once started).
        children: the processes running now.
        merge: the processes' expositions (by name) as one.
    """

    def __init__(
        self,
        host: str,
        port: int,
        children: Callable[[], Sequence[ChildProbe]],
        merge: Callable[[dict[str, str]], bytes],
    ) -> None:
        self.host = host
        self.port = port
        self._children = children
        self._merge = merge
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        self._app = app

    @property
    def url(self) -> str:
        """``http://host:port`` (after :meth:`start`)."""
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        """Listen; a port that is taken raises ``OSError``."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_ASK_TIMEOUT))
        runner = web.AppRunner(self._app, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        self._runner = runner
        site = GuardedSite(
            runner,
            self.host,
            self.port,
            max_connections=_CONNECTIONS,
            head_timeout=10.0,
            keepalive_timeout=75.0,
        )
        await site.start()
        self.port = site.port

    async def stop(self) -> None:
        """Stop listening and close the connections to the processes."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _ask(self, child: ChildProbe, path: str) -> tuple[int, bytes] | None:
        """A process's answer on ``path`` (status, body), or ``None`` if it has no port or does not answer."""
        if child.metrics_port is None or self._session is None:
            return None
        try:
            async with self._session.get(f"http://127.0.0.1:{child.metrics_port}{path}") as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("process %s did not answer %s: %s", child.name, path, exc)
            return None

    async def _metrics(self, _request: web.Request) -> web.Response:
        serving = [child for child in self._children() if child.serving]
        answers = await asyncio.gather(*(self._ask(child, "/metrics") for child in serving))
        texts = {
            child.name: answer[1].decode()
            for child, answer in zip(serving, answers, strict=True)
            if answer is not None and answer[0] == 200
        }
        return web.Response(body=self._merge(texts), headers={"Content-Type": _METRICS_TYPE, **_HEADERS})

    async def _healthz(self, _request: web.Request) -> web.Response:
        # Alive: the supervisor's event loop answers (it restarts a process that dies by itself).
        return web.Response(text="ok\n", headers=_HEADERS)

    async def _readyz(self, request: web.Request) -> web.Response:
        """Ready while some process serves and every serving one is ready (its own meaning, unchanged).

        A process starting or restarting is listed but does not count: the kernel and NATS send it nothing
        until it serves. ``cannot_issue`` gathers the processes' own, each named.
        """
        children = list(self._children())
        serving = [child for child in children if child.serving]
        query = f"?{request.query_string}" if request.query_string else ""
        answers = await asyncio.gather(*(self._ask(child, f"/readyz{query}") for child in serving))
        states = {child.name: "starting" for child in children if not child.serving}
        reasons: list[str] = []
        short: list[str] = []
        strict_refusal = False
        for child, answer in zip(serving, answers, strict=True):
            if answer is None:
                reasons.append(f"process {child.name}: /readyz did not answer")
                states[child.name] = "silent"
                continue
            body = _json_of(answer[1])
            states[child.name] = str(body.get("status", answer[0]))
            reasons += [f"process {child.name}: {reason}" for reason in body.get("reasons", ())]
            short += [f"process {child.name}: {reason}" for reason in body.get("cannot_issue", ())]
            strict_refusal |= answer[0] != 200 and not body.get("reasons")
        if not serving:
            reasons.append("no worker process serves yet")
        processes = dict(sorted(states.items(), key=lambda item: int(item[0])))
        if reasons:
            return _json({"status": "not ready", "reasons": reasons, "processes": processes}, 503)
        ready: dict[str, Any] = {"status": "ready", "processes": processes}
        if short:
            ready["cannot_issue"] = short
        return _json(ready, 503 if strict_refusal else 200)


def _json_of(body: bytes) -> Mapping[str, Any]:
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body), status=status, content_type="application/json", headers=_HEADERS
    )
