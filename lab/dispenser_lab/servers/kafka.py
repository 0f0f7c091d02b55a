"""A real Apache Kafka broker (KRaft, one node as broker and controller) on 127.0.0.1, from Maven Central jars.

:func:`fetch_kafka_jars` fetches the jars once with the pom shipped in this package; :class:`KafkaBroker`
runs ``kafka.Kafka`` from them, plaintext and, given a :class:`SecureListener`, SASL_SSL and SSL too. Its
settings and why: ``docs/testing.md`` ("How the servers run", "Secured servers").
"""

from __future__ import annotations

import base64
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dispenser_lab.servers.kafka_markers import (
    DroppedMarkers,
    dropped_in,
    lost_markers,
    write_markers,
)
from dispenser_lab.servers.kafka_wire import metadata
from dispenser_lab.servers.maven import cache_dir, fetch_command, fetch_jars, is_complete, packaged_pom
from dispenser_lab.servers.process import LOOPBACK, ServerNotFoundError, ServerStartError, free_port
from dispenser_lab.servers.server import ServerProcess
from dispenser_lab.servers.zookeeper import find_java

__all__ = [
    "KAFKA_VERSION",
    "SCRAM_MECHANISMS",
    "KafkaBroker",
    "SecureListener",
    "fetch_kafka_jars",
    "metadata_brokers",
    "new_cluster_id",
]

KAFKA_VERSION = os.environ.get("DISPENSER_KAFKA_VERSION", "4.4.0")
"""The Kafka release to run (``DISPENSER_KAFKA_VERSION``; 3.9.x works too and picks its logging profile)."""

POM = packaged_pom("kafka")
"""The pom whose dependencies are the broker's class path: package data, in the wheel as in a checkout."""

JARS_ENV = "DISPENSER_KAFKA_JARS"
"""Environment variable naming a directory of Kafka jars to use instead of fetching."""

# C1 only (TieredStopAtLevel=1): a test broker lives seconds to minutes, too short for C2's compiles to pay
# back. Measured on the suite's Kafka tests (enrich, enrich_stop, restarts, requests; -n 2, 2 cores): 202
# CPU-seconds and 113 s before, 134 and 83 s with it.
_JVM_OPTIONS = (
    "-Xms64m",
    "-Xmx256m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-Djava.awt.headless=true",
)


def _maven_args(version: str) -> list[str]:
    args = [f"-Dkafka.version={version}"]
    if version.startswith("3."):
        args.append("-Pkafka3")  # 3.x logs through reload4j, 4.x through log4j2
    return args


def default_jar_dir(version: str = KAFKA_VERSION) -> Path:
    """``$XDG_CACHE_HOME/leaf-dispenser/kafka-<version>/`` (``~/.cache`` when the variable is unset)."""
    return cache_dir(f"kafka-{version}")


def fetch_kafka_jars(
    dest: Path | None = None, *, version: str = KAFKA_VERSION, pom: Path = POM, timeout: float = 600.0
) -> Path:
    """Download the Kafka broker jars (and a logging binding) from Maven Central, once (~45 MB, ~6 s cold).

    Raises:
        ServerNotFoundError: ``mvn`` or the pom is missing.
        DevServerError: Maven failed or took too long.
    """
    dest = default_jar_dir(version) if dest is None else Path(dest)
    return fetch_jars(
        pom,
        dest,
        what=f"Kafka {version}",
        jar_glob="kafka_2.13-*.jar",
        args=_maven_args(version),
        timeout=timeout,
    )


def _find_jars(version: str) -> Path:
    override = os.environ.get(JARS_ENV)
    if override:
        jars = Path(override)
        if not any(jars.glob("kafka_2.13-*.jar")):
            raise ServerNotFoundError(f"{JARS_ENV}={override} holds no kafka_2.13-*.jar")
        return jars
    return fetch_kafka_jars(version=version)


