"""``dispenser dev``: NATS and PostgreSQL from wheels in a data directory, a ``demo`` tag, and a worker.

With ``--kafka``, a Kafka broker too (jars from Maven Central; needs Java 17 and Maven), and the worker
answers ID requests on its ``leaf.requests`` topic as well. With ``--datacenters N``, N datacenters
(``dc-a``, ``dc-b``, …): a NATS server each, joined by gateways, and a worker in each, all on the one
PostgreSQL (docs/datacenters.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from dispenser.config import Config
from dispenser.core.errors import TagExists
from dispenser_lab.servers import KafkaBroker, NatsGateways, NatsServer, PostgresServer
from dispenser_lab.servers.process import port_is_free

__all__ = ["DEMO_TAG", "prepare_demo", "run_dev"]

log = logging.getLogger(__name__)

DEMO_TAG = "demo"
DEV_POSTGRES_PORT = 54329
DEV_KAFKA_PORT = 9092
DEV_METRICS_PORT = 9464


async def prepare_demo(dsn: str) -> None:
    """Create the schema and the demo tag (once)."""
    from dispenser.adapters.postgres.schema import migrate  # noqa: PLC0415
    from dispenser.adapters.postgres.segments import PostgresSegmentStore  # noqa: PLC0415

    await migrate(dsn)
    async with await PostgresSegmentStore.connect(dsn) as store:
        try:
            await store.add_tag(DEMO_TAG, 1000, description="created by `dispenser dev`")
            log.info("created tag %r", DEMO_TAG)
        except TagExists:
            pass


def _write_client_config(path: Path, config: Config) -> None:
    """The settings a second terminal needs to reach this stack (``dispenser get``, ``watch``, ``tag``, ``check``).

    The CLI reads ``.dispenser/dev.toml`` by itself when run where the stack runs (no --config, no
    ``DISPENSER_CONFIG``); from elsewhere, ``--config <data-dir>/dev.toml``.
    """
    import tomli_w  # noqa: PLC0415

    settings: dict[str, dict[str, object]] = {
        "nats": {"url": config.nats.url, "subject_prefix": config.nats.subject_prefix},
        "postgres": {"dsn": config.postgres.dsn},
        "snowflake": {  # decode needs the layout
            "timestamp_bits": config.snowflake.timestamp_bits,
            "worker_bits": config.snowflake.worker_bits,
            "sequence_bits": config.snowflake.sequence_bits,
            "epoch_ms": config.snowflake.epoch_ms,
        },
    }
    if config.kafka.enabled:
        settings["kafka"] = {"bootstrap_servers": config.kafka.bootstrap_servers}
    header = "# Written by `dispenser dev` while it runs (removed when it stops): how to reach its servers.\n"
    path.write_text(header + tomli_w.dumps(settings), encoding="utf-8")


def _banner(config: Config, client_config: Path) -> str:
    prefix = config.nats.subject_prefix
    url = config.nats.url
    return f"""
Leaf dispenser is serving on {url}  (Ctrl-C stops it and the servers it started)

  from another terminal, in this directory (the CLI reads .dispenser/dev.toml) or with --config {client_config}:
    dispenser get {DEMO_TAG} 5
    dispenser watch
    nats request {prefix}.segment.{DEMO_TAG} '{{"count": 5}}'          # with the nats CLI, if you have it

  snowflake IDs (any tag):
    dispenser get --kind snowflake demo 3
    dispenser decode <id>

  from Python:
    nc = await nats.connect("{url}")
    msg = await nc.request("{prefix}.segment.{DEMO_TAG}", b'{{"count": 5}}')

  rates:     dispenser watch            metrics: http://127.0.0.1:{config.metrics.port}/metrics
  new tags:  DISPENSER_POSTGRES_DSN={config.postgres.dsn} dispenser tag add order --step 1000
{_kafka_banner(config) if config.kafka.enabled else ""}"""


def _kafka_banner(config: Config) -> str:
    bootstrap = config.kafka.bootstrap_servers
    return f"""
  Kafka on {bootstrap}: requests on '{config.kafka.request_topic}', replies on '{config.kafka.reply_topic}'
    dispenser get --via kafka {DEMO_TAG} 5                      # with DISPENSER_KAFKA_BOOTSTRAP_SERVERS={bootstrap}
    dispenser enrich --in <topic> --out <topic> --tag {DEMO_TAG}   # exactly-once IDs for a stream
