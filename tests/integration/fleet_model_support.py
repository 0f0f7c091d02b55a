"""The fleet model's machinery: real segment stores with grant memory against the kit's PostgreSQL.

:class:`FleetModel` (a Hypothesis ``RuleBasedStateMachine``) drives in-process workers (a
:class:`~dispenser.adapters.postgres.segments.PostgresSegmentStore` with a
:class:`~dispenser.adapters.local.grants.GrantFile` each, as ``dispenser serve`` builds them), the operator's
``tag add`` / ``tag remove`` (the store's admin API, which the CLI calls), a remove held open in another
session, and snapshots and restores of the database; every segment granted goes into the soak's ledger
(:class:`soak.ledger.RangeSet`), and no ID may be granted twice. ``docs/testing.md`` ("The fleet model")
says what it covers and under which configuration.

Written against the store API of 120423e too (``connect(dsn, grants=…)``, ``next_segment``, ``add_tag``,
``remove_tag``), so that the same file can be run on an older checkout to see what it finds there.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import uvloop
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from dispenser.adapters.local.grants import GrantFile
from dispenser.adapters.postgres.schema import migrate
from dispenser.adapters.postgres.segments import PostgresSegmentStore
from dispenser.core.errors import StoreUnavailable, TagExists, TagStartTooLow, UnknownTag
from dispenser.core.residue import LEAF, Residue
from dispenser_lab.servers import PostgresServer
from dispenser_lab.soak.ledger import RangeSet

__all__ = ["RULES", "TAGS", "FleetEnv", "FleetModel", "Worker", "drop_databases", "prepare_databases"]

_T = TypeVar("_T")

TAGS: dict[str, tuple[int, Residue, Residue]] = {
    # tag: (configured step, its class in database A, its class in database B: None if B has no such tag)
    "a": (10, LEAF, LEAF),
    "r": (5, Residue(2, 0), Residue(2, 1)),
}
"""The tags of the model: Leaf's ``a`` in database A only, ``r`` in both (2:0 in A, 2:1 in B)."""

_IN_B = ("r",)

RULES = frozenset({"workers", "tags", "held", "snapshots", "residues"})
"""Rule groups; ``DISPENSER_FLEET_MODEL_RULES`` (comma-separated) narrows a run to some of them."""

MAX_WORKERS = 3
MAX_SNAPSHOTS = 3
_RETRIES = 20  # a fetch or admin call after a restore meets dead pooled connections first: each is dropped


@dataclass
class FleetEnv:
    """What every history of one test shares: the server, databases A and B, a scratch directory.

    The two databases are made once (:func:`prepare_databases`) and emptied in place before each history
    (:meth:`FleetModel.reset`): a ``CREATE DATABASE`` per history would cost more than the history.
    """

    server: PostgresServer
    root: Path
    prefix: str
    numbers: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def db_a(self) -> str:
        return f"{self.prefix}_a"

    @property
    def template(self) -> str:
        """A migrated, empty database: what a restore starts from."""
        return f"{self.prefix}_t"

    @property
    def db_b(self) -> str:
        return f"{self.prefix}_b"


async def prepare_databases(env: FleetEnv) -> None:
    """Create the two migrated databases of the model (once per test)."""
    for name in (env.db_a, env.db_b, env.template):
        env.server.drop_database(name)
        await migrate(env.server.create_database(name))


def drop_databases(env: FleetEnv) -> None:
    """Drop what :func:`prepare_databases` and the restores made."""
    for name in [env.db_a, env.db_b, env.template, f"{env.db_a}_r"]:
        env.server.drop_database(name)


@dataclass
class Worker:
    """One in-process worker: its grant memory (a slot of the shared state directory) and its store."""

    name: str
    grants: GrantFile
    store: PostgresSegmentStore

    def __repr__(self) -> str:
        return self.name


_TABLES = ("leaf_alloc", "dispenser_removed_tag", "dispenser_tag_residue")
"""What a snapshot keeps: every table a fetch, an add or a remove reads or writes."""


@dataclass(frozen=True)
class Snapshot:
    """Database A's tables as they were at one moment, and each tag's high water then (row or tombstone)."""

    name: str
    tables: dict[str, tuple[list[str], list[tuple[Any, ...]]]]
    """Table → (columns, rows)."""
    high_water: dict[str, int]

    def __repr__(self) -> str:
        return self.name


