"""Every request Leaf's own server was asked, answered by the dispenser as Leaf answered it.

Status, media type, charset and the form of the body, from the table captured from the real Leaf 1.0.1
(``tests/integration/leaf_answers.json``, written by ``python -m dispenser_lab.leaf.capture``). A difference
kept on purpose is listed in :data:`DIFFERENCES` with its reason (and in docs/http.md); any other is a
failure, so the next one is found here and not by a caller.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from dispenser_lab.leaf.callers import ask_from_java
from dispenser_lab.leaf.capture import REQUESTS, TAG, ask
from dispenser_lab.servers import NatsServer

from .segment_support import prepare, running_worker
from .test_http import http_config

pytestmark = [pytest.mark.nats, pytest.mark.postgres]

TABLE = json.loads((Path(__file__).with_name("leaf_answers.json")).read_text())

DIFFERENCES = {
    # Spring's suffix pattern match cuts a key at its last dot (leaf-segment-test.json is leaf-segment-test,
    # answered as JSON); the dispenser takes the key as sent, so a tag is never another tag's IDs.
    "segment/dotted": "the key as sent",
    "snowflake/dotted": "the key as sent",
}


def test_the_table_covers_every_request_and_names_leaf() -> None:
    assert sorted(TABLE["answers"]) == sorted(probe.name for probe in REQUESTS)
    assert TABLE["requests"] == [asdict(probe) for probe in REQUESTS]
    assert "Leaf 1.0.1" in TABLE["leaf"]
    assert set(DIFFERENCES) <= set(TABLE["answers"])


async def test_every_request_is_answered_as_leaf_answers_it_and_java_callers_read_the_ids(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    """Every probe of the table; then Java's callers as Leaf's users have them (one worker for both).

    Spring's RestTemplate with Jackson asked for a Long (it sends ``Accept: application/json,
    application/*+json`` and finds no converter for ``text/plain``) and for a String, and Java's HttpClient
    reading text, at both of Leaf's paths (with Spring's trailing slash on one).
    """
    await prepare(pg_dsn, [(TAG, 2000)])
    async with running_worker(http_config(nats_server.url, pg_dsn, tmp_path)) as worker:
        port = urlsplit(worker.http.url).port
        assert port is not None
        ours = {probe.name: await asyncio.to_thread(ask, port, probe) for probe in REQUESTS}
        urls = [f"{worker.http.url}/api/segment/get/{TAG}", f"{worker.http.url}/api/snowflake/get/{TAG}/"]
        answers = await asyncio.to_thread(ask_from_java, *urls)
    mismatched = []
    for name, leaf in TABLE["answers"].items():
        mine = asdict(ours[name])
        if name in DIFFERENCES:
            assert (mine["status"], mine["media_type"], mine["form"]) != (
                leaf["status"],
                leaf["media_type"],
                leaf["form"],
            ), f"{name} matches Leaf now"
            continue
        same = (
            mine["status"] == leaf["status"]
            and mine["media_type"] == leaf["media_type"]
            and mine["charset"] == leaf["charset"]
            and (mine["form"] == leaf["form"] or _more_keys(mine["form"], leaf["form"]))
            and all(mine["fields"].get(key) == value for key, value in leaf["fields"].items())
        )
        if not same:
            mismatched.append(f"{name}: Leaf {leaf}, ours {mine}")
    assert mismatched == [], "\n".join(mismatched)

    assert len(answers) == 2
    for got in answers:
        assert "rest_long_error" not in got, got
        assert got["http_client_status"] == 200
        ids = [got["rest_long"], int(got["rest_string"]), got["http_client"]]
        assert all(i > 0 for i in ids)
        assert len(set(ids)) == 3, ids
    segment = [answers[0]["rest_long"], int(answers[0]["rest_string"]), answers[0]["http_client"]]
    assert segment == sorted(segment)


def _more_keys(mine: str, leaf: str) -> bool:
    """An error body of ours is Leaf's and more (``code``, ``retryable``, ``detail``)."""
    if not (mine.startswith("json:") and leaf.startswith("json:")):
        return False
    return set(leaf[5:].split(",")) <= set(mine[5:].split(","))
