"""Readiness of a running worker (``/readyz``: does it answer requests?) and whether it can issue IDs now.

The decision and its reasons per transport: ``docs/operations.md`` ("Probes") and ``docs/kubernetes.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from dispenser.config import Config
from dispenser.core.errors import Unavailable

__all__ = ["RunningWorker", "cannot_issue", "not_ready"]


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
    """What readiness reads of a worker: ``Worker.probed`` (a part that is off is ``None`` there).

    Not the :class:`dispenser.app.Worker` itself: its accessors raise ``PartOff`` for a part that is off.
    """

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


_STOPPED = "starting, or stopping"


def not_ready(worker: RunningWorker) -> list[str]:
    """Why ``worker`` should not be sent requests now; empty: route to it (``/readyz``).

    Ready means the worker answers every request that reaches it, with IDs or with a coded error:
    started and not stopping (a load balancer stops sending requests as soon as the drain begins); NATS
    connected (when it serves on NATS: a disconnected worker answers no NATS request); and every ID source
    reached once since the start (segments: PostgreSQL's pool opened; snowflake: the worker ID, which
    ``start()`` waits for), so that a pod that never could issue (a wrong DSN) stops a rollout.

    A source lost *after* that does not make it unready: it answers ``unavailable`` or ``lease_lost``
    (retryable), which a caller retries, while an outage of a shared dependency would turn every worker
    unready at once and leave HTTP callers with the load balancer's refusal. That state is
    :func:`cannot_issue`'s. Kafka is not looked at: its clients reconnect by themselves and the requests
    wait in the topic meanwhile.
    """
    config = worker.config
    if not worker.started:
        return [_STOPPED]
    reasons = []
    if config.nats.enabled and (worker.serve or config.snowflake.enabled):
        nc = worker.nc
        if nc is None or not nc.is_connected:
            reasons.append("NATS is not connected")
    if config.segment.enabled:
        store = worker.postgres
        if store is None or not store.connected:
            reasons.append(
                "PostgreSQL has not been reached since the worker started: it has never issued segment IDs"
            )
    return reasons


def cannot_issue(worker: RunningWorker) -> list[str]:
    """Which ID kinds ``worker`` cannot hand out now, and why; empty: it can issue every kind it serves.

    Segments: PostgreSQL cannot be reached (the pool not open, or a tag's fetch failing with
    ``unavailable``) and no tag has IDs buffered to serve from meanwhile. Snowflake: the worker ID is not
    held (registering, or the lease was lost). A worker in this state is still ready (:func:`not_ready`):
    it answers with coded, retryable errors.
    """
    config = worker.config
    if not worker.started:
        return [_STOPPED]
    reasons = []
    if config.segment.enabled:
        allocator, store = worker.allocator, worker.postgres
        tags = list(allocator.tags.values()) if allocator is not None else []
        failing = any(isinstance(tag.last_error, Unavailable) for tag in tags)
        reachable = store is not None and store.connected and not failing
        if not reachable and not any(tag.buffer.remaining > 0 for tag in tags):
            reasons.append("segment: PostgreSQL cannot be reached and no segment IDs are buffered")
    if config.snowflake.enabled:
        snowflake = worker.snowflake
        if snowflake is None or not snowflake.holds_lease:
            reasons.append("snowflake: the worker ID is not held (registering, or the lease was lost)")
    return reasons
