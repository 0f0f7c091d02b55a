"""Connecting to Kafka: client options from the configuration (servers, SASL, TLS), topics, the headers we speak.

The request/reply headers are those of Spring for Apache Kafka's ``ReplyingKafkaTemplate``
(``kafka_replyTopic``, ``kafka_replyPartition``, ``kafka_correlationId``), so a Java service asks with no
custom code. aiokafka's exceptions are converted here and in the modules built on it (the services
:mod:`~dispenser.adapters.kafka.requests` and :mod:`~dispenser.adapters.kafka.enrich`, the client's
:mod:`~dispenser.adapters.kafka.client_transport`, the rate events of :mod:`~dispenser.adapters.kafka.rates`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.conn import AIOKafkaConnection
from aiokafka.errors import (
    IllegalSaslStateError,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)

from dispenser.adapters.kafka.headers import CONTENT_TYPE, CORRELATION_ID, REPLY_PARTITION, REPLY_TOPIC
from dispenser.config import KafkaConfig

__all__ = [
    "CONTENT_TYPE",
    "CORRELATION_ID",
    "DEFAULT_REPLICATION_FACTOR",
    "REPLY_PARTITION",
    "REPLY_TOPIC",
    "Headers",
    "KafkaAuthenticationFailed",
    "KafkaSecurityError",
    "KafkaTlsFailed",
    "check_security",
    "client_options",
    "decode_partition",
    "encode_partition",
    "ensure_topics",
    "header",
    "topic_partitions",
]

log = logging.getLogger(__name__)


Headers = Sequence[tuple[str, bytes]]
"""Record headers as aiokafka gives and takes them."""

_TOPIC_ALREADY_EXISTS = 36


def header(headers: Headers, name: str) -> bytes | None:
    """The last value of header ``name`` (case-insensitive, as HTTP-minded clients expect), or ``None``."""
    found = None
    lowered = name.lower()
    for key, value in headers:
        if key == name or key.lower() == lowered:
            found = value
    return found


def decode_partition(raw: bytes) -> int | None:
    """Read a ``kafka_replyPartition`` value: Spring's 4-byte big-endian int, or ASCII digits.

    Returns ``None`` when the value is neither (the reply then goes to the partition Kafka picks).
    """
    if raw.isdigit():
        return int(raw)
    if len(raw) == 4:
        value = int.from_bytes(raw, "big", signed=True)
        return value if value >= 0 else None
    return None


def encode_partition(partition: int) -> bytes:
    """A ``kafka_replyPartition`` value as Spring writes it."""
    return partition.to_bytes(4, "big", signed=True)


class KafkaSecurityError(ConnectionRefusedError):
    """Kafka refused this client's security settings: no retry helps until the settings are fixed.

    An :class:`OSError` (as every "cannot reach Kafka"), so callers that handle an unreachable cluster
    handle this too; the message is one line naming the setting to check, never a secret.
    """

    code = "kafka_security"
    retryable = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class KafkaAuthenticationFailed(KafkaSecurityError):
    """The broker refused the SASL user name and password, the mechanism, or SASL itself (a listener without it)."""

    code = "kafka_authentication_failed"


class KafkaTlsFailed(KafkaSecurityError):
    """The TLS settings do not work: the broker's certificate is untrusted or names another host.

    Also when the broker refuses this client's certificate (or wants one), the port does not speak TLS, or
    the configured CA, certificate or key cannot be read.
    """

    code = "kafka_tls_failed"


def _ssl_context(config: KafkaConfig) -> ssl.SSLContext | None:
    if config.security_protocol not in ("SSL", "SASL_SSL"):
        return None
    try:
        context = ssl.create_default_context(cafile=config.ssl_ca)
    except (OSError, ssl.SSLError) as exc:
        raise KafkaTlsFailed(f"cannot load kafka.ssl_ca {config.ssl_ca}: {_reason(exc)}") from exc
    if config.ssl_cert:
        try:
            context.load_cert_chain(config.ssl_cert, config.ssl_key)
        except (OSError, ssl.SSLError) as exc:
            raise KafkaTlsFailed(
                f"cannot load kafka.ssl_cert {config.ssl_cert} / kafka.ssl_key {config.ssl_key}: {_reason(exc)}"
            ) from exc
    return context


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return str(exc.verify_message)
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def client_options(config: KafkaConfig) -> dict[str, Any]:
    """Keyword arguments every aiokafka client takes: servers, client id, security, timeouts.

    Raises:
        KafkaTlsFailed: the configured CA, certificate or key cannot be read.
    """
    options: dict[str, Any] = {
        "bootstrap_servers": _servers(config),
        "client_id": config.client_id,
        "security_protocol": config.security_protocol,
        "request_timeout_ms": config.request_timeout_ms,
        "retry_backoff_ms": config.retry_backoff_ms,
    }
    context = _ssl_context(config)
    if context is not None:
        options["ssl_context"] = context
    if config.security_protocol.startswith("SASL"):
        options["sasl_mechanism"] = config.sasl_mechanism
        options["sasl_plain_username"] = config.sasl_username
        options["sasl_plain_password"] = config.sasl_password
    return options


def _servers(config: KafkaConfig) -> list[str]:
    return [s.strip() for s in config.bootstrap_servers.split(",") if s.strip()]


_CHECK_TIMEOUT_MS: Final = 5_000
"""How long :func:`check_security` waits for one server (a silent one is an outage, left to the clients)."""


async def check_security(config: KafkaConfig) -> None:
    """Open one connection as the clients would and fail clearly if Kafka refuses the security settings.

    aiokafka logs such a refusal and then reports only "Unable to bootstrap"; so before the first client
    starts, this connects to the bootstrap servers in turn (TLS handshake, SASL authentication) until one
    accepts. A refusal of the settings ends it at once, as :class:`KafkaSecurityError`; a server that is
    down or silent is left to the clients, which wait for it or report it as they do for any outage.
    A no-op with ``PLAINTEXT``, which has nothing to refuse.

    Raises:
        KafkaAuthenticationFailed: wrong user name or password, or a mechanism the broker does not offer.
        KafkaTlsFailed: the broker's certificate is not trusted or names another host, the broker refused
            this client's certificate (or wanted one), the port does not speak TLS, or the CA, certificate
            or key cannot be read.
    """
    if config.security_protocol == "PLAINTEXT":
        return
    options = client_options(config)
    for server in options["bootstrap_servers"]:
        host, _, port = server.rpartition(":")
        try:
            conn = AIOKafkaConnection(
                host.strip("[]"),
                int(port),
                client_id=config.client_id,
                request_timeout_ms=min(config.request_timeout_ms, _CHECK_TIMEOUT_MS),
                ssl_context=options.get("ssl_context"),
                security_protocol=config.security_protocol,
                sasl_mechanism=options.get("sasl_mechanism"),
                sasl_plain_username=options.get("sasl_plain_username"),
                sasl_plain_password=options.get("sasl_plain_password"),
            )
        except ValueError as exc:
            log.debug("security check: cannot connect to %s (%s); trying the next server", server, exc)
            continue
        try:
            await conn.connect()
        except (KafkaError, OSError, TimeoutError, ValueError) as exc:
            if isinstance(exc, KafkaError):
                # Refused after the connection was made: connect() closed it without waiting, and a
                # transport still closing when the loop ends is never closed (a ResourceWarning later).
                await _closed(conn)
            error = _security_error(config, server, exc)
            if error is not None:
                raise error from exc
            log.debug("security check: %s did not answer (%s); trying the next server", server, exc)
            continue
        await _closed(conn)
        return


async def _closed(conn: AIOKafkaConnection) -> None:
    """Close ``conn`` and wait (boundedly) until its transport has closed (TLS: after the shutdown exchange)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(conn.close(), _CHECK_TIMEOUT_MS / 1000)


