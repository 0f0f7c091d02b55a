"""``dispenser check``: can this worker reach every dependency its configuration names?"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dispenser.config import Config
from dispenser.redaction import redact

T = TypeVar("T")

__all__ = ["CheckResult", "check_all", "check_grants_dir"]


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of one check."""

    name: str
    ok: bool
    detail: str
    warning: str | None = None
    """Reachable, but something the operator should fix (printed as ``WARN``)."""


async def _check_nats(config: Config) -> CheckResult:
    from dispenser.adapters.nats.connection import connect, server_version  # noqa: PLC0415

    try:
        nc = await connect(config.nats, name="dispenser-check", deadline=config.nats.connect_timeout)
    except OSError as exc:
        return CheckResult("nats", False, str(exc) or f"no answer from {redact(config.nats.url)}")
    try:
        return CheckResult("nats", True, f"{redact(config.nats.url)} (nats-server {server_version(nc)})")
    finally:
        await nc.close()


async def _check_postgres(config: Config) -> CheckResult:
    from dispenser.adapters.postgres.schema import MIGRATIONS, schema_version  # noqa: PLC0415
    from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415
    from dispenser.core.errors import DispenserError  # noqa: PLC0415

    dsn = config.postgres.dsn
    try:
        version = await schema_version(dsn)
        if version == 0:
            return CheckResult("postgres", False, f"{redact(dsn)}: no schema yet; run `dispenser migrate`")
        latest = MIGRATIONS[-1].version
        if version < latest:
            return CheckResult(
                "postgres",
                False,
                f"{redact(dsn)}: schema version {version}, this release needs {latest}; run `dispenser migrate`",
            )
        async with await PostgresSegmentStore.connect(
            dsn,
            command_timeout=config.postgres.command_timeout,
            connect_timeout=config.postgres.connect_timeout,
        ) as store:
            tags = await store.list_tags()
            replication = await store.replication()
    except (OSError, DispenserError) as exc:
        return CheckResult("postgres", False, str(exc))
    detail = f"{redact(dsn)} (schema version {version}, {len(tags)} tags); primary {replication.primary}"
    if replication.synchronous:
        sync = f", {replication.sync_standbys} synchronous" if replication.sync_standbys else ""
        detail += (
            f", replicating synchronously to {replication.standbys} standby(s){sync} "
            f"(synchronous_standby_names = {replication.standby_names!r})"
        )
        if replication.standbys == 0:
            return CheckResult(
                "postgres",
                False,
                f"{detail}: no standby is attached, so every commit waits (synchronous_mode_strict "
                "without standbys): no segment can be fetched",
            )
        return CheckResult("postgres", True, detail)
    if replication.standbys == 0:
        return CheckResult("postgres", True, f"{detail}, no standbys (a single server: no failover)")
    detail += f", replicating ASYNCHRONOUSLY to {replication.standbys} standby(s)"
    repair = (
        "each worker restores the grants it remembers (segment.remember_grants), not those of a worker "
        "whose state directory is gone"
        if config.segment.remember_grants
        else "segment.remember_grants is off, so nothing restores them"
    )
    registry = ""
    if config.snowflake.enabled and config.snowflake.mode == "postgres":
        # The registry's INSERT of a new worker's row can be lost the same way: the new primary then gives
        # that worker ID to the next new address. Only the peer guard over NATS (docs/snowflake.md) stops
        # two live workers issuing under it; nothing restores the lost row.
        registry = (
            " The snowflake registry (postgres mode) can likewise give one worker ID to two workers: "
            + (
                "the peer identity guard over NATS refuses the second while both are live."
                if config.nats.enabled
                else "NATS is off, so no peer identity guard refuses the second."
            )
        )
    return CheckResult(
        "postgres",
        True,
        detail,
        warning=(
            "a failover may promote a standby that lacks the last segment grants, and hand out DUPLICATE IDs: "
            f"{repair}.{registry} Use synchronous replication (Patroni: synchronous_mode and "
            "synchronous_mode_strict; see docs/ha.md)"
        ),
    )


async def _check_snowflake(config: Config) -> CheckResult:
    from dispenser.core.errors import DispenserError  # noqa: PLC0415
    from dispenser.registries import layout_of  # noqa: PLC0415

    sf = config.snowflake
    try:
        layout = layout_of(sf)
    except DispenserError as exc:
        return CheckResult("snowflake layout", False, str(exc))
    end = layout.end_datetime().isoformat(timespec="seconds")
    if layout.datacenter_bits:
        bits = f"{sf.timestamp_bits}+{sf.datacenter_bits}+{sf.worker_bits}+{sf.sequence_bits} bits"
        room = (
            f"datacenter {sf.datacenter_id} of {layout.max_datacenter_id + 1}, "
            f"{layout.max_worker_id + 1} worker IDs each"
        )
    else:
        bits = f"{sf.timestamp_bits}+{sf.worker_bits}+{sf.sequence_bits} bits"
        room = f"{layout.max_worker_id + 1} worker IDs"
    return CheckResult("snowflake layout", True, f"{bits}, {room}, IDs valid until {end}")


