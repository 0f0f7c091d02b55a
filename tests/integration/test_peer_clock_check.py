"""The snowflake start-up clock check never passes silently: 'no peers' and 'nobody heard us' differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispenser.core.errors import PeerClockUnverified
from dispenser.testing.servers import NatsServer

from .segment_support import client, running_worker
from .snowflake_support import refused, snowflake_config

pytestmark = [pytest.mark.nats]


async def test_alone_is_confirmed_by_no_responders(
    private_nats: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With no peer running, the server's 'no responders' confirms it: the worker starts, no warning."""
    caplog.set_level("INFO")
    async with running_worker(snowflake_config(private_nats.url, tmp_path, name="alone")):
        pass
    assert "this worker is the first" in caplog.text
    assert "got no answer at all" not in caplog.text


async def test_an_unheard_clock_query_warns_or_refuses(
    private_nats: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A subscriber that never answers (as when the query cannot get through): a warning, or a refusal."""
    async with client(private_nats.url) as nc:
        await nc.subscribe("leaf.snowflake-clock")  # takes the query, never answers: no 'no responders'
        await nc.flush()
        async with running_worker(snowflake_config(private_nats.url, tmp_path / "a", name="warned")):
            pass
        assert "got no answer at all" in caplog.text
        error = await refused(
            snowflake_config(private_nats.url, tmp_path / "b", name="refused", peer_check_failure="refuse")
        )
    assert isinstance(error, PeerClockUnverified)
    assert error.retryable