def new_cluster_id() -> str:
    """16 random bytes, base64url without padding; never starting with '-' (the tool would take it as an option)."""
    while True:
        cluster = base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")
        if not cluster.startswith("-"):
            return cluster


def metadata_brokers(port: int, timeout: float = 1.0) -> int | None:
    """Ask ``127.0.0.1:port`` for cluster metadata (Metadata v1, no topics); the number of live brokers.

    ``None`` when nothing answers a well-formed response. A KRaft broker lists itself only once it has
    caught up with the controller and is unfenced, which is when clients can use it.
    """
    answer = metadata(port, timeout=timeout)
    return None if answer is None else len(answer.brokers)


SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
"""The SASL mechanisms a :class:`SecureListener` enables; every user gets credentials for both."""

_SECURE = "SECURE"
"""The listener name of the SASL_SSL listener."""
_MTLS = "MTLS"
"""The listener name of the SSL listener that requires a client certificate."""
_PROXIED = "PROXIED"
"""The listener name of the plaintext listener advertised at a fault proxy's address (``proxied_at``)."""

# What StorageTool's --add-scram parser cannot take inside a value, even quoted.
_SCRAM_UNSAFE = frozenset(',[]="\\ \n')


@dataclass(frozen=True, slots=True)
class SecureListener:
    """A SASL_SSL listener beside the broker's plaintext one: TLS, then SCRAM user name and password.

    The certificate and key are PEM files (``ssl.keystore.type=PEM``: the key unencrypted, PKCS#8 as
    ``openssl req -nodes`` writes it). The users are created with ``StorageTool format --add-scram`` (KRaft
    has no ZooKeeper to hold them), so they exist from the broker's first start; a broker whose storage was
    formatted already keeps the users it was formatted with. The plaintext listener stays, for the
    harness's readiness probe and for the tests' own setup (topics, reading results back); the controller
    listener and the inter-broker traffic use it too, on 127.0.0.1 only.

    Args:
        cert: The broker's certificate chain (PEM), for 127.0.0.1.
        key: Its private key (PEM, unencrypted).
        users: User name → password, each given SCRAM-SHA-256 and SCRAM-SHA-512 credentials.
        port: The listener's port; a free one when omitted.
        client_ca: A CA (PEM): also listen with SSL on another port (``KafkaBroker.tls_bootstrap``), with the
            same certificate, for clients presenting a certificate this CA signed (and no password).
    """

    cert: Path
    key: Path
    users: Mapping[str, str] = field(default_factory=dict)
    port: int | None = None
    client_ca: Path | None = None

    def __post_init__(self) -> None:
        for name, password in self.users.items():
            if not name or not password or _SCRAM_UNSAFE & set(name + password):
                # The value itself is never shown: it is a secret.
                raise ValueError(
                    f'SCRAM user {name!r}: name and password must be non-empty, without , [ ] = " or spaces'
                )