async def _over_nats(config: Config, name: str, ask: Callable[[Any], Awaitable[T]]) -> T | CheckResult:
    """``ask`` over a NATS connection of the check's own (closed after); the failed check if NATS cannot be reached."""
    from dispenser.adapters.nats.connection import connect  # noqa: PLC0415

    try:
        nc = await asyncio.wait_for(connect(config.nats, name="dispenser-check"), config.nats.connect_timeout)
    except (OSError, TimeoutError) as exc:
        return CheckResult(name, False, str(exc) or f"no answer from {redact(config.nats.url)}")
    try:
        return await ask(nc)
    finally:
        await nc.close()


async def _check_snowflake_peers(config: Config) -> CheckResult:
    """Ask the live snowflake workers for their claims: no two may issue under one (datacenter, worker) ID."""
    from dispenser.adapters.nats.peers import collect_peer_clocks  # noqa: PLC0415
    from dispenser.messages import clock_subject  # noqa: PLC0415

    name = "snowflake peers"
    window = max(config.snowflake.peer_check_timeout, 0.5)
    heard = await _over_nats(
        config,
        name,
        lambda nc: collect_peer_clocks(
            nc, clock_subject(config.nats.subject_prefix), lambda: int(time.time() * 1000), window
        ),
    )
    if isinstance(heard, CheckResult):
        return heard
    claims = heard.claims
    by_node: dict[tuple[int, int], list[str]] = {}
    for claim in claims:
        by_node.setdefault(claim.node, []).append(claim.describe())
    problems = [
        f"datacenter {dc}, worker {worker}: {', '.join(sorted(holders))}"
        for (dc, worker), holders in sorted(by_node.items())
        if len(holders) > 1
    ]
    # Other pairs whose node bits compose the same IDs (another layout, or datacenter bits in one only).
    problems += [
        f"datacenter {a.datacenter_id}, worker {a.worker_id} ({a.bits.describe() if a.bits else '?'}): "
        f"{a.describe()} and datacenter {b.datacenter_id}, worker {b.worker_id} "
        f"({b.bits.describe() if b.bits else '?'}): {b.describe()}"
        for i, a in enumerate(claims)
        for b in claims[i + 1 :]
        if a.node != b.node and a.overlaps(b)
    ]
    refusing = [c for c in claims if c.state == "refused"]
    if problems or refusing:
        detail = "; ".join(problems) if problems else ", ".join(c.describe() for c in refusing)
        return CheckResult(
            name,
            False,
            f"live workers claim one snowflake ID ({detail}); a worker that finds its ID claimed issues no "
            "snowflake IDs (worker_id_in_use): give each datacenter its own snowflake.datacenter_id",
        )
    if not heard.answered:
        return CheckResult(
            name,
            True,
            "no answer on the clock subject, not even 'no responders'",
            warning="the live snowflake workers' IDs are not checked: no permission to publish there "
            "(or to receive on _INBOX.>), or the server is slow",
        )
    return CheckResult(name, True, f"{len(claims)} live snowflake worker(s), each on an ID of its own")


async def _check_residues(config: Config) -> CheckResult:
    """Ask the live segment workers for their tags' classes: no two databases may serve intersecting ones."""
    from dispenser.adapters.nats.residues import ask_residues  # noqa: PLC0415
    from dispenser.core.residue_claims import clashes  # noqa: PLC0415
    from dispenser.messages import ResidueClaims, residue_check_subject  # noqa: PLC0415

    name = "residue classes"
    window = max(config.segment.residue_check_window, 0.5)
    heard = await _over_nats(
        config,
        name,
        lambda nc: ask_residues(
            nc, residue_check_subject(config.nats.subject_prefix), window, ResidueClaims()
        ),
    )
    if isinstance(heard, CheckResult):
        return heard
    claims = heard.claims
    problems = [f"tag {one.tag!r}: {one.describe()} and {other.describe()}" for one, other in clashes(claims)]
    problems += [f"tag {c.tag!r}: {c.describe()}" for c in claims if c.state == "refused"]
    if problems:
        return CheckResult(
            name,
            False,
            f"two databases serve one tag in residue classes that share IDs ({'; '.join(problems)}); a worker "
            "that finds it refuses the tag (residue_overlap): give the tag one stride in every database and a "
            "different offset in each (docs/datacenters.md)",
        )
    if not heard.answered:
        return CheckResult(
            name,
            True,
            "no answer on the residue check subject, not even 'no responders'",
            warning="the tags' classes across databases are not checked: no permission to publish there "
            "(or to receive on _INBOX.>), or the server is slow",
        )
    databases = {c.database for c in claims}
    return CheckResult(
        name,
        True,
        f"{len(heard.messages)} live segment worker(s); {len(claims)} claim(s) on {len({c.tag for c in claims})} "
        f"tag(s) from {len(databases)} database(s), no two intersecting",
    )


