"""``dispenser bench alternatives``: the dispenser beside what a team would use instead, in one run.

The buffered client, a request per ID, PostgreSQL sequences, UUIDv7, ULID and an embedded snowflake, on
one machine in one process; then time order, restart gaps and key storage. What runs and what the figures
mean: ``docs/why.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import secrets
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import nats

from dispenser.client import BufferSettings, IdClient
from dispenser.core.snowflake import Issued, SnowflakeLayout, SnowflakeState
from dispenser.runner import run_async
from dispenser.tables import fmt_rate, render_table
from dispenser_lab.bench.nats_load import Child, serving_worker, wait_ready
from dispenser_lab.bench.nats_plan import BenchError
from dispenser_lab.bench.servers import bench_servers
from dispenser_lab.bench.stats import host_meta, percentile, write_json

__all__ = ["AltCase", "Holders", "Report", "StorageRow", "main", "render", "run"]

_BLOCK = 1000
"""Calls between two untimed yields to the event loop (as ``dispenser bench client`` does)."""

_ROUND_TRIP_BLOCK = 16
"""The same for calls that cross the network: a batch of 1,000 rows takes about a millisecond."""

_CONNECTIONS = 4
"""Connections (PostgreSQL) or requests in flight (NATS) in the concurrent cases."""

_BATCH = 1000


@dataclass(slots=True)
class AltCase:
    """One measured case."""

    name: str
    family: str
    """``timer``, ``in-process``, ``dispenser`` or ``postgres``."""
    bits: int
    """Bits of one ID as stored: 64 for a ``bigint``, 128 for a ``uuid``."""
    network: str
    """When a call crosses the network: ``never``, ``per range`` (a buffered client: its background refill
    asks for a range of IDs; a call waits on it only when the buffer is empty) or ``every call``."""
    calls: int
    ids: int
    seconds: float
    p50_us: float
    p99_us: float
    max_us: float

    @property
    def calls_per_s(self) -> float:
        """Calls per second."""
        return self.calls / self.seconds if self.seconds else 0.0

    @property
    def ids_per_s(self) -> float:
        """IDs per second."""
        return self.ids / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, object]:
        """The JSON record."""
        return asdict(self) | {"calls_per_s": self.calls_per_s, "ids_per_s": self.ids_per_s}


@dataclass(frozen=True, slots=True)
class Holders:
    """What two holders of cached IDs do: the order of interleaved IDs and what a restart skips."""

    name: str
    interleaved: list[int]
    """``a1, b1, a2``: holder A's first ID, then B's first, then A's second."""
    time_ordered: bool
    """Whether ``a1 < b1 < a2``: IDs taken one after the other came out in increasing order."""
    skipped_on_restart: int
    """IDs never handed out when a holder that took one ID closes and another takes the next."""


@dataclass(frozen=True, slots=True)
class StorageRow:
    """A table of ``rows`` keys: its heap and its primary-key index."""

    key: str
    rows: int
    table_bytes: int
    index_bytes: int

    @property
    def index_bytes_per_row(self) -> float:
        """Primary-key index bytes per row."""
        return self.index_bytes / self.rows

    def as_dict(self) -> dict[str, object]:
        """The JSON record."""
        return asdict(self) | {"index_bytes_per_row": self.index_bytes_per_row}


