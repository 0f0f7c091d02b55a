"""`dispenser dev --ha`: the clustered stack for trying failovers by hand serves IDs and Ctrl-C stops all of it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dispenser.cli import main
from dispenser_lab.servers.process import process_id
from tests.integration.dev_support import wait_for

pytestmark = [pytest.mark.ha, pytest.mark.nats, pytest.mark.postgres, pytest.mark.zookeeper, pytest.mark.slow]


def test_dev_ha_serves_ids_and_stops_every_member_on_ctrl_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The banner names every member's PID; `get demo` answers over the cluster; SIGINT ends every process."""
    tmp_path.chmod(0o755)  # PostgreSQL runs as its own user below it
    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dispenser", "dev", "--ha", "--data-dir", str(tmp_path / "data")],
            stdout=out,
            stderr=out,
            env={k: v for k, v in os.environ.items() if not k.startswith("DISPENSER_")},
        )
    try:
        banner = wait_for(log, "Ctrl-C stops it", proc, timeout=180.0)
        urls = re.search(r"NATS cluster\s+(\S+)", banner)
        assert urls is not None, banner
        assert urls.group(1).count("nats://") == 3
        pids = [int(pid) for pid in re.findall(r"pid (\d+)", banner)]
        assert len(pids) == 9, banner  # 3 NATS, 3 ZooKeeper, 3 Patroni
        monkeypatch.setenv("DISPENSER_NATS_URL", urls.group(1))
        assert main(["get", "demo", "3"]) == 0
        assert [int(i) for i in capsys.readouterr().out.split()] == [1, 2, 3]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "stopped the clustered stack" in text
    assert "Traceback" not in text
    assert [pid for pid in pids if process_id(pid) is not None] == []