@dataclass
class Grant:
    """A segment handed to a worker (its IDs counted as handed out, all of them)."""

    step: int
    who: str
    tag: str
    runs: tuple[tuple[int, int], ...]

    def __str__(self) -> str:
        first, last = self.runs[0][0], self.runs[-1][1]
        return f"step {self.step}: {self.who} got {self.tag} [{first}, {last}] ({len(self.runs)} runs)"


class Ledger:
    """Every ID granted, per tag, in the soak's :class:`~soak.ledger.RangeSet`: none may come twice."""

    def __init__(self) -> None:
        self.ids: dict[str, RangeSet] = {}
        self.grants: list[Grant] = []

    def add(self, grant: Grant) -> None:
        self.ids.setdefault(grant.tag, RangeSet()).add(grant.runs)
        self.grants.append(grant)

    def check(self) -> None:
        """Raise naming the two grants that overlap, if any.

        Raises:
            AssertionError: some ID was granted twice.
        """
        for tag, ids in self.ids.items():
            overlaps = ids.overlaps()
            if overlaps.ids:
                (one, two), *_ = overlaps.examples
                named = [str(g) for g in self.grants if g.tag == tag and _meets(g, one, two)]
                raise AssertionError(
                    f"{overlaps.ids} IDs of {tag!r} granted twice, e.g. {one} and {two}:\n  "
                    + "\n  ".join(named)
                )


def _meets(grant: Grant, *runs: tuple[int, int]) -> bool:
    return any(low <= last and first <= high for low, high in grant.runs for first, last in runs)


def _runs(residue: Residue, first: int, last: int) -> tuple[tuple[int, int], ...]:
    if residue.plain:
        return ((first, last),)
    return tuple((i, i) for i in residue.ids((first, last)))


def _enabled() -> frozenset[str]:
    raw = os.environ.get("DISPENSER_FLEET_MODEL_RULES", "")
    chosen = frozenset(part.strip() for part in raw.split(",") if part.strip())
    unknown = chosen - RULES
    if unknown:
        raise ValueError(
            f"DISPENSER_FLEET_MODEL_RULES: unknown rule groups {sorted(unknown)}; known: {sorted(RULES)}"
        )
    return chosen or RULES


def _on(group: str) -> Callable[[FleetModel], bool]:
    return lambda self: group in self.enabled


_STARTS = st.sampled_from(["one", "below", "at", "above"])
"""Where a re-added tag starts: 1, below what was granted, just above it, well above it."""


