"""Who may take which IDs over HTTP, and how many: ``http.callers`` and the per-caller ID budget.

NATS has subject permissions (docs/security.md); Leaf's HTTP API had nothing, and ``http.port`` bypassed
them. With ``[[http.callers]]`` set, every ID request must carry ``Authorization: Bearer <token>`` of a known
caller, whose entry names the tags (shell patterns) and kinds it may take. Whether or not callers are set,
each caller (its entry's name, or its address when the API is open) has an ID budget: ``ids_per_second``
sustained, bursts up to ``ids_burst`` (:class:`~dispenser.core.budget.IdBudget`), so that one caller cannot
burn a tag's ID space for everyone.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from dispenser.config import ConfigError, HttpCaller, HttpConfig
from dispenser.core.budget import IdBudget
from dispenser.core.errors import DispenserError, Forbidden, OverBudget, Unauthorized

__all__ = ["Caller", "HttpAccess"]

_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True, slots=True)
class Caller:
    """A known HTTP caller: what it may take, and its budget."""

    name: str
    tags: re.Pattern[str]
    """Its tag patterns, compiled into one expression."""
    kinds: frozenset[str]
    budget: IdBudget


def _token_digest(caller: HttpCaller) -> str:
    """The SHA-256 (hex) of a caller's token, from ``token_file`` or ``token_sha256``."""
    if (caller.token_file is None) == (caller.token_sha256 is None):
        raise ConfigError(f"[[http.callers]] {caller.name!r}: set exactly one of token_file and token_sha256")
    if caller.token_sha256 is not None:
        if not _SHA256_HEX.fullmatch(caller.token_sha256):
            raise ConfigError(f"[[http.callers]] {caller.name!r}: token_sha256 is not 64 hex digits")
        return caller.token_sha256.lower()
    assert caller.token_file is not None
    try:
        token = Path(caller.token_file).read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"[[http.callers]] {caller.name!r}: cannot read token_file {caller.token_file}: {exc.strerror}"
        ) from exc
    if len(token) < 16:
        raise ConfigError(
            f"[[http.callers]] {caller.name!r}: the token in {caller.token_file} is under 16 characters"
        )
    return hashlib.sha256(token.encode()).hexdigest()


class HttpAccess:
    """Checks an HTTP ID request against ``http.callers`` and the caller's budget.

    Args:
        callers: by the SHA-256 (hex) of their token; empty: the API is open and callers are told apart
            by their address.
        budget: the budget of callers known by their address (an open API).
        clock: monotonic seconds, for the budgets.
    """

    __slots__ = ("_by_digest", "_clock", "anonymous_budget", "open")

    def __init__(
        self, callers: dict[str, Caller], budget: IdBudget, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._by_digest = callers
        self.anonymous_budget = budget
        self._clock = clock
        self.open = not callers
        """No callers configured: no token is asked for."""

    @classmethod
    def from_config(cls, http: HttpConfig, clock: Callable[[], float] = time.monotonic) -> HttpAccess:
        """Build from ``[http]``, reading the callers' token files.

        Raises:
            ConfigError: a caller has no token, both, an unreadable or short one, or shares another's.
        """
        callers: dict[str, Caller] = {}
        for entry in http.callers:
            digest = _token_digest(entry)
            if digest in callers:
                raise ConfigError(
                    f"[[http.callers]] {entry.name!r} has the same token as {callers[digest].name!r}"
                )
            rate = entry.ids_per_second or http.ids_per_second
            burst = entry.ids_burst or http.ids_burst
            callers[digest] = Caller(
                entry.name,
                re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in entry.tags) or "(?!)"),
                frozenset(entry.kinds),
                IdBudget(rate, burst, max_callers=1),
            )
        return cls(callers, IdBudget(http.ids_per_second, http.ids_burst), clock)

    def identify(self, request: web.BaseRequest, kind: str, tag: str) -> Caller | DispenserError | None:
        """The known caller allowed ``kind`` IDs of ``tag``, or the error to answer; ``None``: open API."""
        if self.open:
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return Unauthorized()
        caller = self._by_digest.get(hashlib.sha256(token.strip().encode()).hexdigest())
        if caller is None:
            return Unauthorized()
        if kind not in caller.kinds or caller.tags.fullmatch(tag) is None:
            return Forbidden(caller.name, kind, tag)
        return caller

    def spend(self, request: web.BaseRequest, caller: Caller | None, count: int) -> OverBudget | None:
        """Take ``count`` IDs from the caller's budget; the error to answer when it has not that many left."""
        if caller is None:
            budget, name = self.anonymous_budget, request.remote or "?"
        else:
            budget, name = caller.budget, caller.name
        wait = budget.charge(name, count, self._clock())
        if wait == 0.0:
            return None
        return OverBudget(name, count, budget.rate, budget.burst, wait)

    def names(self) -> Sequence[str]:
        """The known callers' names (for the start-up log)."""
        return [caller.name for caller in self._by_digest.values()]
