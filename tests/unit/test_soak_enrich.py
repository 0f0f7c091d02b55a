"""The soak's read-back of the enriched stream: what counts as twice, missing and misplaced."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from dispenser_lab.soak.enrich import EnrichResult, _judge


@dataclass
class _Record:
    partition: int
    offset: int
    value: bytes
    headers: list[tuple[str, bytes]] = field(default_factory=list)


def _input(offset: int, *, bad: bool = False) -> _Record:
    return _Record(0, offset, b"not json" if bad else json.dumps({"n": offset}).encode())


def _out(offset: int, id_: int, *, value: bytes | None = None) -> _Record:
    body = value if value is not None else json.dumps({"n": offset, "id": id_}).encode()
    return _Record(0, offset, body, [("leaf-source", f"soak.orders/0/{offset}".encode())])


def test_a_clean_stream_passes() -> None:
    result = EnrichResult()
    _judge(
        result,
        [_input(0), _input(1), _input(2, bad=True)],
        [_out(0, 10), _out(1, 11)],
        [_out(2, 0, value=b"x")],
    )
    assert (result.fed, result.enriched, result.dead_lettered) == (3, 2, 1)
    assert result.ids == [10, 11]
    result.caught_up_s = 1.0
    assert result.failures() == []


def test_twice_missing_misplaced_and_a_repeated_id_each_fail() -> None:
    result = EnrichResult(caught_up_s=1.0)
    inputs = [_input(0), _input(1), _input(2), _input(3, bad=True)]
    outputs = [_out(0, 10), _out(0, 12), _out(3, 10)]  # 0 twice, 3 (unfit) enriched, ID 10 twice
    _judge(result, inputs, outputs, [_out(2, 0, value=b"x")])  # 2 (fit) dead-lettered; 1 missing
    assert (result.twice, result.missing, result.misplaced) == (1, 1, 2)
    failures = " ".join(result.failures())
    for word in ("twice", "missing", "misplaced", "IDs given to two records"):
        assert word in failures


def test_an_enricher_that_never_caught_up_fails() -> None:
    result = EnrichResult()
    _judge(result, [_input(0)], [_out(0, 1)], [])
    assert any("never committed" in failure for failure in result.failures())