class FleetModel(RuleBasedStateMachine):
    """Workers, operators and restores against one PostgreSQL; invariant: no ID granted twice.

    Configuration modelled (docs/testing.md): every worker of database A keeps its grants in one shared
    state directory (a slot each, as workers on one host), ``new_primary_grace`` 0 (no failover here), a pool
    of 1 to 2 connections (``postgres.pool_min`` is 1, as by default). A restore is played only when the grants above the snapshot are still remembered
    somewhere (a file of the directory): one that rolls back below a grant whose memory was lost is outside
    the promise (docs/ha.md, "What it cannot cover") and is skipped.
    """

    workers = Bundle("workers")
    snapshots = Bundle("snapshots")

    def __init__(self, env: FleetEnv) -> None:
        super().__init__()
        self.env = env
        self.enabled = _enabled()
        self.loop = uvloop.new_event_loop()
        number = next(env.numbers)
        self.number = number
        self.db_a = env.db_a
        self.db_b = env.db_b
        self.dsn_a = env.server.dsn_for(self.db_a)
        self.dsn_b = env.server.dsn_for(self.db_b)
        self.state = env.root / f"m{number}" / "state"
        self.state_b = env.root / f"m{number}" / "state-b"
        self.ledger = Ledger()
        self.steps = 0
        self.running: dict[str, Worker] = {}
        self.names = itertools.count(1)
        self.memory: dict[Path, dict[str, int]] = {}
        """Per grant file: tag → the highest ID it remembers granted in A, plus one (the model's view)."""
        self.top: dict[str, int] = {}
        """Tag → the highest ID granted in A, plus one."""
        self.snapshot_names: list[str] = []
        self.root: asyncpg.Connection[Any] | None = None
        self.admin: PostgresSegmentStore | None = None
        self.worker_b: Worker | None = None
        self.notes: list[str] = []

    # --- plumbing --------------------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run one step's work on this machine's own event loop."""
        return self.loop.run_until_complete(coro)

    async def _root(self) -> asyncpg.Connection[Any]:
        if self.root is None or self.root.is_closed():
            self.root = await asyncpg.connect(self.env.server.dsn)
        return self.root

    async def _retrying(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """``call()``, again while it finds the store unavailable (dead connections after a restore)."""
        for attempt in itertools.count(1):
            try:
                return await call()
            except StoreUnavailable:
                if attempt >= _RETRIES:
                    raise
                await asyncio.sleep(0.01)  # the pool drops the dead connection; the next attempt opens one
        raise AssertionError("unreachable")

    async def _admin(self) -> PostgresSegmentStore:
        if self.admin is None:
            self.admin = await PostgresSegmentStore.connect(self.dsn_a, min_size=1, max_size=1)
        return self.admin

    def _note(self, text: str) -> None:
        self.notes.append(f"step {self.steps}: {text}")

    # --- set-up and teardown ---------------------------------------------------------------------------

    @initialize(target=workers)
    def reset(self) -> MultipleResults[Worker]:
        """Databases A and B emptied and their tags added again; two workers of A running, one of B."""
        return multiple(*self.run(self._reset()))

    async def _reset(self) -> list[Worker]:
        for dsn, in_b in ((self.dsn_a, False), (self.dsn_b, True)):
            conn = await asyncpg.connect(dsn)
            try:
                # Triggers off for this session only: no tombstone is kept for the last history's tags.
                await conn.execute("SET session_replication_role = replica")
                await conn.execute("TRUNCATE leaf_alloc, dispenser_removed_tag, dispenser_tag_residue")
            finally:
                await conn.close()
            async with await PostgresSegmentStore.connect(dsn, min_size=1, max_size=1) as store:
                for tag, (step, in_a_class, in_b_class) in TAGS.items():
                    if not in_b or tag in _IN_B:
                        await store.add_tag(tag, step, residue=in_b_class if in_b else in_a_class)
        self.state.mkdir(parents=True)
        grants = GrantFile.open(self.state_b)
        store = await PostgresSegmentStore.connect(self.dsn_b, grants=grants, min_size=1, max_size=2)
        self.worker_b = Worker("wb", grants, store)
        return [await self._start(), await self._start()]

    def teardown(self) -> None:
        try:
            self.run(self._teardown())
        finally:
            self.loop.close()
            shutil.rmtree(self.state.parent, ignore_errors=True)

    async def _teardown(self) -> None:
        for worker in [*self.running.values(), *([self.worker_b] if self.worker_b else [])]:
            await worker.store.close()
            worker.grants.close()
        if self.admin is not None:
            await self.admin.close()
        if self.root is not None:
            await self.root.close()

    # --- invariant -------------------------------------------------------------------------------------

    @invariant()
    def no_id_twice(self) -> None:
        """The soak's ledger: no ID granted twice, across workers, restarts, re-adds and restores."""
        self.steps += 1
        try:
            self.ledger.check()
        except AssertionError as exc:
            if not self.notes:
                raise
            raise AssertionError(f"{exc}\nnotes of the history:\n  " + "\n  ".join(self.notes)) from None

    # --- workers ---------------------------------------------------------------------------------------

    @precondition(lambda self: "workers" in self.enabled and len(self.running) < MAX_WORKERS)
    @rule(target=workers)
    def start(self) -> Worker:
        """A worker starts: it takes the first free slot of the state directory (a kept one if any)."""
        return self.run(self._start())

    async def _start(self) -> Worker:
        grants = GrantFile.open(self.state)
        store = await self._retrying(
            lambda: PostgresSegmentStore.connect(self.dsn_a, grants=grants, min_size=1, max_size=2)
        )
        assert grants.path is not None
        self.memory.setdefault(grants.path, {})
        worker = Worker(f"w{next(self.names)}", grants, store)
        self.running[worker.name] = worker
        return worker

    @precondition(_on("workers"))
    @rule(worker=consumes(workers), keep=st.booleans())
    def stop(self, worker: Worker, keep: bool) -> None:
        """A worker stops; with ``keep=False`` its grant file is lost with it (a disk, a volume)."""
        self.running.pop(worker.name)
        self.run(worker.store.close())
        worker.grants.close()
        if not keep:
            assert worker.grants.path is not None
            worker.grants.path.unlink(missing_ok=True)
            self.memory[worker.grants.path] = {}

    @precondition(_on("workers"))
    @rule(
        worker=workers,
        tag=st.sampled_from(sorted(TAGS)),
        step=st.sampled_from([None, 3, 20]),
        times=st.integers(1, 3),
    )
    def fetch(self, worker: Worker, tag: str, step: int | None, times: int) -> None:
        """A worker fetches ``times`` segments of ``tag`` (of the configured step, or an adaptive one)."""
        for _ in range(times):
            self._fetch(worker, tag, step)

    @precondition(lambda self: "workers" in self.enabled and bool(self.running))
    @rule()
    def traffic(self) -> None:
        """Every running worker fetches a segment of every tag (a busy moment of the whole fleet)."""
        for worker in list(self.running.values()):
            for tag in sorted(TAGS):
                self._fetch(worker, tag, None)

    def _fetch(self, worker: Worker, tag: str, step: int | None) -> None:
        try:
            allocation = self.run(self._retrying(lambda: worker.store.next_segment(tag, step)))
        except UnknownTag:
            return
        segment = allocation.segment
        runs = _runs(allocation.residue, segment.first, segment.last)
        self.ledger.add(Grant(self.steps, worker.name, tag, runs))
        end = runs[-1][1] + 1
        self.top[tag] = max(self.top.get(tag, 1), end)
        assert worker.grants.path is not None
        known = self.memory.setdefault(worker.grants.path, {})
        known[tag] = max(known.get(tag, 1), end)

    @precondition(_on("residues"))
    @rule(step=st.sampled_from([None, 3, 20]))
    def fetch_in_b(self, step: int | None) -> None:
        """The worker of database B fetches tag r (its class 2:1; A's is 2:0): never one of A's IDs."""
        worker = self.worker_b
        assert worker is not None
        allocation = self.run(self._retrying(lambda: worker.store.next_segment("r", step)))
        segment = allocation.segment
        self.ledger.add(Grant(self.steps, "wb", "r", _runs(allocation.residue, segment.first, segment.last)))

    # --- the operator ----------------------------------------------------------------------------------

    def _start_of(self, tag: str, kind: str) -> int:
        top = self.top.get(tag, 1)
        return {"one": 1, "below": max(1, top - 7), "at": top, "above": top + 50}[kind]

    @precondition(_on("tags"))
    @rule(tag=st.sampled_from(sorted(TAGS)))
    def remove(self, tag: str) -> None:
        """``dispenser tag remove``."""
        with contextlib.suppress(UnknownTag):
            self.run(self._retrying(lambda: self._remove(tag)))

    async def _remove(self, tag: str) -> None:
        await (await self._admin()).remove_tag(tag)

    @precondition(_on("tags"))
    @rule(tag=st.sampled_from(sorted(TAGS)), start=_STARTS)
    def add(self, tag: str, start: str) -> None:
        """``dispenser tag add --start``: refused if the tag exists or the start is below its high water."""
        first = self._start_of(tag, start)
        with contextlib.suppress(TagExists, TagStartTooLow):
            self.run(self._retrying(lambda: self._add(tag, first)))

    async def _add(self, tag: str, start: int) -> None:
        step, residue, _ = TAGS[tag]
        await (await self._admin()).add_tag(tag, step, start, residue=residue)

    @precondition(_on("held"))
    @rule(tag=st.sampled_from(sorted(TAGS)), start=_STARTS, commit=st.booleans())
    def add_behind_an_open_remove(self, tag: str, start: str, commit: bool) -> None:
        """psql: ``DELETE`` of the tag left uncommitted; ``tag add --start`` meanwhile; then commit (or roll back)."""
        first = self._start_of(tag, start)
        with contextlib.suppress(TagExists, TagStartTooLow):
            self.run(self._add_behind_an_open_remove(tag, first, commit))

    async def add_behind_an_open_remove_raw(self, tag: str, start: int, *, commit: bool) -> None:
        """The rule's work without its tolerance of refusals: ``tag add --start start`` behind a held remove."""
        await self._add_behind_an_open_remove(tag, start, commit)

    async def _add_behind_an_open_remove(self, tag: str, start: int, commit: bool) -> None:
        admin = await self._retrying(self._connected_admin)
        session = await asyncpg.connect(self.dsn_a)
        try:
            transaction = session.transaction()
            await transaction.start()
            try:
                deleted = await session.execute("DELETE FROM leaf_alloc WHERE biz_tag = $1", tag)
                add = asyncio.ensure_future(self._add_on(admin, tag, start))
                if deleted == "DELETE 1":
                    await self._until_blocked(add)
            finally:
                if commit:
                    await transaction.commit()
                else:
                    await transaction.rollback()
            await add
        finally:
            await session.close()

    async def _connected_admin(self) -> PostgresSegmentStore:
        admin = await self._admin()
        await admin.list_tags()  # a live connection now, so the add below does not meet a dead one
        return admin

    @staticmethod
    async def _add_on(admin: PostgresSegmentStore, tag: str, start: int) -> None:
        step, residue, _ = TAGS[tag]
        await admin.add_tag(tag, step, start, residue=residue)

    async def _until_blocked(self, add: asyncio.Future[None]) -> None:
        """Return once the add waits for a lock in database A (or is done): the race's window is open."""
        root = await self._root()
        for _ in range(500):
            if add.done():
                return
            waiting = await root.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'",
                self.db_a,
            )
            if waiting:
                return
            await asyncio.sleep(0.01)  # polling pg_stat_activity, bounded at 5 s by the loop
        raise AssertionError("the tag add neither waited for the open remove nor finished within 5 s")

    # --- snapshots and restores ------------------------------------------------------------------------

    @precondition(lambda self: "snapshots" in self.enabled and len(self.snapshot_names) < MAX_SNAPSHOTS)
    @rule(target=snapshots)
    def snapshot(self) -> Snapshot:
        """A snapshot of database A, taken while the workers stay connected (as a volume snapshot is)."""
        return self.run(self._snapshot())

    async def _snapshot(self) -> Snapshot:
        name = f"snapshot{len(self.snapshot_names) + 1}"
        self.snapshot_names.append(name)
        conn = await asyncpg.connect(self.dsn_a)
        try:
            async with conn.transaction(isolation="repeatable_read", readonly=True):  # one moment of A
                tables: dict[str, tuple[list[str], list[tuple[Any, ...]]]] = {}
                for table in _TABLES:
                    rows = await conn.fetch(f"SELECT * FROM {table}")
                    tables[table] = (list(rows[0].keys()) if rows else [], [tuple(row) for row in rows])
                high = await conn.fetch(
                    "SELECT biz_tag, max(max_id) AS high FROM (SELECT biz_tag, max_id FROM leaf_alloc "
                    "UNION ALL SELECT biz_tag, max_id FROM dispenser_removed_tag) AS t GROUP BY biz_tag"
                )
        finally:
            await conn.close()
        return Snapshot(name, tables, {row["biz_tag"]: row["high"] for row in high})

    @precondition(_on("snapshots"))
    @rule(snap=snapshots)
    def restore(self, snap: Snapshot) -> None:
        """Database A replaced by the snapshot, under its own name; every live worker reconnects (its heartbeat).

        Skipped (a note) when a grant above the snapshot is remembered nowhere any more: outside the promise.
        """
        remembered: dict[str, int] = {}
        for known in self.memory.values():
            for tag, end in known.items():
                remembered[tag] = max(remembered.get(tag, 1), end)
        lost = {
            tag: top
            for tag, top in self.top.items()
            if top > max(snap.high_water.get(tag, 1), remembered.get(tag, 1))
        }
        if lost:
            self._note(f"restore of {snap} skipped: grants of {sorted(lost)} above it remembered nowhere")
            return
        self.run(self._restore(snap))

    async def _restore(self, snap: Snapshot) -> None:
        """The snapshot's rows in a new database (a copy of the migrated template), renamed to A's name.

        The restored database appears whole, in the same cluster (system identifier and timeline kept, as a
        volume snapshot restored), and every session of the old one is cut.
        """
        root = await self._root()
        staged = f"{self.db_a}_r"
        await root.execute(f'DROP DATABASE IF EXISTS "{staged}" WITH (FORCE)')
        await root.execute(f'CREATE DATABASE "{staged}" TEMPLATE "{self.env.template}"')
        conn = await asyncpg.connect(self.env.server.dsn_for(staged))
        try:
            await conn.execute("SET session_replication_role = replica")  # rows as they were: no trigger
            for table, (columns, rows) in snap.tables.items():
                if rows:
                    await conn.copy_records_to_table(table, records=rows, columns=columns)
        finally:
            await conn.close()
        await root.execute(f'DROP DATABASE "{self.db_a}" WITH (FORCE)')
        await root.execute(f'ALTER DATABASE "{staged}" RENAME TO "{self.db_a}"')
        # Each live worker's heartbeat (every second) reaches the restored database on a new connection,
        # which repairs it from the remembered grants: played at once, so that a worker stopped (and its
        # grant file lost) right after the restore has had its heartbeat first, as docs/ha.md requires.
        for worker in self.running.values():
            await self._retrying(worker.store.list_tags)
