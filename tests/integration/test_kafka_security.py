"""Kafka with SASL/SCRAM over TLS against a real secured broker: serve, enrich, the Python client and ``check``.

Everything is configured as a user would, through ``DISPENSER_KAFKA_*`` variables. A wrong password, a CA
that did not sign the broker's certificate, or a TLS client at a plaintext port fails in one clear line,
with no traceback and no password; the suite's secret scan reads every log (the workers' and the broker's).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import msgspec
import pytest

from dispenser.adapters.kafka.connection import KafkaAuthenticationFailed, KafkaTlsFailed
from dispenser.cli import main
from dispenser.client import KafkaIdClient
from dispenser.config import KafkaConfig, load_config
from dispenser_lab.servers.kafka import SCRAM_MECHANISMS, KafkaBroker, SecureListener
from tests.conftest import _running
from tests.integration.kafka_support import (
    DispenserProcess,
    Header,
    TopicReader,
    create_topics,
    kafka_env,
    produce,
    unique,
)
from tests.integration.tls_support import Pki, make_pki
from tests.secret_values import SECRETS

pytestmark = [pytest.mark.kafka]

USER = "leaf-dispenser"
PASSWORD = SECRETS["kafka_scram_password"]
WRONG_PASSWORD = SECRETS["kafka_wrong_password"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A test CA, a broker certificate it signed for 127.0.0.1, and an unrelated CA."""
    return make_pki(tmp_path_factory.mktemp("kafka-pki"))


@pytest.fixture(scope="module")
def secure_kafka(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[KafkaBroker]:
    """A broker with a SASL_SSL listener (SCRAM-SHA-256 and -512, user ``USER``) beside its plaintext one.

    And an SSL listener that requires a client certificate signed by the test CA.
    """
    listener = SecureListener(cert=pki.cert, key=pki.key, users={USER: PASSWORD}, client_ca=pki.ca)
    yield from _running(KafkaBroker(tmp_path_factory.mktemp("kafka-secure"), secure=listener))


@pytest.mark.parametrize("password", ["with,comma", "with space", "with]bracket", ""])
def test_the_kit_refuses_a_password_its_format_tool_cannot_take(password: str, pki: Pki) -> None:
    """SecureListener checks names and passwords up front, without showing the password."""
    with pytest.raises(ValueError, match="SCRAM user 'leaf'") as caught:
        SecureListener(cert=pki.cert, key=pki.key, users={"leaf": password})
    assert not password or password not in str(caught.value)


def secure_env(
    broker: KafkaBroker,
    ca: Path,
    *,
    password: str = PASSWORD,
    mechanism: str = "SCRAM-SHA-512",
    bootstrap: str | None = None,
    **settings: object,
) -> dict[str, str]:
    """``DISPENSER_*`` variables for a Kafka-only process on the broker's SASL_SSL listener."""
    return kafka_env(
        bootstrap or broker.secure_bootstrap,
        None,
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism=mechanism,
        kafka_sasl_username=USER,
        kafka_sasl_password=password,
        kafka_ssl_ca=ca,
        **settings,
    )


def snowflake_env(state_dir: Path, worker_id: int) -> dict[str, str]:
    """A static snowflake generator: no PostgreSQL or ZooKeeper needed."""
    return {
        "DISPENSER_SNOWFLAKE_ENABLED": "true",
        "DISPENSER_SNOWFLAKE_WORKER_ID": str(worker_id),
        "DISPENSER_SNOWFLAKE_STATE_DIR": str(state_dir),
    }


def assert_no_password(text: str) -> None:
    """Neither the right nor the wrong password, and no traceback."""
    assert PASSWORD not in text
    assert WRONG_PASSWORD not in text
    assert "Traceback" not in text


async def five_ids(kafka: KafkaConfig) -> list[int]:
    """Five snowflake IDs of tag ``order`` from a KafkaIdClient of its own."""
    async with KafkaIdClient(kafka, timeout=20.0) as client:
        return await client.ids("order", 5, kind="snowflake")


async def test_serve_answers_the_python_client_and_get_over_sasl_ssl(
    secure_kafka: KafkaBroker, pki: Pki, tmp_path: Path
) -> None:
    """``dispenser serve`` on the SASL_SSL listener answers KafkaIdClient (SCRAM-SHA-512 and -256) and ``get``."""
    env = secure_env(
        secure_kafka,
        pki.ca,
        kafka_enabled=True,
        kafka_request_topic=unique("requests"),
        kafka_reply_topic=unique("replies"),
        kafka_group_id=unique("group"),
        rate_interval=0.5,
        rate_kafka_topic=unique("rate"),
        # Everything, aiokafka's debug lines included, goes to the log the secret scan reads.
        log_level="DEBUG",
    ) | snowflake_env(tmp_path / "serve-state", worker_id=11)
    worker = DispenserProcess(["serve"], env, tmp_path / "serve.log")
    worker.start()
    try:
        await worker.wait_for_line("serving ID requests from Kafka topic")
        seen: set[int] = set()
        for mechanism in SCRAM_MECHANISMS:
            kafka = load_config(environ=env | {"DISPENSER_KAFKA_SASL_MECHANISM": mechanism}).kafka
            # On asyncio's loop, as the commands run with TLS to Kafka: this test's loop is uvloop, which
            # closes a TLS consumer in 30 s about every other time (dispenser.runner.run_async).
            ids = await asyncio.to_thread(asyncio.run, five_ids(kafka))
            assert len(ids) == 5
            assert not seen & set(ids)
            seen |= set(ids)
        got = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "dispenser", "get", "--via", "kafka", "--kind", "snowflake", "order", "3"],
            env=os.environ | env | {"DISPENSER_LOG_LEVEL": "WARNING"},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert got.returncode == 0, got.stderr
        ids = [int(line) for line in got.stdout.split()]
        assert len(ids) == 3
        assert not seen & set(ids)
        assert_no_password(got.stdout + got.stderr)
    finally:
        status = worker.stop()
    log = worker.log()
    assert status == 0, log[-3000:]
    assert f"Authenticated as {USER} via SCRAM-SHA-512" in log  # aiokafka's line: SASL was used
    assert_no_password(log)