async def _check_zookeeper(config: Config) -> CheckResult:
    hosts = config.snowflake.zookeeper_hosts
    last = "no hosts configured"
    for host in hosts.split(","):
        address, _, port = host.strip().rpartition(":")
        try:
            # `srvr` is the one four-letter word ZooKeeper allows by default; unlike `ruok`, it is
            # answered only by a server that serves.
            reader, writer = await asyncio.wait_for(asyncio.open_connection(address, int(port)), 3.0)
            try:
                writer.write(b"srvr")
                answer = await asyncio.wait_for(reader.read(4096), 3.0)
            finally:
                writer.close()
        except (OSError, TimeoutError, ValueError) as exc:
            last = f"{host}: {str(exc) or type(exc).__name__}"
            continue
        first_line = answer.decode(errors="replace").splitlines()[0] if answer else ""
        if first_line.startswith("Zookeeper version:"):
            return CheckResult(
                "zookeeper", True, f"{host} ({first_line.split(':', 1)[1].split(',')[0].strip()})"
            )
        last = f"{host}: answered {first_line or 'nothing'!r} to srvr (is srvr in 4lw.commands.whitelist?)"
    return CheckResult("zookeeper", False, f"no ZooKeeper server of {hosts} answered ({last})")


async def _check_kafka(config: Config) -> CheckResult:
    from dispenser.adapters.kafka.connection import (  # noqa: PLC0415 - imports aiokafka
        check_security,
        topic_partitions,
    )

    kafka = config.kafka
    try:
        await asyncio.wait_for(check_security(kafka), 10.0)
        partitions = await asyncio.wait_for(topic_partitions(kafka, kafka.request_topic), 10.0)
    except TimeoutError:
        return CheckResult("kafka", False, f"no answer from {kafka.bootstrap_servers} within 10 s")
    except OSError as exc:
        if "does not exist" in str(exc) and kafka.create_topics:
            return CheckResult("kafka", True, f"{kafka.bootstrap_servers} ({exc}; `serve` creates it)")
        return CheckResult("kafka", False, str(exc))
    return CheckResult(
        "kafka",
        True,
        f"{kafka.bootstrap_servers} (request topic {kafka.request_topic!r}: {partitions} partitions)",
    )


async def check_grants_dir(config: Config) -> CheckResult:
    """``segment.remember_grants`` needs a state directory it can write: ``serve`` refuses to start without."""
    from dispenser.adapters.local.grants import probe_writable  # noqa: PLC0415
    from dispenser.app import grants_dir  # noqa: PLC0415

    directory = grants_dir(config)
    try:
        await probe_writable(directory)  # bounded: a stalled disk fails the check, never holds it
    except OSError as exc:
        return CheckResult(
            "segment grants",
            False,
            f"cannot write {directory} ({exc.strerror or exc}): `serve` would refuse to start; set "
            "segment.state_dir to a writable directory, or segment.remember_grants = false",
        )
    return CheckResult("segment grants", True, f"kept in {directory}")


async def check_all(config: Config) -> list[CheckResult]:
    """Run every check that applies to the configuration, at once."""
    checks = [_check_nats(config)] if config.nats.enabled else []
    if config.kafka.enabled:
        checks.append(_check_kafka(config))
    if config.segment.enabled or config.snowflake.mode == "postgres":
        checks.append(_check_postgres(config))
    if config.segment.enabled and config.segment.remember_grants:
        checks.append(check_grants_dir(config))
    if config.segment.enabled and config.nats.enabled:
        checks.append(_check_residues(config))
    if config.snowflake.enabled:
        checks.append(_check_snowflake(config))
        if config.nats.enabled:
            checks.append(_check_snowflake_peers(config))
        if config.snowflake.mode.startswith("zookeeper"):
            checks.append(_check_zookeeper(config))
    return list(await asyncio.gather(*checks))
