"""The servers and tags a benchmark run needs: started here unless given, cleaned up after."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = [
    "bench_servers",
    "prepare_daily_tag",
    "prepare_permuted_tag",
    "prepare_tags",
    "remove_tags",
    "write_bench_key",
]


async def prepare_tags(dsn: str, tags: Sequence[tuple[str, int, int]], *, migrate: bool = True) -> None:
    """Migrate ``dsn`` (unless told not to: a deployment's database) and add the ``(tag, step, start)`` tags."""
    from dispenser.adapters.postgres.schema import migrate as migrate_schema  # noqa: PLC0415
    from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415 - segment mode only

    if migrate:
        await migrate_schema(dsn)
    async with await PostgresSegmentStore.connect(dsn) as store:
        for tag, step, start in tags:
            await store.add_tag(tag, step, start, "created by dispenser bench; safe to remove")


async def prepare_daily_tag(dsn: str, tag: str, step: int, width: int) -> None:
    """Add a daily tag (UTC, ``width`` digits) to ``dsn``, migrated already; remove it with :func:`remove_tags`."""
    from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415
    from dispenser.core.daily import DailyPolicy  # noqa: PLC0415

    async with await PostgresSegmentStore.connect(dsn) as store:
        await store.add_tag(
            tag,
            step,
            description="created by dispenser bench; safe to remove",
            daily=DailyPolicy(width, "UTC"),
        )


def write_bench_key(keys_dir: Path, tag: str) -> None:
    """A key file of a fresh random key for ``tag`` in ``keys_dir`` (docs/permuted.md)."""
    keys_dir.mkdir(mode=0o700, exist_ok=True)
    (keys_dir / f"{tag}.keys").write_text(f"1 {secrets.token_hex(16)}\n")


async def prepare_permuted_tag(dsn: str, tag: str, step: int) -> None:
    """Add a permuted tag to ``dsn`` (migrated already); its key: :func:`write_bench_key`."""
    from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415

    async with await PostgresSegmentStore.connect(dsn) as store:
        await store.add_tag(
            tag, step, description="created by dispenser bench; safe to remove", permuted=True
        )


async def remove_tags(dsn: str, tags: Sequence[tuple[str, int, int]]) -> None:
    """Remove the tags :func:`prepare_tags` added (best effort: a run's clean-up must not fail it)."""
    from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415

    async with await PostgresSegmentStore.connect(dsn) as store:
        for tag, _step, _start in tags:
            with contextlib.suppress(Exception):
                await store.remove_tag(tag)


@contextlib.contextmanager
def bench_servers(
    workdir: Path, nats_url: str | None, postgres_dsn: str | None, need_postgres: bool = True
) -> Iterator[tuple[str, int | None, str | None]]:
    """NATS URL, NATS server PID (if we started it) and PostgreSQL DSN (if needed).

    A server whose address is given is used as it is; the others are started under ``workdir`` and
    stopped on exit.
    """
    from dispenser_lab.servers import NatsServer, PostgresServer  # noqa: PLC0415 - only when we start them

    nats_server: NatsServer | None = None
    pg_server: PostgresServer | None = None
    try:
        if nats_url is None:
            nats_server = NatsServer(workdir / "nats")
            nats_server.start()
            nats_url = nats_server.url
        dsn = postgres_dsn
        if dsn is None and need_postgres:
            pg_server = PostgresServer(workdir / "pgdata")
            pg_server.start()
            dsn = pg_server.dsn
        yield nats_url, None if nats_server is None else nats_server.pid, dsn
    finally:
        if pg_server is not None:
            pg_server.stop()
        if nats_server is not None:
            nats_server.stop()