"""


def _datacenters_banner(gateways: NatsGateways) -> str:
    lines = "\n".join(f"    {dc}: {gateways.url_of(dc)}" for dc in gateways.datacenters)
    other = gateways.datacenters[1]
    return f"""
  {len(gateways.datacenters)} datacenters, a NATS server and a worker each, joined by gateways (docs/datacenters.md):
{lines}
    the commands above ask {gateways.datacenters[0]}; another datacenter's callers:
    DISPENSER_NATS_URL={gateways.url_of(other)} dispenser get {DEMO_TAG} 5
    dispenser watch shows each datacenter and the fleet
"""


def datacenter_names(count: int) -> list[str]:
    """``dc-a``, ``dc-b``, … (``count`` of them, 2 to 26)."""
    if not 2 <= count <= 26:
        raise ValueError(f"--datacenters takes 2 to 26, got {count}")
    return [f"dc-{chr(ord('a') + n)}" for n in range(count)]


async def _serve_all(configs: list[Config], on_ready: Callable[[], None]) -> int:
    """Run one worker per config in this process until SIGTERM or SIGINT."""
    from dispenser.app import Worker, run_until_signal  # noqa: PLC0415

    async def start(stack: contextlib.AsyncExitStack) -> Callable[[asyncio.Event], Awaitable[None]]:
        for config in configs:
            worker = Worker(config)
            await worker.start()
            stack.push_async_callback(worker.stop)
        on_ready()

        async def serve(stop: asyncio.Event) -> None:
            await stop.wait()
            log.info("shutting down: answering requests in flight")

        return serve

    return await run_until_signal(start)


def _in_datacenter(config: Config, gateways: NatsGateways, index: int, data_dir: Path) -> Config:
    """The worker of datacenter number ``index``: its NATS server, name, snowflake worker ID and state."""
    datacenter = gateways.datacenters[index]
    state = str(data_dir / "state" / datacenter)
    snowflake = config.snowflake
    if snowflake.mode == "static":
        snowflake = msgspec.structs.replace(snowflake, worker_id=snowflake.worker_id + index)
    return msgspec.structs.replace(
        config,
        nats=msgspec.structs.replace(config.nats, url=gateways.url_of(datacenter), datacenter=datacenter),
        snowflake=msgspec.structs.replace(snowflake, state_dir=state),
        segment=msgspec.structs.replace(config.segment, state_dir=state),
        # One metrics port: the first datacenter's worker.
        metrics=config.metrics if index == 0 else msgspec.structs.replace(config.metrics, port=None),
    )


def _dev_config(
    config: Config, data_dir: Path, nats_url: str, postgres_dsn: str, broker: KafkaBroker | None
) -> Config:
    """``config`` pointed at the servers started here, with snowflake and metrics on unless configured."""
    if broker is not None:
        config = msgspec.structs.replace(
            config,
            kafka=msgspec.structs.replace(config.kafka, enabled=True, bootstrap_servers=broker.bootstrap),
        )
    # Snowflake too, with a static worker ID (no ZooKeeper needed) and its cache in the data dir,
    # unless the user configured snowflake themselves.
    snowflake = config.snowflake
    if not snowflake.enabled:
        snowflake = msgspec.structs.replace(
            snowflake, enabled=True, mode="static", state_dir=str(data_dir / "state")
        )
    metrics = config.metrics
    if metrics.port is None:  # on in dev (off by default in serve), unless the port is taken
        metrics = msgspec.structs.replace(
            metrics, port=DEV_METRICS_PORT if port_is_free(DEV_METRICS_PORT) else 0
        )
    config = msgspec.structs.replace(
        config,
        metrics=metrics,
        nats=msgspec.structs.replace(config.nats, url=nats_url),
        postgres=msgspec.structs.replace(config.postgres, dsn=postgres_dsn),
        snowflake=snowflake,
    )
    if config.segment.state_dir is None:  # the remembered grants belong to this data dir's database
        config = msgspec.structs.replace(
            config, segment=msgspec.structs.replace(config.segment, state_dir=str(data_dir / "state"))
        )
    return config


def run_dev(
    config: Config,
    data_dir: Path,
    nats_port: int = 4222,
    postgres_port: int | None = None,
    kafka_port: int | None = None,
    *,
    kafka: bool = False,
    datacenters: int = 1,
) -> int:
    """Start the servers, prepare the database, serve until Ctrl-C, then stop everything started here.

    Args:
        config: The settings (NATS and PostgreSQL addresses are replaced by the servers started here).
        data_dir: Where the servers' data lives.
        nats_port: NATS port (a free one if taken).
        postgres_port: PostgreSQL port (54329 by default, or a free one).
        kafka_port: Kafka port (9092 by default, or a free one).
        kafka: Start a Kafka broker too.
        datacenters: 2 or more: a NATS server per datacenter (free ports; ``nats_port`` is not used),
            joined by gateways, and a worker in each (in this process).

    Raises:
        DevServerError: a server could not start (for Kafka: Java or Maven missing, says which).
    """
    from dispenser.app import run_worker  # noqa: PLC0415
    from dispenser.runner import run_async  # noqa: PLC0415

    data_dir = data_dir.absolute()
    data_dir.mkdir(parents=True, exist_ok=True)
    gateways: NatsGateways | None = None
    nats: NatsServer | NatsGateways
    if datacenters > 1:
        nats = gateways = NatsGateways(data_dir / "nats", datacenter_names(datacenters))
        nats_url = gateways.url_of(gateways.datacenters[0])  # the commands of the banner ask dc-a
    else:
        nats = NatsServer(data_dir / "nats", port=nats_port if port_is_free(nats_port) else None)
        nats_url = nats.url
    if postgres_port is None:
        # A fixed port by default, so the DSN printed for `dispenser tag add` stays the same across runs.
        postgres_port = DEV_POSTGRES_PORT if port_is_free(DEV_POSTGRES_PORT) else None
    postgres = PostgresServer(data_dir / "postgres", port=postgres_port)
    broker: KafkaBroker | None = None
    if kafka:
        if kafka_port is None:
            kafka_port = DEV_KAFKA_PORT if port_is_free(DEV_KAFKA_PORT) else None
        broker = KafkaBroker(data_dir / "kafka", port=kafka_port)
    try:
        log.info("starting NATS and PostgreSQL%s in %s", " and Kafka" if broker else "", data_dir)
        nats.start()
        postgres.start()
        if broker is not None:
            broker.start()
        config = _dev_config(config, data_dir, nats_url, postgres.dsn, broker)
        asyncio.run(prepare_demo(postgres.dsn))
        _write_client_config(data_dir / "dev.toml", config)
        if gateways is not None:
            banner = _banner(config, data_dir / "dev.toml") + _datacenters_banner(gateways)
            configs = [_in_datacenter(config, gateways, n, data_dir) for n in range(datacenters)]
            return run_async(_serve_all(configs, lambda: print(banner, file=sys.stderr)))
        return run_async(
            run_worker(
                config,
                on_ready=lambda _worker: print(_banner(config, data_dir / "dev.toml"), file=sys.stderr),
            )
        )
    finally:
        (data_dir / "dev.toml").unlink(missing_ok=True)  # never point a later command at stopped servers
        if broker is not None:
            broker.stop()
        postgres.stop()
        nats.stop()
        log.info("stopped NATS and PostgreSQL%s", " and Kafka" if broker else "")
