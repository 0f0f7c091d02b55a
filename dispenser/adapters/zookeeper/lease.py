"""Recyclable snowflake worker IDs from ZooKeeper (``zookeeper-lease``): an ephemeral claim per worker ID.

A holder proves its session every ``T/6`` and stops issuing at ``2/3 T`` after its last proof, before
ZooKeeper could expire the session and let anyone else claim the ID; a persistent high-water node per ID
keeps the next holder above the last millisecond issued. The layout and the argument: ``docs/snowflake.md``
("The ``zookeeper-lease`` mode").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from dispenser.adapters.zookeeper.registry import _SYSTEM_CLOCK, DEFAULT_ROOT, ZkRegistryBase, decode_node
from dispenser.adapters.zookeeper.session import NodeExists
from dispenser.core.errors import CoordinatorUnavailable, LeaseLost, WorkerIdsExhausted
from dispenser.ports import Clock, WorkerLease

__all__ = ["DEFAULT_SAFE_FRACTION", "ZooKeeperLeaseRegistry"]

log = logging.getLogger(__name__)

DEFAULT_SAFE_FRACTION = 2 / 3
"""Share of the session timeout after the last confirmation during which the holder may still issue."""

_KEEPALIVES_PER_TIMEOUT = 6
_RETRY_PAUSE = 0.1
"""Seconds between a failed confirmation and the next (each waits for a connection up to ``T/3``)."""


class _Claim(msgspec.Struct, kw_only=True):
    """What a lease node holds: who claimed it and when (for operators; nothing reads it back)."""

    address: str
    claimed_at: int


_claim_encoder = msgspec.json.Encoder()


class ZooKeeperLeaseRegistry(ZkRegistryBase):
    """:class:`~dispenser.ports.WorkerRegistry` in ``zookeeper-lease`` mode (see the module docstring).

    Args:
        hosts: ZooKeeper connection string, ``host:port[,host:port...]``.
        name: The registry namespace: nodes live under ``<root>/<name>/``.
        address: This worker's ``ip:port``, recorded in the nodes it writes (for operators).
        max_worker_id: The layout's largest worker ID; IDs ``0..max_worker_id`` are leased.
        root: Parent of the namespaces.
        session_timeout: Seconds asked for; the server's grant ``T`` sets the keepalive (``T/6``) and how
            long an unconfirmed lease may still issue (``safe_fraction * T``).
        connect_timeout: Seconds :meth:`register` may spend connecting.
        op_timeout: Seconds one ZooKeeper call in :meth:`register` or :meth:`report` may take.
        safe_fraction: Between 0 and 1; see the module docstring for why 2/3.
        clock: Its monotonic clock times the confirmations; its wall clock is recorded in the lease node.
        auth: Digest credentials ``user:password`` (see :class:`~dispenser.adapters.zookeeper.registry.ZkRegistryBase`).
        world_read: With ``auth``, let anyone read the registry's nodes.
    """

    mode = "zookeeper-lease"
    _HOME = "lease"

    def __init__(
        self,
        hosts: str,
        name: str,
        address: str,
        *,
        max_worker_id: int,
        root: str = DEFAULT_ROOT,
        session_timeout: float = 10.0,
        connect_timeout: float = 5.0,
        op_timeout: float = 5.0,
        safe_fraction: float = DEFAULT_SAFE_FRACTION,
        clock: Clock = _SYSTEM_CLOCK,
        auth: str | None = None,
        world_read: bool = True,
        datacenter: int | None = None,
    ) -> None:
        if not 0 < safe_fraction < 1:
            raise ValueError(f"safe_fraction must be between 0 and 1 (exclusive), got {safe_fraction}")
        super().__init__(
            hosts,
            name,
            address,
            max_worker_id=max_worker_id,
            root=root,
            session_timeout=session_timeout,
            connect_timeout=connect_timeout,
            op_timeout=op_timeout,
            clock=clock,
            auth=auth,
            world_read=world_read,
            datacenter=datacenter,
        )
        self.safe_fraction = safe_fraction
        self.lease_path = f"{self.base_path}/lease"
        self.high_water_path = f"{self.base_path}/high-water"
        self._keepalive: asyncio.Task[None] | None = None
        self._closing = False
        """Set by :meth:`close`: the keepalive loop ends by itself even if its cancellation was lost."""
        # The lease: the ID (self._worker_id), the session that created its node, the negotiated timeout
        # then, and the monotonic time before the last request that proved the node still ours.
        self._claim_session: int | None = None
        self._timeout = session_timeout
        self._confirmed_at = float("-inf")

    @property
    def session_timeout(self) -> float:
        """The negotiated session timeout ``T`` of the current lease, in seconds."""
        return self._timeout

    @property
    def issue_window(self) -> float:
        """Seconds after a confirmation during which the holder may issue: ``safe_fraction * T`` (granted T)."""
        return self.safe_fraction * self._timeout

    def issue_deadline(self) -> float:
        """The monotonic time at which :meth:`can_issue` turns false unless a confirmation arrives first."""
        return self._confirmed_at + self.safe_fraction * self._timeout

    def can_issue(self) -> bool:
        """True while the lease is held and was confirmed less than ``safe_fraction * T`` ago."""
        if self._worker_id is None or self._lost is not None:
            return False
        return self._clock.monotonic() < self.issue_deadline()

    async def register(self) -> WorkerLease:
        """Return the lease held now, claiming the lowest free worker ID if none is held.

        A lease still held (its node owned by this session) is confirmed and returned unchanged, with
        the current high water.

        Raises:
            WorkerIdsExhausted: every ID from 0 to ``max_worker_id`` is leased.
            CoordinatorUnavailable: ZooKeeper did not answer in time.
        """
        async with self._lock:
            await self._zk.open()
            if self._worker_id is not None and self._lost is None:
                try:
                    await self._confirm()
                except LeaseLost as exc:
                    self._lose(exc.worker_id, exc.detail, exc.logged_detail)
                else:
                    return await self._lease(self._worker_id)
            worker_id = await self._claim()
            self._start_keepalive()
            return await self._lease(worker_id)

    async def _claim(self) -> int:
        await self._zk.ensure_path(self.lease_path, shared=self.root_path)
        await self._zk.ensure_path(self.high_water_path, shared=self.root_path)
        for path in (self.base_path, self.lease_path, self.high_water_path):
            await self._zk.restrict(path)
        taken = {int(c) for c in await self._zk.children(self.lease_path) if c.isdigit()}
        claim = _claim_encoder.encode(_Claim(address=self.address, claimed_at=self._clock.wall_ms()))
        for worker_id in range(self.max_worker_id + 1):
            if worker_id in taken:
                continue
            path = f"{self.lease_path}/{worker_id}"
            sent = self._clock.monotonic()
            try:
                await self._zk.create(path, claim, ephemeral=True)
            except NodeExists:
                continue
            # Whose is it? The client may have replaced the session while the create was on its way.
            found = await self._zk.get(path)
            session = self._zk.session_id
            if found is None or session is None or found[1].ephemeral_owner != session:
                continue
            self._worker_id = worker_id
            self._claim_session = session
            self._timeout = self._zk.timeout
            self._confirmed_at = sent
            self._lost = None
            log.info(
                "%s: leased worker ID %d (session %#x, timeout %.1f s)",
                self,
                worker_id,
                session,
                self._timeout,
            )
            return worker_id
        raise WorkerIdsExhausted(self.max_worker_id + 1, self._where)

    async def _lease(self, worker_id: int) -> WorkerLease:
        await self._zk.restrict(f"{self.high_water_path}/{worker_id}")
        return WorkerLease(worker_id=worker_id, high_water_ms=await self._read_high_water(worker_id))

    async def _read_high_water(self, worker_id: int) -> int:
        path = f"{self.high_water_path}/{worker_id}"
        found = await self._zk.get(path)
        return 0 if found is None else decode_node(found[0], path).timestamp

    async def _confirm(self) -> None:
        """Prove the lease node is still owned by the claiming session; move ``confirmed`` forward.

        Raises:
            LeaseLost: the session was replaced, or the node is gone or someone else's.
            CoordinatorUnavailable: no answer in time (the lease may still be ours).
        """
        worker_id, claim_session = self._worker_id, self._claim_session
        if worker_id is None or claim_session is None:
            raise LeaseLost(-1 if worker_id is None else worker_id, "no lease was claimed")
        if self._zk.session_id != claim_session:
            raise LeaseLost(worker_id, "its ZooKeeper session expired")
        path = f"{self.lease_path}/{worker_id}"
        sent = self._clock.monotonic()
        found = await self._zk.get(path)
        if self._zk.session_id != claim_session:
            raise LeaseLost(worker_id, "its ZooKeeper session expired")
        if found is None:
            raise LeaseLost(worker_id, "its lease node is gone", logged=f"its lease node {path} is gone")
        if found[1].ephemeral_owner != claim_session:
            raise LeaseLost(
                worker_id,
                "its lease node belongs to another session",
                logged=f"its lease node {path} belongs to another session",
            )
        self._confirmed_at = max(self._confirmed_at, sent)

    def _start_keepalive(self) -> None:
        if self._keepalive is None or self._keepalive.done():
            self._keepalive = asyncio.create_task(
                self._keep_alive(), name=f"lease keepalive {self.lease_path}"
            )

    async def _keep_alive(self) -> None:
        # Not `while True`: on Python 3.11, asyncio.wait_for swallows a cancellation that arrives as the
        # awaited call completes, and close() would then wait for this task for ever (seen: a suite hung).
        every = pause = self._timeout / _KEEPALIVES_PER_TIMEOUT
        while not self._closing:
            await asyncio.sleep(pause)
            pause = every
            if self._worker_id is None or self._lost is not None:
                continue  # wait for register() to claim again
            try:
                # A later answer cannot confirm beyond the deadline anyway; don't let it queue up.
                await asyncio.wait_for(self._confirm(), self._timeout / 3)
            except LeaseLost as exc:
                self._lose(exc.worker_id, exc.detail, exc.logged_detail)
                log.warning("%s: %s", self, exc)
            except (CoordinatorUnavailable, TimeoutError) as exc:
                # Again soon, not in T/6: the connection dropped (the call waits for the next one), and the
                # first answer on the new one must come before the lease stops issuing. Measured in the
                # hang test: a session moved off a frozen server 3 s after it went silent, and the next
                # confirmation a second later came too late to keep the lease issuing.
                pause = _RETRY_PAUSE
                log.debug("%s: lease not confirmed: %s", self, exc)
            except Exception:
                # Unexpected, but the lease must keep being proved: the deadline stops issuing meanwhile.
                log.exception("%s: keepalive failed", self)

    async def report(self, high_water_ms: int) -> None:
        """Raise the ID's high-water node to ``high_water_ms`` (it only ever grows).

        The write happens even after the lease is lost: raising the mark is always safe.

        Raises:
            CoordinatorUnavailable: no lease claimed yet, or ZooKeeper did not answer in time.
            LeaseLost: the lease is lost; stop issuing and :meth:`register` again.
        """
        worker_id = self._worker_id
        if worker_id is None:
            raise CoordinatorUnavailable(
                "no worker ID leased (register() has not succeeded yet)",
                logged=f"{self}: no worker ID leased (register() has not succeeded yet)",
            )
        self._reported = max(self._reported, high_water_ms)
        await self._raise_timestamp(f"{self.high_water_path}/{worker_id}", self._reported, create=True)
        if self._lost is None and self._zk.session_id != self._claim_session:
            self._lose(worker_id, "its ZooKeeper session expired")
        if self._lost is not None:
            raise self._lost_error(worker_id)

    async def close(self) -> None:
        """Stop issuing, and release the lease by closing the session (the ID is free at once).

        Call :meth:`report` with the final high water first.
        """
        self._lose(self._worker_id or 0, "the registry was closed")
        self._closing = True
        task, self._keepalive = self._keepalive, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        async with self._lock:
            await self._zk.close()
