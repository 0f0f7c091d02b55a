"""The snowflake start-up clock check never passes silently: 'no peers' and 'nobody heard us' differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispenser.core.errors import PeerClockUnverified
from dispenser_lab.servers import NatsServer

from .segment_support import running_worker
from .snowflake_support import refused, snowflake_config

pytestmark = [pytest.mark.nats]


async def test_alone_is_confirmed_by_no_responders(
    private_nats: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With no peer running, the worker's own answer confirms its query went through: it starts, no warning.

    (It answers before it asks, so the server never says 'no responders'.)
    """
    caplog.set_level("INFO")
    async with running_worker(snowflake_config(private_nats.url, tmp_path, name="alone")):
        pass
    assert "this worker is the first" in caplog.text
    assert "got no answer at all" not in caplog.text


async def test_an_unheard_clock_query_warns_or_refuses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No permission to publish on the clock subject: a warning, or a refusal.

    The query cannot get through, not even to the worker's own answerer.
    """
    conf = (
        "authorization { users = [ {user: w, password: pw, "
        'permissions: {publish: {deny: ["leaf.snowflake-clock"]}}} ] }'
    )
    with NatsServer(tmp_path / "nats", config=conf) as server:
        url = server.url.replace("nats://", "nats://w:pw@")
        async with running_worker(snowflake_config(url, tmp_path / "a", name="warned")):
            pass
        assert "got no answer at all" in caplog.text
        error = await refused(
            snowflake_config(url, tmp_path / "b", name="refused", peer_check_failure="refuse")
        )
    assert isinstance(error, PeerClockUnverified)
    assert error.retryable
