"""Several worker processes on one host (issue 32 item 1): what each must have of its own, and how many."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispenser.adapters.prometheus import merge_expositions
from dispenser.app.processes import available_cpus, check_processes, process_config, resolve_processes
from dispenser.app.supervisor import restart_delay
from dispenser.cli import main
from dispenser.config import Config, ConfigError, load_config


def _config(**env: str) -> Config:
    return load_config(environ={f"DISPENSER_{k.upper()}": v for k, v in env.items()})


def test_process_zero_keeps_the_configured_state_and_the_others_get_their_own(tmp_path: Path) -> None:
    """Process 0 is the single worker as before; process i: process-<i> state dirs, address+i, no shared port."""
    config = _config(
        snowflake_state_dir=str(tmp_path / "s"), snowflake_address="10.0.0.1:8080", metrics_port="9464"
    )
    zero, two = process_config(config, 0), process_config(config, 2)
    assert zero.snowflake.state_dir == str(tmp_path / "s")
    assert zero.snowflake.address == "10.0.0.1:8080"
    assert zero.segment.state_dir is None  # the grants follow snowflake.state_dir, as configured
    assert two.snowflake.state_dir == str(tmp_path / "s" / "process-2")
    assert two.segment.state_dir == str(tmp_path / "s" / "process-2")
    assert two.snowflake.address == "10.0.0.1:8080+2"
    for each in (zero, two):  # the supervisor serves metrics.port; each process a free loopback port
        assert (each.metrics.port, each.metrics.host) == (0, "127.0.0.1")


def test_a_separate_grants_dir_gets_a_subdirectory_per_process(tmp_path: Path) -> None:
    """segment.state_dir set apart: process i remembers its grants in <it>/process-<i>."""
    config = _config(segment_state_dir=str(tmp_path / "g"))
    assert process_config(config, 1).segment.state_dir == str(tmp_path / "g" / "process-1")
    assert process_config(config, 1).metrics.port is None  # no /metrics configured: none per process


def test_static_worker_ids_are_offset_per_process_only_when_asked() -> None:
    """Static mode: refused for 2 processes unless per_process_worker_ids; then process i is worker_id + i."""
    shared = _config(snowflake_enabled="true", snowflake_worker_id="7")
    with pytest.raises(ConfigError, match="would share worker ID 7"):
        check_processes(shared, 2)
    check_processes(shared, 1)  # one process: as before
    offset = _config(
        snowflake_enabled="true", snowflake_worker_id="7", snowflake_per_process_worker_ids="true"
    )
    check_processes(offset, 3)
    assert [process_config(offset, i).snowflake.worker_id for i in range(3)] == [7, 8, 9]
    last = _config(
        snowflake_enabled="true", snowflake_worker_id="1022", snowflake_per_process_worker_ids="true"
    )
    with pytest.raises(ConfigError, match="needs worker ID 1024, past the layout's last"):
        check_processes(last, 3)


def test_registry_worker_ids_keep_the_configured_id() -> None:
    """A registry hands out the IDs: the worker_id setting is not offset outside static mode."""
    config = _config(snowflake_enabled="true", snowflake_mode="postgres", snowflake_worker_id="3")
    check_processes(config, 4)
    assert process_config(config, 3).snowflake.worker_id == 3


def test_metrics_on_the_shared_http_port_is_refused() -> None:
    """metrics.port = http.port with several processes: the host's /metrics needs its own port."""
    config = _config(http_port="8080", metrics_port="8080")
    with pytest.raises(ConfigError, match=r"metrics\.port = http\.port"):
        check_processes(config, 2)
    with pytest.raises(ConfigError, match="a free port of its own"):
        check_processes(_config(http_port="0"), 2)  # port 0: each process would pick its own
    check_processes(_config(http_port="0"), 1)


def test_auto_is_the_cores_this_process_may_use_within_the_cgroup_quota(tmp_path: Path) -> None:
    """``auto``: the CPU affinity, capped by cgroup v2's cpu.max (rounded up); a number is itself."""
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("max 100000\n")
    cores = available_cpus(cpu_max)
    assert cores >= 1
    cpu_max.write_text("150000 100000\n")  # 1.5 CPUs of quota: 2 processes
    assert available_cpus(cpu_max) == min(cores, 2)
    assert resolve_processes(3) == 3
    assert resolve_processes("auto") >= 1
    with pytest.raises(ConfigError, match="at least 1 or 'auto'"):
        resolve_processes("many")


def test_the_setting_reads_a_number_or_auto_from_the_environment() -> None:
    """DISPENSER_WORKER_PROCESSES: a number or auto; 0 and other words are refused."""
    assert _config(worker_processes="4").worker.processes == 4
    assert _config(worker_processes="auto").worker.processes == "auto"
    for bad in ("0", "lots"):
        with pytest.raises(ConfigError, match="DISPENSER_WORKER_PROCESSES"):
            _config(worker_processes=bad)


def test_serve_refuses_a_shared_static_id_before_starting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dispenser serve --processes 2`` with a static snowflake ID: exit 2, one line saying what to set."""
    monkeypatch.setenv("DISPENSER_SNOWFLAKE_ENABLED", "true")
    assert main(["serve", "--processes", "2"]) == 2
    assert "snowflake.per_process_worker_ids" in capsys.readouterr().err


def test_the_host_exposition_labels_each_process_and_adds_the_supervisors() -> None:
    """Each process's samples gain process=<i>, one family each; restarts and serving per process."""
    text = '# HELP leaf_ids_total IDs handed out\n# TYPE leaf_ids_total counter\nleaf_ids_total{kind="segment",tag="a"} 5.0\n'
    merged = merge_expositions(
        {"0": text, "1": text}, restarts={"0": 0, "1": 2, "2": 1}, processes=3
    ).decode()
    assert merged.count("# TYPE leaf_ids_total counter") == 1
    assert 'leaf_ids_total{kind="segment",process="0",tag="a"} 5.0' in merged
    assert 'leaf_ids_total{kind="segment",process="1",tag="a"} 5.0' in merged
    assert "leaf_worker_processes 3.0" in merged
    assert 'leaf_worker_process_restarts_total{process="1"} 2.0' in merged
    assert 'leaf_worker_process_serving{process="2"} 0.0' in merged  # restarting: not among the texts


def test_a_process_dying_in_a_row_waits_longer_each_time_and_a_stable_run_resets_it() -> None:
    """0.5 s, doubling per death in a row up to 30 s; back to 0.5 s after a run of 30 s or more."""
    delays: list[float] = []
    delay = None
    for _ in range(9):
        delay = restart_delay(delay, ran=1.0)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert restart_delay(30.0, ran=30.0) == 0.5
    assert restart_delay(4.0, ran=29.9) == 8.0