async def test_enrich_over_sasl_ssl_exactly_once(secure_kafka: KafkaBroker, pki: Pki, tmp_path: Path) -> None:
    """``dispenser enrich`` on the SASL_SSL listener: each of 40 records comes out once, with a unique ID."""
    plain = secure_kafka.bootstrap  # the test's own setup and read-back; the enricher sees only SASL_SSL
    topic_in, topic_out = unique("secure.in"), unique("secure.out")
    await create_topics(plain, {topic_in: 2, topic_out: 2, f"{topic_in}.dlq": 2})
    records: list[tuple[int, bytes | None, bytes | None, list[Header]]] = [
        (i % 2, f"k{i}".encode(), json.dumps({"n": i}).encode(), []) for i in range(40)
    ]
    await produce(plain, topic_in, records)
    env = secure_env(secure_kafka, pki.ca) | snowflake_env(tmp_path / "enrich-state", worker_id=12)
    args = ["enrich", "--in", topic_in, "--out", topic_out, "--tag", "order", "--kind", "snowflake"]
    args += ["--field", "id", "--group", unique("secure-enrich")]
    async with TopicReader(plain, topic_out) as out:
        enricher = DispenserProcess(args, env | {"DISPENSER_LOG_LEVEL": "INFO"}, tmp_path / "enrich.log")
        enricher.start()
        try:
            outputs = await out.wait_for(40, timeout=60)
        finally:
            status = enricher.stop()
    log = enricher.log()
    assert status == 0, log[-3000:]
    documents = [json.loads(record.value or b"") for record in outputs]
    assert sorted(d["n"] for d in documents) == list(range(40))
    assert len({d["id"] for d in documents}) == 40
    assert_no_password(log)


