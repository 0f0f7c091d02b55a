"""A real headless browser for the tests: Debian's Chromium, driven over the Chrome DevTools protocol.

No Selenium or Playwright: the protocol is JSON over a WebSocket (aiohttp's client), and the few calls a
test needs are here (navigate, evaluate, screenshot). A missing Chromium fails the test, never skips it
(``scripts/test`` installs Debian's ``chromium``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

__all__ = ["Page", "chromium_path", "headless_page"]

_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


def chromium_path() -> str:
    """The ``chromium`` on the PATH; the test fails (not skips) without it."""
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("Debian's chromium is not installed (scripts/test installs it: apt-get install chromium)")
    return path


class Page:
    """One browser tab over the DevTools protocol."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command and return its result (events in between are dropped)."""
        call_id = next(self._ids)
        await self._ws.send_json({"id": call_id, "method": method, "params": params})
        while True:
            message = await self._ws.receive_json(timeout=15)
            if message.get("id") == call_id:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                result: dict[str, Any] = message["result"]
                return result

    async def navigate(self, url: str) -> None:
        """Load ``url`` and wait for its load event (the document and what it loads)."""
        await self.call("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'", what=f"{url} loaded")

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (returned by value, as JSON)."""
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, *, what: str, timeout: float = 10.0) -> Any:
        """Poll ``expression`` in the page (every 50 ms) until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while not (value := await self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout:g} s")
            await asyncio.sleep(0.05)
        return value

    async def screenshot(self, width: int = 1600) -> bytes:
        """A PNG of the whole page, ``width`` CSS pixels wide."""
        height = await self.evaluate("document.documentElement.scrollHeight")
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=int(height),
            deviceScaleFactor=1,
            mobile=False,
        )
        shot = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        return base64.b64decode(shot["data"])


async def _devtools_url(stderr: asyncio.StreamReader) -> str:
    while line := await stderr.readline():
        found = _LISTENING.search(line.decode(errors="replace"))
        if found:
            return found.group(1)
    raise AssertionError("chromium exited before it listened for DevTools")


@contextlib.asynccontextmanager
async def headless_page(profile: Path) -> AsyncIterator[Page]:
    """A headless Chromium (its profile in ``profile``) and its first tab; the browser is stopped afterwards."""
    arguments = [
        chromium_path(),
        "--headless",
        "--disable-gpu",
        "--no-first-run",
        "--no-default-browser-check",
        "--hide-scrollbars",
        "--remote-debugging-port=0",
        "--remote-debugging-address=127.0.0.1",
        f"--user-data-dir={profile}",
        "--window-size=1600,1000",
        "about:blank",
    ]
    if os.geteuid() == 0:
        arguments.insert(1, "--no-sandbox")  # Chromium's sandbox refuses to run as root (CI containers)
    process = await asyncio.create_subprocess_exec(
        *arguments, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True
    )
    assert process.stderr is not None
    try:
        browser_url = await asyncio.wait_for(_devtools_url(process.stderr), 30)
        # Keep reading its log, so that a full pipe never blocks the browser.
        drain = asyncio.ensure_future(process.stderr.read())
        http = "http://" + browser_url.removeprefix("ws://").split("/", 1)[0]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{http}/json/list") as answer:
                targets = json.loads(await answer.text())
            (page_url,) = [t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page"]
            async with session.ws_connect(page_url, max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Page.enable")
                yield page
        drain.cancel()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)  # the browser and its helper processes
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
