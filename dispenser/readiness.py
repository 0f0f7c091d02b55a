"""Readiness of a running worker (``/readyz``): can it answer requests now?"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from dispenser.config import Config
from dispenser.core.errors import Unavailable

__all__ = ["RunningWorker", "not_ready"]


class _Connected(Protocol):
    @property
    def is_connected(self) -> bool: ...


class _Buffer(Protocol):
    @property
    def remaining(self) -> int: ...


class _Tag(Protocol):
    @property
    def buffer(self) -> _Buffer: ...

    @property
    def last_error(self) -> object: ...


class _Allocator(Protocol):
    @property
    def tags(self) -> Mapping[str, _Tag]: ...


class _Store(Protocol):
    @property
    def connected(self) -> bool: ...


class _Snowflake(Protocol):
    @property
    def holds_lease(self) -> bool: ...


class RunningWorker(Protocol):
    """What readiness reads of a worker (:class:`dispenser.app.Worker` has it all)."""

    @property
    def config(self) -> Config:
        """Its configuration."""
        ...

    @property
    def started(self) -> bool:
        """Whether it has started and is not stopping."""
        ...

    @property
    def serve(self) -> bool:
        """Whether it serves requests (false: ``dispenser enrich``, NATS only for the snowflake clock check)."""
        ...

    @property
    def nc(self) -> _Connected | None:
        """Its NATS connection, if NATS is on."""
        ...

    @property
    def postgres(self) -> _Store | None:
        """Its PostgreSQL pool, if it has one."""
        ...

    @property
    def allocator(self) -> _Allocator | None:
        """Its segment allocator, if segments are on."""
        ...

    @property
    def snowflake(self) -> _Snowflake | None:
        """Its snowflake generator, if snowflake is on."""
        ...


def not_ready(worker: RunningWorker) -> list[str]:
    """Why ``worker`` cannot answer requests now; empty: it can (``/readyz``).

    Ready means: started and not stopping (a load balancer stops sending requests as soon as the drain
    begins); NATS connected (when ``nats.enabled``); for segments, PostgreSQL reachable or IDs buffered
    to serve from meanwhile (a worker that rides out a database outage on its buffers is still ready); for
    snowflake, the worker ID held. Kafka is not looked at: its clients reconnect by themselves and the
    requests wait in the topic meanwhile.
    """
    config = worker.config
    if not worker.started:
        return ["starting, or stopping"]
    reasons = []
    if config.nats.enabled and (worker.serve or config.snowflake.enabled):
        nc = worker.nc
        if nc is None or not nc.is_connected:
            reasons.append("NATS is not connected")
    if config.segment.enabled:
        allocator, store = worker.allocator, worker.postgres
        tags = list(allocator.tags.values()) if allocator is not None else []
        failing = any(isinstance(tag.last_error, Unavailable) for tag in tags)
        reachable = store is not None and store.connected and not failing
        if not reachable and not any(tag.buffer.remaining > 0 for tag in tags):
            reasons.append("PostgreSQL cannot be reached and no segment IDs are buffered")
    if config.snowflake.enabled:
        snowflake = worker.snowflake
        if snowflake is None or not snowflake.holds_lease:
            reasons.append("the snowflake worker ID is not held (registering, or the lease was lost)")
    return reasons