def test_check_passes_over_sasl_ssl(
    secure_kafka: KafkaBroker,
    pki: Pki,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``dispenser check`` reaches the request topic through the SASL_SSL listener, set up as docs/security.md shows.

    The settings in a TOML file, the password in the environment.
    """
    topic = unique("requests")
    asyncio.run(create_topics(secure_kafka.bootstrap, {topic: 3}))
    config = tmp_path / "dispenser.toml"
    config.write_text(
        "[nats]\nenabled = false\n[segment]\nenabled = false\n"
        "[kafka]\n"
        "enabled = true\n"
        f'bootstrap_servers = "{secure_kafka.secure_bootstrap}"\n'
        'security_protocol = "SASL_SSL"\n'
        'sasl_mechanism = "SCRAM-SHA-512"\n'
        f'sasl_username = "{USER}"\n'
        f'ssl_ca = "{pki.ca}"\n'
        f'request_topic = "{topic}"\n'
    )
    monkeypatch.setenv("DISPENSER_KAFKA_SASL_PASSWORD", PASSWORD)
    assert main(["--config", str(config), "check"]) == 0
    output = capsys.readouterr()
    text = output.out + output.err
    assert f"ok   kafka: {secure_kafka.secure_bootstrap} (request topic {topic!r}: 3 partitions)" in text, (
        text
    )
    assert_no_password(text)


COMMANDS = {
    "serve": ["serve"],
    "check": ["check"],
    "get": ["get", "--via", "kafka", "--kind", "snowflake", "order"],
    "enrich": ["enrich", "--in", "absent-in", "--out", "absent-out", "--tag", "order", "--kind", "snowflake"],
}
"""The commands that connect to Kafka, as a user runs them (topics need not exist: the connection fails first)."""


def run_failing(
    command: str, env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> str:
    """Run ``dispenser <command>`` in this process with ``env``; it must exit 1. Its stdout and stderr."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    assert main(COMMANDS[command]) == 1
    assert time.monotonic() - started < 15  # at once, not after retries or a timeout
    output = capsys.readouterr()
    return output.out + output.err


def lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle.lower() in line.lower()]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_wrong_password_fails_in_one_line(
    command: str,
    *,
    secure_kafka: KafkaBroker,
    pki: Pki,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A wrong SCRAM password: exit 1 and one line naming the user and the server, without either password."""
    env = secure_env(secure_kafka, pki.ca, password=WRONG_PASSWORD, kafka_enabled=True)
    env |= snowflake_env(tmp_path / "state", worker_id=13)
    text = run_failing(command, env, monkeypatch, capsys)
    expected = f"Kafka authentication failed for user {USER!r} at {secure_kafka.secure_bootstrap}"
    assert len(lines_with(text, expected)) == 1, text
    assert len(lines_with(text, "authentication failed")) == 1, text  # aiokafka's own lines are not shown
    assert "SCRAM-SHA-512 over SASL_SSL" in lines_with(text, expected)[0]
    assert_no_password(text)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_wrong_ca_fails_in_one_line(
    command: str,
    *,
    secure_kafka: KafkaBroker,
    pki: Pki,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Trusting a CA that did not sign the broker's certificate: exit 1 and one line saying so."""
    env = secure_env(secure_kafka, pki.other_ca, kafka_enabled=True)
    env |= snowflake_env(tmp_path / "state", worker_id=14)
    text = run_failing(command, env, monkeypatch, capsys)
    expected = f"Kafka TLS certificate verification failed at {secure_kafka.secure_bootstrap}"
    assert len(lines_with(text, expected)) == 1, text
    assert len(lines_with(text, "certificate verif")) == 1, text
    assert f"kafka.ssl_ca {pki.other_ca}" in lines_with(text, expected)[0]
    assert_no_password(text)


@pytest.mark.parametrize(
    ("protocol", "expected"),
    [
        ("SASL_SSL", "closed the connection during the TLS handshake (is it a SASL_SSL listener?)"),
        ("SASL_PLAINTEXT", "does not take SASL authentication (is it a SASL_PLAINTEXT listener?"),
    ],
)
def test_the_wrong_listener_fails_in_one_line(
    protocol: str,
    expected: str,
    *,
    secure_kafka: KafkaBroker,
    pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """TLS or SASL settings pointed at a plaintext listener: one line saying which, not a hang or a retry."""
    env = secure_env(secure_kafka, pki.ca, bootstrap=secure_kafka.bootstrap, kafka_enabled=True)
    env["DISPENSER_KAFKA_SECURITY_PROTOCOL"] = protocol
    text = run_failing("check", env, monkeypatch, capsys)
    assert len(lines_with(text, f"Kafka at {secure_kafka.bootstrap} {expected}")) == 1, text
    assert_no_password(text)


def test_a_mechanism_the_broker_does_not_offer_fails_in_one_line(
    secure_kafka: KafkaBroker, pki: Pki, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SASL PLAIN against a listener that offers SCRAM only: one line naming the mechanism and the setting."""
    env = secure_env(secure_kafka, pki.ca, mechanism="PLAIN", kafka_enabled=True)
    text = run_failing("check", env, monkeypatch, capsys)
    expected = f"Kafka at {secure_kafka.secure_bootstrap} does not accept SASL mechanism PLAIN (kafka.sasl_mechanism)"
    assert len(lines_with(text, expected)) == 1, text
    assert_no_password(text)


def client_certificate_env(
    broker: KafkaBroker, pki: Pki, cert: Path | None, key: Path | None
) -> dict[str, str]:
    """``DISPENSER_*`` variables for ``check`` on the SSL listener, presenting ``cert`` (none if ``None``)."""
    env = kafka_env(
        broker.tls_bootstrap, kafka_enabled=True, kafka_security_protocol="SSL", kafka_ssl_ca=pki.ca
    )
    if cert is not None and key is not None:
        env |= {"DISPENSER_KAFKA_SSL_CERT": str(cert), "DISPENSER_KAFKA_SSL_KEY": str(key)}
    return env


def test_check_passes_with_a_client_certificate(
    secure_kafka: KafkaBroker, pki: Pki, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``security_protocol = "SSL"`` with ``ssl_cert``/``ssl_key``: TLS both ways, no password."""
    topic = unique("requests")
    asyncio.run(create_topics(secure_kafka.bootstrap, {topic: 2}))
    env = client_certificate_env(secure_kafka, pki, pki.client_cert, pki.client_key)
    for name, value in (env | {"DISPENSER_KAFKA_REQUEST_TOPIC": topic}).items():
        monkeypatch.setenv(name, value)
    assert main(["check"]) == 0
    output = capsys.readouterr()
    assert f"ok   kafka: {secure_kafka.tls_bootstrap} (request topic {topic!r}: 2 partitions)" in output.out


@pytest.mark.parametrize("presented", ["none", "a server certificate"])
def test_a_refused_client_certificate_fails_in_one_line(
    presented: str,
    *,
    secure_kafka: KafkaBroker,
    pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No client certificate, or one not made for clients: one line saying the broker refused it."""
    if presented == "none":
        env = client_certificate_env(secure_kafka, pki, None, None)
        expected = f"Kafka at {secure_kafka.tls_bootstrap} refused the TLS connection"
        hint = "does it require a client certificate? kafka.ssl_cert and kafka.ssl_key are unset"
    else:  # the broker's own certificate: signed by the CA, but for serverAuth only
        env = client_certificate_env(secure_kafka, pki, pki.cert, pki.key)
        expected = f"Kafka at {secure_kafka.tls_bootstrap} refused this client's certificate kafka.ssl_cert {pki.cert}"
        hint = "CERTIFICATE"
    text = run_failing("check", env, monkeypatch, capsys)
    assert len(lines_with(text, expected)) == 1, text
    assert hint in lines_with(text, expected)[0]
    assert "Traceback" not in text


async def test_the_python_client_raises_coded_errors(secure_kafka: KafkaBroker, pki: Pki) -> None:
    """KafkaIdClient raises KafkaAuthenticationFailed / KafkaTlsFailed: OSErrors with a code, no retry."""
    wrong_password = load_config(environ=secure_env(secure_kafka, pki.ca, password=WRONG_PASSWORD)).kafka
    with pytest.raises(KafkaAuthenticationFailed) as auth:
        async with KafkaIdClient(wrong_password):
            pass
    assert isinstance(auth.value, OSError)
    assert (auth.value.code, auth.value.retryable) == ("kafka_authentication_failed", False)
    wrong_ca = load_config(environ=secure_env(secure_kafka, pki.other_ca)).kafka
    with pytest.raises(KafkaTlsFailed) as tls:
        async with KafkaIdClient(wrong_ca):
            pass
    assert tls.value.code == "kafka_tls_failed"
    assert "unable to get local issuer certificate" in str(tls.value)
    missing_ca = msgspec.structs.replace(wrong_ca, ssl_ca=str(pki.ca.parent / "missing.crt"))
    with pytest.raises(KafkaTlsFailed, match=r"cannot load kafka\.ssl_ca .*missing\.crt: No such file"):
        async with KafkaIdClient(missing_ca):
            pass
    for error in (auth.value, tls.value):
        assert_no_password(repr(error) + str(error))