class KafkaBroker(ServerProcess[tuple[Path, Path]]):
    """One single-node KRaft Kafka (broker and controller) on 127.0.0.1, restartable on the same ports and data.

    Example::

        with KafkaBroker(tmp_path) as broker:
            producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap)

    Args:
        workdir: Holds ``server.properties``, the logging config, the data directory ``data/`` (formatted at
            the first start, kept across restarts) and the log ``kafka.log``.
        port: Client port; a free one when omitted. The controller listener gets a free port of its own.
        version: The Kafka release (its jars are fetched with :func:`fetch_kafka_jars`).
        jars: Directory of the jars, instead of fetching them.
        config: Extra ``server.properties`` settings, written last.
        java: The ``java`` executable; :func:`~dispenser_lab.servers.zookeeper.find_java` when omitted.
        node_id: This node's ID (a member of a cluster: see
            :class:`~dispenser_lab.servers.kafka_cluster.KafkaCluster`).
        controller_port: The controller listener's port; a free one when omitted.
        voters: ``controller.quorum.voters`` of a cluster (``1@host:port,2@…``); this node alone when omitted.
        cluster_id: The cluster ID the storage is formatted with (the same for every member); random
            when omitted.
        secure: A SASL_SSL listener to add (:attr:`secure_bootstrap`), with its certificate and SCRAM users.
        proxied_at: Add a second plaintext listener for clients (on :attr:`proxied_port`) that advertises
            ``127.0.0.1:proxied_at`` instead of its own address: a fault proxy listening there, forwarding to
            :attr:`proxied_port`, then carries every connection of the clients that bootstrap through it,
            including those opened from the metadata (Kafka answers each listener's own advertised
            addresses). The brokers keep talking to each other over the plain listener, past the proxy.
        start_timeout: Seconds to wait until the broker lists itself in its metadata.
        stop_timeout: Seconds to wait after SIGTERM before SIGKILL.
    """

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        *,
        version: str = KAFKA_VERSION,
        jars: Path | None = None,
        config: Mapping[str, str] | None = None,
        java: Path | None = None,
        node_id: int = 1,
        controller_port: int | None = None,
        voters: str | None = None,
        cluster_id: str | None = None,
        secure: SecureListener | None = None,
        proxied_at: int | None = None,
        start_timeout: float = 60.0,
        stop_timeout: float = 20.0,
    ) -> None:
        self.workdir = Path(workdir)
        super().__init__(port, start_timeout=start_timeout, stop_timeout=stop_timeout)
        self.version = version
        self._jars = jars
        self.config = dict(config or {})
        self._java = java
        self.node_id = node_id
        self._auto_controller_port = controller_port is None
        self.controller_port = free_port() if controller_port is None else controller_port
        self.voters = voters
        self.cluster_id = cluster_id
        self.secure = secure
        self._auto_secure_port = secure is not None and secure.port is None
        self.secure_port = (secure.port or free_port()) if secure is not None else None
        self.tls_port = free_port() if secure is not None and secure.client_ca is not None else None
        if proxied_at is not None and secure is not None:
            raise ValueError("a broker with a SecureListener takes no proxied listener")
        self.proxied_at = proxied_at
        self.proxied_port = free_port() if proxied_at is not None else None
        """The proxied listener's own port (the proxy's upstream); ``None`` without ``proxied_at``."""
        self._repaired: set[DroppedMarkers] = set()
        self._undecided_since: dict[DroppedMarkers, float] = {}

    @property
    def bootstrap(self) -> str:
        """What clients take as ``bootstrap_servers``: ``127.0.0.1:PORT``."""
        return f"{LOOPBACK}:{self._port}"

    @property
    def secure_bootstrap(self) -> str:
        """``127.0.0.1:PORT`` of the SASL_SSL listener.

        Raises:
            ValueError: the broker has no :class:`SecureListener`.
        """
        if self.secure_port is None:
            raise ValueError("this broker has no SASL_SSL listener (pass secure=SecureListener(...))")
        return f"{LOOPBACK}:{self.secure_port}"

    @property
    def proxied_bootstrap(self) -> str:
        """``127.0.0.1:PORT`` that the proxied listener advertises (where its fault proxy listens).

        Raises:
            ValueError: the broker has no proxied listener (no ``proxied_at``).
        """
        if self.proxied_at is None:
            raise ValueError("this broker has no proxied listener (pass proxied_at=<the proxy's port>)")
        return f"{LOOPBACK}:{self.proxied_at}"

    @property
    def tls_bootstrap(self) -> str:
        """``127.0.0.1:PORT`` of the SSL listener that requires a client certificate.

        Raises:
            ValueError: the broker has no such listener (no ``SecureListener(client_ca=...)``).
        """
        if self.tls_port is None:
            raise ValueError(
                "this broker has no SSL listener (pass secure=SecureListener(..., client_ca=...))"
            )
        return f"{LOOPBACK}:{self.tls_port}"

    @property
    def data_dir(self) -> Path:
        """The log directory (kept across restarts, so topics and offsets survive them)."""
        return self.workdir / "data"

    @property
    def log_path(self) -> Path:
        """The broker's console log (WARN and above, the transaction coordinator's INFO; kept across restarts)."""
        return self.workdir / "kafka.log"

    def repair_dropped_markers(self) -> list[DroppedMarkers]:
        """Write the transaction markers this broker's coordinator dropped at a restart; return those written now.

        Kafka's own bug, on a single node killed while a transaction commits (see
        :mod:`~dispenser_lab.servers.kafka_markers`): the transaction stays open on its partitions for
        ever. Found in the broker's log, and also in its files for markers lost without a log line (a clean
        restart too: :func:`~dispenser_lab.servers.kafka_markers.lost_markers`, once undecided for
        :attr:`_LOST_AFTER` seconds). Each is repaired once, as the coordinator decided it; one whose
        partitions have no leader yet is tried again at the next call. Tests that restart a broker under
        transactions call this until their stream has gone through, as an operator would run
        ``kafka-transactions.sh``.
        """
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        written = []
        for dropped in [*dropped_in(text), *self._lost_markers(text)]:
            if dropped not in self._repaired and write_markers(self._port, dropped):
                self._repaired.add(dropped)
                written.append(dropped)
        return written

    _LOST_AFTER = 3.0
    """Seconds records must stay undecided, their transaction decided, before their markers count as lost
    (the coordinator writes them within milliseconds of deciding)."""

    def _lost_markers(self, log: str) -> list[DroppedMarkers]:
        """:func:`~dispenser_lab.servers.kafka_markers.lost_markers`, each once seen for :attr:`_LOST_AFTER`.

        ``log``: the broker's log, read (it names the coordinator's epoch).
        """
        elected = re.findall(r"Elected as the txn coordinator for partition \d+ at epoch (\d+)", log)
        if not elected or not self.data_dir.is_dir():
            return []
        now = time.monotonic()
        found = lost_markers(self.data_dir, int(elected[-1]))
        self._undecided_since = {lost: self._undecided_since.get(lost, now) for lost in found}
        return [lost for lost, since in self._undecided_since.items() if now - since >= self._LOST_AFTER]

    @property
    def _properties(self) -> Path:
        return self.workdir / "server.properties"

    def _prepare(self) -> tuple[Path, Path]:
        java = self._java if self._java is not None else find_java("Kafka needs Java 17 or later")
        jars = self._jars if self._jars is not None else _find_jars(self.version)
        self.workdir.mkdir(parents=True, exist_ok=True)
        return java, jars

    def _write_config(self) -> None:
        controller = f"{LOOPBACK}:{self.controller_port}"
        settings = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters or f"{self.node_id}@{controller}",
            "listeners": f"PLAINTEXT://{self.bootstrap},CONTROLLER://{controller}",
            "advertised.listeners": f"PLAINTEXT://{self.bootstrap}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.data_dir.resolve()),
            "num.partitions": "1",
            "default.replication.factor": "1",
            "min.insync.replicas": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "1",
            "group.initial.rebalance.delay.ms": "0",
            "group.min.session.timeout.ms": "500",
            "auto.create.topics.enable": "false",
            # The cleaner's buffer comes out of the heap; the default 128 MiB does not fit a small one.
            "log.cleaner.dedupe.buffer.size": "16777216",
            # A killed broker's registration stays live in the controller's metadata until its session
            # times out, and until then the restarted broker cannot register: 9 s by default made a start
            # after kill() take ~12 s instead of ~2 s. The heartbeat stays well inside the shorter session.
            "broker.session.timeout.ms": "3000",
            "broker.heartbeat.interval.ms": "500",
        }
        if not self.version.startswith("3."):
            settings["share.coordinator.state.topic.replication.factor"] = "1"
            settings["share.coordinator.state.topic.min.isr"] = "1"
        if self.secure is not None:
            settings |= self._secure_settings(self.secure, controller)
        if self.proxied_at is not None:
            settings |= {
                "listeners": f"PLAINTEXT://{self.bootstrap},{_PROXIED}://{LOOPBACK}:{self.proxied_port},"
                f"CONTROLLER://{controller}",
                "advertised.listeners": f"PLAINTEXT://{self.bootstrap},{_PROXIED}://{LOOPBACK}:{self.proxied_at}",
                "listener.security.protocol.map": f"PLAINTEXT:PLAINTEXT,{_PROXIED}:PLAINTEXT,CONTROLLER:PLAINTEXT",
            }
        settings |= self.config
        self._properties.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))

    def _secure_settings(self, secure: SecureListener, controller: str) -> dict[str, str]:
        """The SASL_SSL (and SSL) listener: addresses, PEM keystore (and truststore), SCRAM.

        The controller and inter-broker listeners stay PLAINTEXT on 127.0.0.1: securing them tests nothing
        of the dispenser's, and the plaintext client listener keeps the readiness probe (a raw Metadata
        request) as it is for the plain broker.
        """
        # Kafka's PEM keystore is one file holding the private key and then the certificate chain.
        keystore = self.workdir / "secure-keystore.pem"
        keystore.write_text(Path(secure.key).read_text() + Path(secure.cert).read_text())
        keystore.chmod(0o600)
        prefix = f"listener.name.{_SECURE.lower()}"
        advertised = [f"PLAINTEXT://{self.bootstrap}", f"{_SECURE}://{self.secure_bootstrap}"]
        protocols = ["PLAINTEXT:PLAINTEXT", f"{_SECURE}:SASL_SSL", "CONTROLLER:PLAINTEXT"]
        settings = {
            f"{prefix}.ssl.keystore.type": "PEM",
            f"{prefix}.ssl.keystore.location": str(keystore.resolve()),
            f"{prefix}.sasl.enabled.mechanisms": ",".join(SCRAM_MECHANISMS),
        }
        for mechanism in SCRAM_MECHANISMS:
            settings[f"{prefix}.{mechanism.lower()}.sasl.jaas.config"] = (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            )
        if secure.client_ca is not None:
            mtls = f"listener.name.{_MTLS.lower()}"
            advertised.append(f"{_MTLS}://{self.tls_bootstrap}")
            protocols.append(f"{_MTLS}:SSL")
            settings |= {
                f"{mtls}.ssl.keystore.type": "PEM",
                f"{mtls}.ssl.keystore.location": str(keystore.resolve()),
                f"{mtls}.ssl.truststore.type": "PEM",
                f"{mtls}.ssl.truststore.location": str(Path(secure.client_ca).resolve()),
                f"{mtls}.ssl.client.auth": "required",
            }
        settings |= {
            "listeners": ",".join([*advertised, f"CONTROLLER://{controller}"]),
            "advertised.listeners": ",".join(advertised),
            "listener.security.protocol.map": ",".join(protocols),
        }
        return settings

    def _logging_options(self) -> list[str]:
        if self.version.startswith("3."):
            path = self.workdir / "log4j.properties"
            path.write_text(
                "log4j.rootLogger=WARN, stdout\n"
                "log4j.appender.stdout=org.apache.log4j.ConsoleAppender\n"
                "log4j.appender.stdout.layout=org.apache.log4j.PatternLayout\n"
                "log4j.appender.stdout.layout.ConversionPattern=%d %p %c: %m%n\n"
            )
            return [f"-Dlog4j.configuration=file:{path.resolve()}"]
        path = self.workdir / "log4j2.properties"
        path.write_text(
            # Status "error": at each stop log4j2 warns that it cannot register its shutdown hook (harmless).
            "status = error\n"
            "appender.out.type = Console\n"
            "appender.out.name = OUT\n"
            "appender.out.layout.type = PatternLayout\n"
            "appender.out.layout.pattern = %d %p %c: %m%n\n"
            "rootLogger.level = warn\n"
            "rootLogger.appenderRef.out.ref = OUT\n"
            # The transaction coordinator's INFO lines (loading its log, markers retried or dropped) are few
            # and are what explains a transaction left undecided after a restart (docs/kafka.md).
            "logger.txn.name = kafka.coordinator.transaction\n"
            "logger.txn.level = info\n"
            "logger.txncoord.name = org.apache.kafka.coordinator.transaction\n"
            "logger.txncoord.level = info\n"
        )
        return [f"-Dlog4j2.configurationFile={path.resolve()}"]

    def _launch(self, java_and_jars: tuple[Path, Path], offset: int) -> None:
        java, jars = java_and_jars
        if not self._ever_started and self._auto_controller_port:
            # Until the first start, both ports are ours to re-pick (the base class re-picks the client one).
            self.controller_port = free_port()
        if not self._ever_started and self.proxied_port is not None:
            self.proxied_port = free_port()
        if not self._ever_started and self._auto_secure_port:
            self.secure_port = free_port()
            if self.tls_port is not None:
                self.tls_port = free_port()
        self._write_config()
        base = [str(java), *_JVM_OPTIONS, *self._logging_options(), "-cp", str(jars.resolve() / "*")]
        if not (self.data_dir / "meta.properties").exists():
            self._format(base)
        self._spawn(
            [*base, "kafka.Kafka", str(self._properties.resolve())],
            offset=offset,
            cwd=self.workdir,
            what=f"Kafka {self.version} on {self.bootstrap}",
        )

    def _format(self, base: list[str]) -> None:
        """Format the storage directory for a new single-node cluster (once: restarts keep the data)."""
        cmd = [
            *base,
            "kafka.tools.StorageTool",
            "format",
            "-t",
            self.cluster_id or new_cluster_id(),
            "-c",
            str(self._properties.resolve()),
        ]
        users = self.secure.users if self.secure is not None else {}
        for name, password in users.items():
            for mechanism in SCRAM_MECHANISMS:
                cmd += ["--add-scram", f"{mechanism}=[name={name},password={password}]"]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=self.start_timeout, cwd=self.workdir, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise ServerStartError(f"formatting Kafka's storage took over {self.start_timeout:g} s") from exc
        if done.returncode != 0:
            output = (done.stdout + done.stderr)[-3000:]
            for password in users.values():
                output = output.replace(password, "***")
            raise ServerStartError(
                f"formatting Kafka's storage failed (exit status {done.returncode}): {output}"
            )

    def _ready(self, proc: subprocess.Popen[bytes], offset: int) -> bool:
        answer = metadata(self._port, timeout=1.0)
        return answer is not None and self.node_id in answer.brokers

    def __repr__(self) -> str:
        secure = f", secure_bootstrap={self.secure_bootstrap!r}" if self.secure is not None else ""
        if self.tls_port is not None:
            secure += f", tls_bootstrap={self.tls_bootstrap!r}"
        return f"KafkaBroker(bootstrap={self.bootstrap!r}{secure}, version={self.version!r}, pid={self.pid})"


def main(argv: list[str] | None = None) -> int:
    """``python -m dispenser_lab.servers.kafka [DEST]``: fetch the jars (once) and print where they are."""
    return fetch_command(
        sys.argv[1:] if argv is None else argv,
        what=f"Apache Kafka {KAFKA_VERSION}",
        default=default_jar_dir(),
        pending=lambda target: POM.is_file() and not is_complete(target, POM, _maven_args(KAFKA_VERSION)),
        fetch=fetch_kafka_jars,
    )


if __name__ == "__main__":
    sys.exit(main())