def _security_error(config: KafkaConfig, where: str, exc: BaseException) -> KafkaSecurityError | None:
    """What ``exc``, from connecting to ``where``, says about the security settings; ``None``: an outage."""
    tls = config.security_protocol in ("SSL", "SASL_SSL")
    if isinstance(exc, SaslAuthenticationFailed):
        return KafkaAuthenticationFailed(
            f"Kafka authentication failed for user {config.sasl_username!r} at {where} "
            f"({config.sasl_mechanism} over {config.security_protocol}): check kafka.sasl_username "
            "and kafka.sasl_password"
        )
    if isinstance(exc, IllegalSaslStateError):  # what a listener without SASL answers a SASL handshake with
        return KafkaAuthenticationFailed(
            f"Kafka at {where} does not take SASL authentication (is it a {config.security_protocol} "
            "listener? kafka.security_protocol)"
        )
    if isinstance(exc, UnsupportedSaslMechanismError):
        return KafkaAuthenticationFailed(
            f"Kafka at {where} does not accept SASL mechanism {config.sasl_mechanism} (kafka.sasl_mechanism)"
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        trusted = (
            f"kafka.ssl_ca {config.ssl_ca}" if config.ssl_ca else "the system's CAs (kafka.ssl_ca unset)"
        )
        return KafkaTlsFailed(
            f"Kafka TLS certificate verification failed at {where}: {_reason(exc)} (trusting {trusted})"
        )
    if isinstance(exc, ssl.SSLError):
        return KafkaTlsFailed(
            f"TLS handshake with Kafka at {where} failed: {_reason(exc)} "
            f"(is it a {config.security_protocol} listener?)"
        )
    if isinstance(exc, ConnectionResetError) and tls:
        # A plaintext listener drops a TLS ClientHello (a malformed request to it) mid-handshake.
        return KafkaTlsFailed(
            f"Kafka at {where} closed the connection during the TLS handshake "
            f"(is it a {config.security_protocol} listener?)"
        )
    alert = exc.__cause__ or exc.__context__
    if isinstance(exc, KafkaConnectionError) and isinstance(alert, ssl.SSLError):
        # The broker's TLS alert after the handshake (TLS 1.3): it refused our certificate, or its absence.
        return KafkaTlsFailed(_certificate_refused(config, where, alert))
    return None


def _certificate_refused(config: KafkaConfig, where: str, alert: ssl.SSLError) -> str:
    if config.ssl_cert:
        return f"Kafka at {where} refused this client's certificate kafka.ssl_cert {config.ssl_cert}: {_reason(alert)}"
    return (
        f"Kafka at {where} refused the TLS connection: {_reason(alert)} (does it require a client certificate? "
        "kafka.ssl_cert and kafka.ssl_key are unset)"
    )


def _admin_options(config: KafkaConfig) -> dict[str, Any]:
    # The admin client takes no retry_backoff_ms.
    return {k: v for k, v in client_options(config).items() if k != "retry_backoff_ms"}


async def ensure_topics(config: KafkaConfig, topics: Mapping[str, int]) -> list[str]:
    """Create the topics that do not exist yet (name → partitions); returns the names created.

    Their replication factor is ``config.replication_factor``, or when unset the smaller of 3 and the number of
    brokers the cluster has now.

    Raises:
        OSError: the cluster could not be reached, or refused a topic for another reason than that it
            exists already (the message says which and why).
    """
    return await _with_admin(config, lambda admin: _ensure_topics(admin, config, topics))


async def _ensure_topics(
    admin: AIOKafkaAdminClient, config: KafkaConfig, topics: Mapping[str, int]
) -> list[str]:
    existing = set(await admin.list_topics())
    missing = {name: partitions for name, partitions in topics.items() if name not in existing}
    if not missing:
        return []
    factor = config.replication_factor or await _default_replication_factor(admin)
    wanted = [
        NewTopic(name, num_partitions=partitions, replication_factor=factor)
        for name, partitions in missing.items()
    ]
    response = await admin.create_topics(wanted)
    created = []
    # create_topics answers errors per topic instead of raising (KAFKA.md gotcha 6).
    for name, code, *rest in response.topic_errors:
        if code == 0:
            created.append(name)
        elif code != _TOPIC_ALREADY_EXISTS:
            message = rest[0] if rest and rest[0] else f"error code {code}"
            raise OSError(f"Kafka refused to create topic {name!r}: {message}")
    if created:
        log.info("created Kafka topic(s) %s (replication factor %d)", ", ".join(created), factor)
    return created


_ADMIN_RETRY_SECONDS: Final = 40.0
"""How long an admin call that reached the cluster retries a retriable error: past the default broker
session (9 s), during which the metadata still names a broker that has just died, and past a few request
timeouts more for a broker that hangs (any request of an attempt may go to it until it is fenced, and a
hung controller holds the creations the brokers forward to it: 20 s was too short in 1 of 11 freezes)."""
_ADMIN_REQUEST_TIMEOUT_MS: Final = 5_000
"""An admin request's own limit: aiokafka waits this long for the node it picked (the dead one, if its
metadata says so) to be ready, before a new client asks again."""

_T = TypeVar("_T")


async def _with_admin(config: KafkaConfig, work: Callable[[AIOKafkaAdminClient], Awaitable[_T]]) -> _T:
    """Run ``work`` on a fresh admin client, again on a new one after a retriable error.

    A cluster that cannot be reached at all fails at once. One that answers but whose metadata still lists a
    broker that has just died (until the broker's session times out) sends some requests there and gets
    ``NodeNotReadyError``; a new client, bootstrapped from the live brokers, asks again.

    Each attempt starts its bootstrap at the next of the configured servers: aiokafka tries them in the
    given order, and a frozen one (it accepts connections and answers nothing) first in the list cost every
    attempt a whole request timeout before the next server was asked.

    Raises:
        OSError: the cluster could not be reached, or the error persisted (or was not retriable).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _ADMIN_RETRY_SECONDS
    options = _admin_options(config)
    options["request_timeout_ms"] = min(config.request_timeout_ms, _ADMIN_REQUEST_TIMEOUT_MS)
    servers: list[str] = options["bootstrap_servers"]
    first = 0
    while True:
        options["bootstrap_servers"] = servers[first:] + servers[:first]
        first = (first + 1) % max(1, len(servers))
        admin = AIOKafkaAdminClient(**options)
        reached = False
        try:
            await admin.start()
            reached = True
            return await work(admin)
        except (KafkaError, TimeoutError) as exc:
            retriable = isinstance(exc, (TimeoutError, KafkaTimeoutError)) or getattr(exc, "retriable", False)
            if not (reached and retriable) or loop.time() > deadline:
                reason = exc or type(exc).__name__
                raise OSError(f"cannot reach Kafka at {config.bootstrap_servers}: {reason}") from exc
            log.info("Kafka admin request failed (%s); asking again", exc or type(exc).__name__)
        finally:
            await admin.close()
        await asyncio.sleep(0.2)


DEFAULT_REPLICATION_FACTOR: Final = 3
"""The replication factor of created topics on a cluster of three or more brokers (``kafka.replication_factor``
unset): one broker may fail, and with ``min.insync.replicas=2`` on the cluster an acknowledged write is on two."""


async def _default_replication_factor(admin: AIOKafkaAdminClient) -> int:
    """``min(3, live brokers)``: 3 on a cluster, 1 on a single (dev) broker."""
    brokers = (await admin.describe_cluster()).get("brokers") or []
    return max(1, min(DEFAULT_REPLICATION_FACTOR, len(brokers)))


_NEW_TOPIC_SECONDS: Final = 2.0
"""How long :func:`topic_partitions` asks again about a topic the cluster says it does not have: one just
created reaches the brokers' metadata a moment after the creation is answered, and the describe request
goes to any broker (twice in a row, under load, the enricher's start asked one that did not know its new
output topic yet)."""


async def topic_partitions(config: KafkaConfig, topic: str) -> int:
    """How many partitions ``topic`` has.

    Raises:
        OSError: the cluster could not be reached, or has no such topic (still so after
            :data:`_NEW_TOPIC_SECONDS`).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _NEW_TOPIC_SECONDS
    while True:
        described = await _with_admin(config, lambda admin: admin.describe_topics([topic]))
        for entry in described:
            if entry.get("topic") == topic and entry.get("error_code", 0) == 0 and entry.get("partitions"):
                return len(entry["partitions"])
        if loop.time() >= deadline:
            raise OSError(f"Kafka topic {topic!r} does not exist on {config.bootstrap_servers}")
        await asyncio.sleep(0.2)
