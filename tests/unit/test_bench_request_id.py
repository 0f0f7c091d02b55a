"""``dispenser bench nats --request-id``: the bodies it sends, and the option."""

from __future__ import annotations

from dispenser.messages import decode_request
from dispenser_lab.bench.nats_bench import _with_request_ids
from dispenser_lab.bench.nats_plan import THROUGHPUT_BODIES, parse_options


def test_every_body_is_a_valid_request_with_a_fresh_request_id() -> None:
    make = _with_request_ids(THROUGHPUT_BODIES[0])
    requests = [decode_request(make()) for _ in range(1_000)]
    assert all(r.count == 1 for r in requests)
    assert len({r.request_id for r in requests}) == 1_000
    other = decode_request(_with_request_ids(THROUGHPUT_BODIES[0])())
    assert other.request_id not in {r.request_id for r in requests}  # another run prefix


def test_the_option_is_off_by_default() -> None:
    assert not parse_options([]).request_id
    assert parse_options(["--request-id"]).request_id