@dataclass(slots=True)
class Report:
    """Everything one run measured."""

    cases: list[AltCase]
    holders: list[Holders]
    storage: list[StorageRow]
    meta: dict[str, object] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The JSON document (``write_json`` adds ``schema_version``)."""
        return {
            "meta": self.meta,
            "cases": [c.as_dict() for c in self.cases],
            "holders": [asdict(h) for h in self.holders],
            "storage": [s.as_dict() for s in self.storage],
        }


class _Timer:
    """Latencies of single calls, and the IDs they returned."""

    def __init__(self) -> None:
        self.ns: list[int] = []
        self.ids = 0
        self.seconds = 0.0

    def result(self, name: str, family: str, bits: int, network: str) -> AltCase:
        ns = sorted(self.ns)
        return AltCase(
            name=name,
            family=family,
            bits=bits,
            network=network,
            calls=len(ns),
            ids=self.ids,
            seconds=self.seconds,
            p50_us=percentile(ns, 0.5) / 1000 if ns else 0.0,
            p99_us=percentile(ns, 0.99) / 1000 if ns else 0.0,
            max_us=ns[-1] / 1000 if ns else 0.0,
        )


def _sync_loop(call: Callable[[], int], duration: float) -> _Timer:
    """Call ``call`` for ``duration`` seconds, each call timed; ``call`` returns the IDs it made."""
    timer = _Timer()
    clock = time.perf_counter_ns
    ns = timer.ns
    ids = 0
    started = time.perf_counter()
    end = started + duration
    while time.perf_counter() < end:
        for _ in range(_BLOCK):
            start = clock()
            got = call()
            ns.append(clock() - start)
            ids += got
    timer.seconds = time.perf_counter() - started
    timer.ids = ids
    return timer


async def _async_loops(
    calls: Sequence[Callable[[], Awaitable[int]]], duration: float, block: int = _ROUND_TRIP_BLOCK
) -> _Timer:
    """Run one timed loop per element of ``calls`` at once for ``duration`` seconds; one timer for all.

    Each loop looks at the time and yields to the event loop once every ``block`` calls, untimed, as a
    service awaiting its own I/O does (a buffered client's background refill runs then). A call that
    crosses the network yields anyway; its ``block`` is small so that the run ends on time.
    """
    timer = _Timer()
    clock = time.perf_counter_ns
    end = time.perf_counter() + duration

    async def loop(call: Callable[[], Awaitable[int]]) -> None:
        ns = timer.ns
        while time.perf_counter() < end:
            for _ in range(block):
                start = clock()
                got = await call()
                ns.append(clock() - start)
                timer.ids += got
            await asyncio.sleep(0)

    started = time.perf_counter()
    await asyncio.gather(*(loop(call) for call in calls))
    timer.seconds = time.perf_counter() - started
    return timer


def _in_process_cases(duration: float, warmup: float) -> list[AltCase]:
    """The timer's floor, an embedded snowflake, UUIDv7 and ULID: no I/O, no coordination."""
    try:
        import ulid  # noqa: PLC0415 - an optional extra
        import uuid_utils  # noqa: PLC0415
    except ImportError as exc:
        raise BenchError(f"{exc.name} is missing: pip install ./lab (uuid-utils, python-ulid)") from exc

    layout = SnowflakeLayout()
    state = SnowflakeState(layout, 1, random_start=100)
    wall_ns = time.time_ns
    make_uuid7 = uuid_utils.uuid7
    make_ulid = ulid.ULID

    def nothing() -> int:
        return 1

    def snowflake() -> int:
        # A WaitUntil (4,096 IDs already issued this millisecond) counts as a call that made no ID.
        decision = state.issue(wall_ns() // 1_000_000, 1)
        return 1 if type(decision) is Issued else 0

    def uuid7() -> int:
        make_uuid7()
        return 1

    def ulid_() -> int:
        make_ulid()
        return 1

    cases = [
        ("(timer floor: an empty call)", "timer", 0, nothing),
        ("embedded snowflake: SnowflakeState.issue(now, 1)", "in-process", 64, snowflake),
        ("UUIDv7: uuid_utils.uuid7()", "in-process", 128, uuid7),
        ("ULID: ulid.ULID()", "in-process", 128, ulid_),
    ]
    results = []
    for name, family, bits, call in cases:
        _sync_loop(call, warmup)
        results.append(_sync_loop(call, duration).result(name, family, bits, network="never"))
    return results


async def _dispenser_cases(
    nats_url: str, tag: str, child: Child, duration: float, warmup: float
) -> tuple[list[AltCase], Holders]:
    subject = f"leaf.segment.{tag}"
    nc = await nats.connect(nats_url, name="dispenser-bench-alternatives", allow_reconnect=False)
    cases: list[AltCase] = []
    try:
        await wait_ready(nc, child, subject, b"")
        holders = await _client_holders(nats_url, tag)
        async with IdClient.over_nats(nats_url, BufferSettings()) as client:

            async def next_id() -> int:
                await client.next_id(tag)
                return 1

            async def take() -> int:
                return len(await client.take(tag, _BATCH))

            for name, call in (
                ("dispenser: IdClient.next_id", next_id),
                ("dispenser: IdClient.take(1000)", take),
            ):
                await _async_loops([call], warmup, _BLOCK)
                timer = await _async_loops([call], duration, _BLOCK)
                cases.append(timer.result(name, "dispenser", 64, network="per range"))

        async def request() -> int:
            await nc.request(subject, b"", timeout=5.0)
            return 1

        for inflight in (1, _CONNECTIONS):
            await _async_loops([request] * inflight, warmup)
            timer = await _async_loops([request] * inflight, duration)
            cases.append(
                timer.result(
                    f"dispenser: nc.request per ID @{inflight}", "dispenser", 64, network="every call"
                )
            )
    finally:
        await nc.close()
    return cases, holders


async def _client_holders(nats_url: str, tag: str) -> Holders:
    """Two buffered clients side by side, then one closed and a new one opened."""
    settings = BufferSettings()
    async with IdClient.over_nats(nats_url, settings) as a, IdClient.over_nats(nats_url, settings) as b:
        a1 = await a.next_id(tag)
        b1 = await b.next_id(tag)
        a2 = await a.next_id(tag)
    async with IdClient.over_nats(nats_url, settings) as c:
        last = await c.next_id(tag)
    async with IdClient.over_nats(nats_url, settings) as d:
        after = await d.next_id(tag)
    return Holders(
        "dispenser IdClient (default BufferSettings)",
        [a1, b1, a2],
        a1 < b1 < a2,
        after - last - 1,
    )


async def _postgres_cases(dsn: str, prefix: str, duration: float, warmup: float) -> list[AltCase]:
    conns = [await asyncpg.connect(dsn) for _ in range(_CONNECTIONS)]
    cases: list[AltCase] = []
    try:
        for cache in (1, 1000):
            seq = f"{prefix}_cache{cache}"
            await conns[0].execute(f"CREATE SEQUENCE {seq} CACHE {cache}")
            single = [await c.prepare(f"SELECT nextval('{seq}')") for c in conns]
            calls: list[Callable[[], Awaitable[int]]] = []
            for stmt in single:

                async def one(stmt: Any = stmt) -> int:
                    await stmt.fetchval()
                    return 1

                calls.append(one)
            for n in (1, _CONNECTIONS):
                await _async_loops(calls[:n], warmup)
                timer = await _async_loops(calls[:n], duration)
                label = "1 connection" if n == 1 else f"{n} connections"
                cases.append(
                    timer.result(
                        f"PostgreSQL nextval, CACHE {cache}, {label}", "postgres", 64, network="every call"
                    )
                )
            batch = await conns[0].prepare(f"SELECT nextval('{seq}') FROM generate_series(1, {_BATCH})")

            async def many(batch: Any = batch) -> int:
                # A list of ints, as IdClient.take returns.
                return len([row[0] for row in await batch.fetch()])

            await _async_loops([many], warmup)
            timer = await _async_loops([many], duration)
            cases.append(
                timer.result(
                    f"PostgreSQL nextval x1000 (generate_series), CACHE {cache}",
                    "postgres",
                    64,
                    network="every call",
                )
            )
    finally:
        for conn in conns:
            await conn.close()
    return cases


async def _sequence_holders(dsn: str, prefix: str) -> Holders:
    """Two connections drawing from one ``CACHE 1000`` sequence, then one closed and a new one opened."""
    seq = f"{prefix}_cache1000"  # made by _postgres_cases; its values so far do not matter
    a = await asyncpg.connect(dsn)
    b = await asyncpg.connect(dsn)
    try:
        query = f"SELECT nextval('{seq}')"
        a1 = int(await a.fetchval(query))
        b1 = int(await b.fetchval(query))
        a2 = int(await a.fetchval(query))
    finally:
        await a.close()
        await b.close()
    c = await asyncpg.connect(dsn)
    try:
        last = int(await c.fetchval(query))
    finally:
        await c.close()
    d = await asyncpg.connect(dsn)
    try:
        after = int(await d.fetchval(query))
    finally:
        await d.close()
    return Holders("PostgreSQL sequence, CACHE 1000", [a1, b1, a2], a1 < b1 < a2, after - last - 1)


async def _storage(dsn: str, prefix: str, rows: int) -> list[StorageRow]:
    """Tables of ``rows`` primary keys, inserted in the order they were made (COPY, index already there)."""
    import uuid_utils  # noqa: PLC0415 - an optional extra, checked by _in_process_cases

    keys: list[tuple[str, str, Callable[[int], object]]] = [
        ("bigint, increasing (segment or snowflake IDs)", "bigint", lambda n: n + 1),
        ("uuid, UUIDv7 (uuid_utils.uuid7)", "uuid", lambda _n: uuid.UUID(bytes=uuid_utils.uuid7().bytes)),
        ("uuid, random UUIDv4 (uuid.uuid4)", "uuid", lambda _n: uuid.uuid4()),
    ]
    conn = await asyncpg.connect(dsn)
    result: list[StorageRow] = []
    try:
        for i, (label, sql_type, make) in enumerate(keys):
            table = f"{prefix}_keys{i}"
            await conn.execute(f"CREATE TABLE {table} (id {sql_type} PRIMARY KEY)")
            try:
                await conn.copy_records_to_table(table, records=[(make(n),) for n in range(rows)])
                await conn.execute(f"ANALYZE {table}")
                size = "SELECT pg_relation_size($1::text::regclass)"
                heap = int(await conn.fetchval(size, table))
                index = int(await conn.fetchval(size, f"{table}_pkey"))
                result.append(StorageRow(label, rows, heap, index))
            finally:
                await conn.execute(f"DROP TABLE {table}")
    finally:
        await conn.close()
    return result


async def _drop_sequences(dsn: str, prefix: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for cache in (1, 1000):
            await conn.execute(f"DROP SEQUENCE IF EXISTS {prefix}_cache{cache}")
    finally:
        await conn.close()


async def _postgres_part(
    dsn: str, duration: float, warmup: float, rows: int
) -> tuple[list[AltCase], Holders, list[StorageRow]]:
    prefix = f"bench_alt_{secrets.token_hex(3)}"
    try:
        cases = await _postgres_cases(dsn, prefix, duration, warmup)
        holders = await _sequence_holders(dsn, prefix)
        storage = await _storage(dsn, prefix, rows)
    finally:
        await _drop_sequences(dsn, prefix)
    return cases, holders, storage


def _us(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:,.1f}"


def render(report: Report) -> str:
    """The tables, as printed."""
    meta = report.meta
    lines = [
        f"dispenser bench alternatives — {meta.get('date')} — {meta.get('cpus')} CPUs, Python "
        f"{meta.get('python')}, {meta.get('duration')} s per case (+{meta.get('warmup')} s warm-up), "
        f"{meta.get('wall_s')} s in all, load average {meta.get('loadavg_before')} before, "
        f"{meta.get('loadavg_after')} after",
        "",
        render_table(
            ["case", "bits", "network", "calls/s", "IDs/s", "p50 µs", "p99 µs", "max µs"],
            [
                [
                    c.name,
                    str(c.bits) if c.bits else "-",
                    c.network,
                    fmt_rate(c.calls_per_s),
                    fmt_rate(c.ids_per_s),
                    _us(c.p50_us),
                    _us(c.p99_us),
                    _us(c.max_us),
                ]
                for c in report.cases
            ],
        ),
        "",
        "two holders of cached IDs (a1, b1, a2 taken one after the other; a holder closed after one ID):",
        render_table(
            ["holders", "a1, b1, a2", "in time order", "IDs skipped by a restart"],
            [
                [
                    h.name,
                    ", ".join(str(x) for x in h.interleaved),
                    "yes" if h.time_ordered else "no",
                    f"{h.skipped_on_restart:,}",
                ]
                for h in report.holders
            ],
        ),
        "",
        f"storage: {report.storage[0].rows:,} rows, primary key only" if report.storage else "storage: -",
        render_table(
            ["key", "table bytes", "index bytes", "index bytes per row"],
            [
                [s.key, f"{s.table_bytes:,}", f"{s.index_bytes:,}", f"{s.index_bytes_per_row:.1f}"]
                for s in report.storage
            ],
        ),
    ]
    return "\n".join(lines) + "\n"


def run(
    duration: float = 1.5,
    warmup: float = 0.3,
    rows: int = 100_000,
    *,
    nats_url: str | None = None,
    postgres_dsn: str | None = None,
    quiet: bool = False,
) -> Report:
    """Start the servers and the worker (unless given), measure every case, stop what was started.

    Raises:
        BenchError: a server or the worker could not be started, the worker went away, or an optional
            package is missing.
    """
    from dispenser_lab.servers import DevServerError  # noqa: PLC0415

    def say(text: str) -> None:
        if not quiet:
            print(text, file=sys.stderr, flush=True)

    began = time.monotonic()
    started = datetime.datetime.now(datetime.UTC)
    load_before = os.getloadavg()
    say("in process: timer floor, embedded snowflake, UUIDv7, ULID")
    cases = _in_process_cases(duration, warmup)
    tag = f"bench-alt-{secrets.token_hex(3)}"
    with tempfile.TemporaryDirectory(prefix="dispenser-bench-alternatives-") as tmp:
        workdir = Path(tmp)
        if os.geteuid() == 0:
            workdir.chmod(0o755)  # PostgreSQL runs as its own user below it
        try:
            with bench_servers(workdir, nats_url, postgres_dsn) as (url, _pid, dsn):
                if dsn is None:
                    raise BenchError("no PostgreSQL to run against")
                say(f"servers: NATS {url}, PostgreSQL {dsn}")
                with serving_worker(url, dsn, workdir, [(tag, 100_000, 1)], say) as child:
                    say("the dispenser: buffered client, request per ID")
                    dispenser_cases, client_holders = run_async(
                        _dispenser_cases(url, tag, child, duration, warmup)
                    )
                say("PostgreSQL: sequences, then storage")
                pg_cases, seq_holders, storage = run_async(_postgres_part(dsn, duration, warmup, rows))
        except DevServerError as exc:
            raise BenchError(f"cannot start a server: {exc}") from exc
    meta: dict[str, object] = {
        **host_meta(started, load_before),
        "duration": duration,
        "warmup": warmup,
        "rows": rows,
        "connections": _CONNECTIONS,
        "wall_s": round(time.monotonic() - began, 1),
        "buffer": asdict(BufferSettings()),
    }
    return Report(cases + dispenser_cases + pg_cases, [seq_holders, client_holders], storage, meta)


def main(argv: Sequence[str]) -> int:
    """``dispenser bench alternatives [--duration S] [--warmup S] [--rows N] [--json PATH] [...]``."""
    parser = argparse.ArgumentParser(
        prog="dispenser bench alternatives", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--duration", type=float, default=1.5, help="seconds per case (default 1.5)")
    parser.add_argument("--warmup", type=float, default=0.3, help="seconds of warm-up per case (default 0.3)")
    parser.add_argument(
        "--rows", type=int, default=100_000, help="rows in each storage table (default 100,000)"
    )
    parser.add_argument("--nats-url", help="use this NATS server instead of starting one")
    parser.add_argument(
        "--postgres-dsn",
        help="use this PostgreSQL instead of starting one (a tag, two sequences and three tables are added, then removed)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(list(argv))
    if args.duration <= 0 or args.warmup < 0 or args.rows < 1:
        parser.error("--duration must be > 0, --warmup >= 0 and --rows >= 1")
    try:
        report = run(
            args.duration,
            args.warmup,
            args.rows,
            nats_url=args.nats_url,
            postgres_dsn=args.postgres_dsn,
            quiet=args.quiet,
        )
    except BenchError as exc:
        print(f"dispenser bench alternatives: {exc}", file=sys.stderr)
        return 1
    print(render(report), end="")
    if args.json is not None:
        write_json(args.json, report.as_json())
        print(f"\nwrote {args.json}")
    return 0
