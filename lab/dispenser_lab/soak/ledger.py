"""Checking replies and keeping every ID received, as ranges, to find duplicates at the end (pure).

Ten million IDs as Python ints in a set would take about a gigabyte. They arrive in runs instead (a
segment batch is one or two runs, a snowflake batch one run per millisecond), so the ledger keeps
``[first, last]`` runs in two ``array('q')`` columns (16 bytes a run) and finds overlaps by sorting the
runs by their first ID once, at the end.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from dispenser.messages import ErrorBody, Reply

__all__ = ["Checked", "Overlaps", "RangeSet", "check_reply", "runs_of"]

MAX_ID = 2**63 - 1

_decoder = msgspec.json.Decoder(Reply)


@dataclass(frozen=True, slots=True)
class Checked:
    """What one reply turned out to be.

    Attributes:
        outcome: ``ids`` (a good batch, in ``runs``), ``error`` (a well-formed error reply) or
            ``malformed`` (anything else: undecodable, wrong count, unordered, wrong tag, …).
        runs: The batch as inclusive ``(first, last)`` runs in increasing order (outcome ``ids``).
        code: The error code (outcome ``error``; empty if the reply had none, which is a failure).
        retryable: Whether the error reply says a retry may help.
        status: The ``Nats-Service-Error-Code`` header (outcome ``error``; ``None`` if missing).
        reason: Why a reply is ``malformed``, or what is wrong with an error reply.
    """

    outcome: Literal["ids", "error", "malformed"]
    runs: tuple[tuple[int, int], ...] = ()
    code: str = ""
    retryable: bool = False
    status: str | None = None
    reason: str = ""


def runs_of(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Collapse strictly increasing IDs into inclusive runs of consecutive values.

    Raises:
        ValueError: the IDs are not strictly increasing.
    """
    runs: list[tuple[int, int]] = []
    if not ids:
        return runs
    # Most batches are one run (segments): compare in C before walking the list in Python.
    if ids[-1] - ids[0] + 1 == len(ids) and ids == list(range(ids[0], ids[0] + len(ids))):
        return [(ids[0], ids[-1])]
    first = prev = ids[0]
    for value in ids[1:]:
        if value == prev + 1:
            prev = value
            continue
        if value <= prev:
            raise ValueError(f"IDs not strictly increasing: {prev} then {value}")
        runs.append((first, prev))
        first = prev = value
    runs.append((first, prev))
    return runs


def _check_runs(runs: Sequence[tuple[int, int]], count: int) -> str:
    """The problem with a batch's runs, or an empty string."""
    total = 0
    prev_last = 0
    for first, last in runs:
        if not 0 < first <= last <= MAX_ID:
            return f"bad range [{first}, {last}]"
        if first <= prev_last:
            return f"ranges out of order or overlapping at [{first}, {last}]"
        prev_last = last
        total += last - first + 1
    if total != count:
        return f"{total} IDs instead of {count}"
    return ""


def check_reply(
    data: bytes,
    headers: dict[str, str] | None,
    *,
    tag: str,
    count: int,
    fmt: Literal["ids", "ranges"],
    nats: bool = True,
) -> Checked:
    """Check one reply against the request it answers.

    A good reply names the tag, has exactly one of ``ids`` or ``ranges`` (the one asked for) holding
    ``count`` positive, strictly increasing 63-bit IDs, and no NATS service error header. An error reply
    has an ``error`` with a code, and the ``Nats-Service-Error-Code`` header.
    """
    try:
        reply = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        return Checked("malformed", reason=f"undecodable: {exc}: {data[:200]!r}")
    if reply.tag != tag:
        return Checked("malformed", reason=f"tag {reply.tag!r} in a reply for {tag!r}")
    status = (headers or {}).get("Nats-Service-Error-Code")
    if reply.error is not None:
        return _check_error_reply(
            reply.error,
            carries_ids=reply.ids is not None or reply.ranges is not None,
            status=status,
            nats=nats,
        )
    if status is not None:
        return Checked("malformed", reason=f"IDs with an error header {status}")
    if fmt == "ids":
        if reply.ids is None or reply.ranges is not None:
            return Checked("malformed", reason="asked for ids, got something else")
        try:
            runs = runs_of(reply.ids)
        except ValueError as exc:
            return Checked("malformed", reason=str(exc))
    else:
        if reply.ranges is None or reply.ids is not None:
            return Checked("malformed", reason="asked for ranges, got something else")
        runs = [(first, last) for first, last in reply.ranges]
    problem = _check_runs(runs, count)
    if problem:
        return Checked("malformed", reason=problem)
    return Checked("ids", runs=tuple(runs))


def _check_error_reply(error: ErrorBody, *, carries_ids: bool, status: str | None, nats: bool) -> Checked:
    """:func:`check_reply` of an error reply: a code, no IDs, and (over NATS) the service error header."""
    if carries_ids:
        return Checked("malformed", reason="an error reply that also carries IDs")
    problems = []
    if not error.code:
        problems.append("no error code")
    if status is None and nats:  # Kafka replies carry the error in the body only
        problems.append("no Nats-Service-Error-Code header")
    return Checked(
        "error", code=error.code, retryable=error.retryable, status=status, reason="; ".join(problems)
    )


@dataclass(frozen=True, slots=True)
class Overlaps:
    """Duplicates found in a :class:`RangeSet`.

    Attributes:
        ids: IDs received more than once (an ID received three times counts twice).
        examples: A few overlapping pairs of runs, ``((first, last), (first, last))``.
    """

    ids: int
    examples: tuple[tuple[tuple[int, int], tuple[int, int]], ...]


@dataclass(slots=True)
class RangeSet:
    """IDs of one namespace (a segment tag, or all snowflake IDs) kept as runs, duplicates allowed."""

    firsts: array[int] = field(default_factory=lambda: array("q"))
    lasts: array[int] = field(default_factory=lambda: array("q"))
    ids: int = 0
    """IDs added, duplicates included."""

    def add(self, runs: Iterable[tuple[int, int]]) -> None:
        """Add inclusive runs (each ``first <= last``)."""
        for first, last in runs:
            self.firsts.append(first)
            self.lasts.append(last)
            self.ids += last - first + 1

    @property
    def runs(self) -> int:
        """How many runs are kept."""
        return len(self.firsts)

    def overlaps(self, max_examples: int = 5) -> Overlaps:
        """Sort the runs by first ID and count the IDs covered more than once."""
        firsts, lasts = self.firsts, self.lasts
        order = sorted(range(len(firsts)), key=firsts.__getitem__)
        duplicates = 0
        examples: list[tuple[tuple[int, int], tuple[int, int]]] = []
        reach = -1  # highest ID covered by the runs so far
        reach_run = (0, 0)
        for index in order:
            first, last = firsts[index], lasts[index]
            if first <= reach:
                duplicates += min(last, reach) - first + 1
                if len(examples) < max_examples:
                    examples.append((reach_run, (first, last)))
            if last > reach:
                reach = last
                reach_run = (first, last)
        return Overlaps(duplicates, tuple(examples))
