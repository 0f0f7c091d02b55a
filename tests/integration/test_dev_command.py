"""`dispenser dev`, as a new user runs it: servers from wheels, a demo tag, IDs, and Ctrl-C stops it all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dispenser.cli import main
from dispenser_lab.servers import free_port
from dispenser_lab.servers.process import port_is_free
from tests.integration.dev_support import wait_for

pytestmark = [pytest.mark.nats, pytest.mark.postgres, pytest.mark.slow]


def test_dev_serves_demo_ids_and_stops_everything_on_ctrl_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dispenser dev` answers `get demo` and snowflake requests; SIGINT exits 0 and frees both ports.

    The commands run where the stack runs, with no settings of their own: they find it through the
    `.dispenser/dev.toml` it writes (and removes when it stops).
    """
    nats_port, pg_port = free_port(), free_port()
    log = tmp_path / "dev.log"
    data_dir = tmp_path / ".dispenser"
    data_dir.mkdir()
    data_dir.chmod(0o755)  # the PostgreSQL server runs as its own user below it when we are root
    tmp_path.chmod(0o755)
    argv = [
        "dev",
        "--data-dir",
        str(data_dir),
        "--nats-port",
        str(nats_port),
        "--postgres-port",
        str(pg_port),
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dispenser", *argv], stdout=out, stderr=out, env=os.environ.copy()
        )
    try:
        wait_for(log, "Ctrl-C stops it", proc)
        monkeypatch.chdir(tmp_path)
        for name in ("DISPENSER_CONFIG", "DISPENSER_NATS_URL", "DISPENSER_POSTGRES_DSN"):
            monkeypatch.delenv(name, raising=False)
        assert (data_dir / "dev.toml").is_file()
        assert main(["get", "demo", "3"]) == 0
        assert [int(i) for i in capsys.readouterr().out.split()] == [1, 2, 3]
        assert main(["get", "--kind", "snowflake", "demo", "2"]) == 0
        first, second = (int(i) for i in capsys.readouterr().out.split())
        assert 0 < first < second
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "stopped NATS and PostgreSQL" in text
    assert "Traceback" not in text
    assert port_is_free(nats_port)
    assert port_is_free(pg_port)
    assert not (data_dir / "dev.toml").exists()


def test_dev_with_two_datacenters_serves_callers_in_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dispenser dev --datacenters 2`: a NATS server per datacenter joined by gateways, a worker in each.

    Callers of either datacenter get IDs; SIGINT stops it all.
    """
    pg_port = free_port()
    log = tmp_path / "dev.log"
    data_dir = tmp_path / ".dispenser"
    data_dir.mkdir()
    data_dir.chmod(0o755)
    tmp_path.chmod(0o755)
    argv = ["dev", "--data-dir", str(data_dir), "--postgres-port", str(pg_port), "--datacenters", "2"]
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dispenser", *argv], stdout=out, stderr=out)
    try:
        wait_for(log, "joined by gateways", proc)
        urls = dict(re.findall(r"^    (dc-[ab]): (nats://\S+)$", log.read_text(), re.MULTILINE))
        assert set(urls) == {"dc-a", "dc-b"}
        monkeypatch.chdir(tmp_path)
        for name in ("DISPENSER_CONFIG", "DISPENSER_NATS_URL", "DISPENSER_POSTGRES_DSN"):
            monkeypatch.delenv(name, raising=False)
        assert main(["get", "demo", "3"]) == 0  # dc-a, through .dispenser/dev.toml
        from_a = [int(i) for i in capsys.readouterr().out.split()]
        monkeypatch.setenv("DISPENSER_NATS_URL", urls["dc-b"])
        assert main(["get", "demo", "3"]) == 0
        from_b = [int(i) for i in capsys.readouterr().out.split()]
        assert len(set(from_a + from_b)) == 6
        assert main(["get", "--kind", "snowflake", "demo", "2"]) == 0
        capsys.readouterr()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "stopped NATS and PostgreSQL" in text
    assert "Traceback" not in text
    assert port_is_free(pg_port)


@pytest.mark.kafka
def test_dev_with_kafka_serves_over_the_request_topic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dispenser dev --kafka` starts a broker too: `get --via kafka` answers; SIGINT stops all three."""
    nats_port, pg_port, kafka_port = free_port(), free_port(), free_port()
    log = tmp_path / "dev.log"
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    data_dir.chmod(0o755)
    tmp_path.chmod(0o755)
    argv = [
        "dev",
        "--data-dir",
        str(data_dir),
        "--nats-port",
        str(nats_port),
        "--postgres-port",
        str(pg_port),
    ]
    argv += ["--kafka", "--kafka-port", str(kafka_port)]
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dispenser", *argv], stdout=out, stderr=out)
    try:
        wait_for(log, "Ctrl-C stops it", proc, timeout=120)
        assert "dispenser get --via kafka" in log.read_text()
        monkeypatch.setenv("DISPENSER_KAFKA_BOOTSTRAP_SERVERS", f"127.0.0.1:{kafka_port}")
        assert main(["get", "--via", "kafka", "--timeout", "30", "demo", "3"]) == 0
        assert [int(i) for i in capsys.readouterr().out.split()] == [1, 2, 3]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "stopped NATS and PostgreSQL and Kafka" in text
    assert "Traceback" not in text
    for port in (nats_port, pg_port, kafka_port):
        assert port_is_free(port)


def test_dev_with_kafka_says_what_is_missing_without_java(tmp_path: Path) -> None:
    """Without Java on the machine, `dispenser dev --kafka` names what is missing and stops what it started."""
    nats_port, pg_port = free_port(), free_port()
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    data_dir.chmod(0o755)
    tmp_path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"} | {
        "PATH": str(Path(sys.executable).parent)
    }
    argv = [
        "dev",
        "--data-dir",
        str(data_dir),
        "--nats-port",
        str(nats_port),
        "--postgres-port",
        str(pg_port),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "dispenser", *argv, "--kafka"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1
    assert "java not found" in done.stderr
    assert "Kafka needs Java 17" in done.stderr
    assert "Traceback" not in done.stderr
    assert port_is_free(nats_port)
    assert port_is_free(pg_port)
