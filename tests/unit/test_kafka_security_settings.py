"""Kafka security settings without a broker: client options, unreadable TLS files, outages, the event loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import uvloop

from dispenser.adapters.kafka.connection import KafkaTlsFailed, check_security, client_options
from dispenser.cli.common import uvloop_suits
from dispenser.config import KafkaConfig, load_config
from dispenser.runner import run_async
from dispenser_lab.servers import free_port
from tests.secret_values import SECRETS

PASSWORD = SECRETS["kafka_scram_password"]


def test_sasl_ssl_options_carry_the_credentials_and_a_verifying_context() -> None:
    """SASL_SSL: mechanism, user and password for aiokafka, and a context that checks the broker's name."""
    config = KafkaConfig(
        bootstrap_servers="a:9093, b:9093",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="leaf",
        sasl_password=PASSWORD,
    )
    options = client_options(config)
    assert options["bootstrap_servers"] == ["a:9093", "b:9093"]
    assert (options["sasl_mechanism"], options["sasl_plain_username"]) == ("SCRAM-SHA-512", "leaf")
    assert options["sasl_plain_password"] == PASSWORD
    assert options["ssl_context"].check_hostname


def test_plaintext_options_have_no_security() -> None:
    """PLAINTEXT: no TLS context and no SASL settings, whatever else is configured."""
    options = client_options(KafkaConfig(sasl_username="leaf", sasl_password=PASSWORD))
    assert "ssl_context" not in options
    assert "sasl_plain_password" not in options


def test_unreadable_tls_files_name_the_setting(tmp_path: Path) -> None:
    """A missing CA, certificate or key: KafkaTlsFailed naming the setting and the file, before any connection."""
    missing = tmp_path / "missing.pem"
    with pytest.raises(KafkaTlsFailed, match=r"cannot load kafka\.ssl_ca .*missing\.pem: No such file"):
        client_options(KafkaConfig(security_protocol="SSL", ssl_ca=str(missing)))
    with pytest.raises(KafkaTlsFailed, match=r"cannot load kafka\.ssl_cert .*missing\.pem") as caught:
        client_options(KafkaConfig(security_protocol="SSL", ssl_cert=str(missing), ssl_key=str(missing)))
    assert caught.value.code == "kafka_tls_failed"
    assert isinstance(caught.value, OSError)


async def test_the_security_check_leaves_an_outage_to_the_clients() -> None:
    """Nothing listening: not a settings error, so the check returns and the clients report the outage."""
    config = KafkaConfig(
        bootstrap_servers=f"127.0.0.1:{free_port()}",
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="leaf",
        sasl_password=PASSWORD,
    )
    await asyncio.wait_for(check_security(config), 10)


def test_commands_run_on_asyncio_when_kafka_uses_tls() -> None:
    """uvloop, except with TLS to Kafka (uvloop closes a TLS consumer in 30 s about every other time)."""

    def protocol(name: str) -> bool:
        return uvloop_suits(load_config(environ={"DISPENSER_KAFKA_SECURITY_PROTOCOL": name}))

    assert protocol("PLAINTEXT")
    assert protocol("SASL_PLAINTEXT")
    assert not protocol("SSL")
    assert not protocol("SASL_SSL")

    async def loop_type() -> type[asyncio.AbstractEventLoop]:
        return type(asyncio.get_running_loop())

    assert run_async(loop_type()) is uvloop.Loop
    assert run_async(loop_type(), fast=False) is not uvloop.Loop
