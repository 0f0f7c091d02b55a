"""Start and stop a group of servers (the members of a cluster) together, each still killable on its own."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, Self, TypeVar

from dispenser_lab.servers.process import DevServerError, ServerStartError
from dispenser_lab.servers.server import ServerProcess

__all__ = ["ServerGroup"]

_Member = TypeVar("_Member", bound=ServerProcess[Any])


class ServerGroup(Generic[_Member]):
    """Members started at once (a quorum forms only when enough of them run) and stopped together.

    Args:
        members: The servers, in the order their numbers give (member ``n`` is ``members[n - 1]``).
    """

    def __init__(self, members: Sequence[_Member]) -> None:
        self.members = list(members)

    def member(self, number: int) -> _Member:
        """Member ``number`` (1-based, as clusters number their nodes)."""
        return self.members[number - 1]

    @property
    def running(self) -> list[_Member]:
        """The members whose process is alive."""
        return [m for m in self.members if m.running]

    def start(self) -> None:
        """Start every member that is not running, concurrently, and wait until all are ready.

        Raises:
            ServerStartError: A member did not become ready (all members are stopped then); the message
                holds each failure.
        """
        self._each(lambda m: m.start(), [m for m in self.members if not m.running], stop_on_error=True)

    def stop(self) -> None:
        """Stop every member (concurrently; a member stops on its own timeout)."""
        self._each(lambda m: m.stop(), self.members, stop_on_error=False)

    def _each(
        self, action: Callable[[_Member], None], members: list[_Member], *, stop_on_error: bool
    ) -> None:
        if not members:
            return
        with ThreadPoolExecutor(max_workers=len(members)) as pool:
            futures = [pool.submit(action, m) for m in members]
        errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if not failed:
            return
        if stop_on_error:
            for member in self.members:
                with contextlib.suppress(DevServerError, OSError):
                    member.stop()
        first = failed[0]
        if isinstance(first, DevServerError) and len(failed) == 1:
            raise first
        raise ServerStartError("; ".join(f"{type(e).__name__}: {e}" for e in failed)) from first

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
