"""Snowflake rate meters under junk tag names, over real NATS: a tag that serves traffic always gets its meter.

Snowflake serves any tag name, so a worker keeps at most a bounded number of meters; before issue 33
(item 6) 600 junk names filled the 512 slots until a restart and a real tag asked for afterwards had no
rate, no events and no metrics.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dispenser.config import load_config
from dispenser.messages import RateEvent
from dispenser_lab.servers import NatsServer

from .segment_support import ask, client, running_worker, wait_until
from .snowflake_support import snowflake_env, subject

pytestmark = [pytest.mark.nats]

JUNK = 600


def scrape(port: int) -> str:
    """GET /metrics (blocking: call it from a thread)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text: str = page.read().decode()
    return text


async def test_a_real_tag_after_600_junk_tags_gets_its_rate_and_metrics(
    private_nats: NatsServer, tmp_path: Path, zk_namespace: str
) -> None:
    """600 junk snowflake tags, then `order`: its IDs are counted in /metrics and its rate events say so."""
    env = snowflake_env(private_nats.url, tmp_path / "state", name=zk_namespace, worker_id=3)
    env |= {"DISPENSER_RATE_INTERVAL": "0.2", "DISPENSER_RATE_WINDOW": "1", "DISPENSER_METRICS_PORT": "0"}
    config = load_config(environ=env)
    seen: list[RateEvent] = []

    async def received(msg: object) -> None:
        seen.append(msgspec.convert(json.loads(msg.data), RateEvent))  # type: ignore[attr-defined]

    async with running_worker(config) as worker, client(private_nats.url) as nc:
        for start in range(0, JUNK, 100):
            replies = await asyncio.gather(
                *(ask(nc, subject(tag=f"junk-{i}")) for i in range(start, start + 100))
            )
            assert all(reply.error is None for reply in replies)
        sub = await nc.subscribe("leaf.rate.order", cb=received)
        issued = 0
        for _ in range(20):
            reply = await ask(nc, subject(tag="order"), b'{"count": 50}')
            assert reply.ids is not None
            issued += len(reply.ids)
        await wait_until(
            lambda: any(e.kind == "snowflake" and e.ids_total == issued and e.ids_per_s > 0 for e in seen),
            what="a rate event of tag order counting its IDs",
        )
        await sub.unsubscribe()
        metrics = await asyncio.to_thread(scrape, worker.metrics.port)
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    counted = [
        s.value for s in families["leaf_ids"].samples if s.labels == {"kind": "snowflake", "tag": "order"}
    ]
    assert counted == [issued]
    snowflake_meters = {
        s.labels["tag"] for s in families["leaf_ids"].samples if s.labels["kind"] == "snowflake"
    }
    assert "order" in snowflake_meters
    assert len(snowflake_meters) <= 512  # still bounded
