"""Several worker processes on one host: how many (``worker.processes``), and what each must have of its own.

Each process is a whole worker. What two of them must never share is derived here from the one
configuration: the state directory (the grant memory, the snowflake cache and identity: process 0 keeps the
configured one, process ``i`` its ``process-<i>`` subdirectory), the snowflake worker ID (``static`` mode:
``worker_id + i`` only with ``snowflake.per_process_worker_ids``; a configured ``snowflake.address``: the
address with ``+<i>``), and the ``/metrics`` port (a free one on the loopback, which the supervisor reads
and serves as one ``/metrics`` for the host). The design: docs/operations.md, "Processes per host".
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import msgspec

from dispenser.adapters.local.statefile import default_state_dir
from dispenser.config import Config, ConfigError

__all__ = ["available_cpus", "check_processes", "process_config", "resolve_processes"]

_CGROUP_V2_MAX = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
_CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def _quota_cpus(cpu_max: Path = _CGROUP_V2_MAX) -> int | None:
    """The CPUs a cgroup's quota allows, rounded up (``None``: no quota, or none readable)."""
    try:
        quota, _, period = cpu_max.read_text().strip().partition(" ")
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period or "100000")))
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(_CGROUP_V1_QUOTA.read_text())
        period_us = int(_CGROUP_V1_PERIOD.read_text())
    except (OSError, ValueError):
        return None
    return max(1, math.ceil(quota_us / period_us)) if quota_us > 0 and period_us > 0 else None


def available_cpus(cpu_max: Path = _CGROUP_V2_MAX) -> int:
    """The cores this process may use: its CPU affinity, capped by a container's CPU quota (rounded up)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    quota = _quota_cpus(cpu_max)
    return max(1, min(cpus, quota) if quota is not None else cpus)


def resolve_processes(setting: int | str) -> int:
    """``worker.processes`` (or ``--processes``) as a number: ``auto`` is :func:`available_cpus`.

    Raises:
        ConfigError: neither ``auto`` nor a whole number of at least 1.
    """
    if setting == "auto":
        return available_cpus()
    try:
        processes = int(setting)
    except ValueError:
        raise ConfigError(f"worker.processes: a number of at least 1 or 'auto', not {setting!r}") from None
    if processes < 1:
        raise ConfigError(f"worker.processes: a number of at least 1 or 'auto', not {setting!r}")
    return processes


def check_processes(config: Config, processes: int) -> None:
    """Refuse a configuration that ``processes`` worker processes cannot share on one host.

    Raises:
        ConfigError: a ``static`` snowflake worker ID without ``snowflake.per_process_worker_ids`` (two
            processes would issue under one ID: repeated IDs), or such IDs past the layout's last, or
            ``metrics.port`` equal to ``http.port`` (the HTTP port is shared by the processes, so the host's
            one ``/metrics`` needs a port of its own), or ``http.port`` 0 (a free port each: none shared).
    """
    if processes <= 1:
        return
    snowflake = config.snowflake
    if snowflake.enabled and snowflake.mode == "static":
        if not snowflake.per_process_worker_ids:
            raise ConfigError(
                f"worker.processes = {processes} with a static snowflake worker ID: the processes would share "
                f"worker ID {snowflake.worker_id} and repeat IDs; set snowflake.per_process_worker_ids = true "
                f"(process i takes worker_id + i: reserve {snowflake.worker_id} … "
                f"{snowflake.worker_id + processes - 1} for this host) or use a registry (snowflake.mode)"
            )
        last = snowflake.worker_id + processes - 1
        if last >= 1 << snowflake.worker_bits:
            raise ConfigError(
                f"worker.processes = {processes} from static worker ID {snowflake.worker_id} needs worker ID "
                f"{last}, past the layout's last ({(1 << snowflake.worker_bits) - 1}: snowflake.worker_bits)"
            )
    if config.http.port == 0:
        raise ConfigError(
            f"worker.processes = {processes} with http.port = 0: each process would listen on a free port of "
            "its own instead of sharing one; set http.port"
        )
    if config.metrics.port and config.metrics.port == config.http.port:
        raise ConfigError(
            f"worker.processes = {processes} with metrics.port = http.port ({config.http.port}): the processes "
            "share the HTTP port, so the host's /metrics needs a port of its own (set metrics.port apart)"
        )


def process_config(config: Config, index: int) -> Config:
    """The configuration of process ``index`` (0-based) of several: what it must not share, made its own.

    Process 0 keeps the configured state directory, address and worker ID (a host going from one process
    to several keeps its worker's identity and grant memory); process ``i`` gets ``<state dir>/process-<i>``,
    ``<address>+<i>`` and, in ``static`` mode, ``worker_id + i``. ``metrics.port`` becomes a free port on
    the loopback, read by the supervisor (which serves ``metrics.port`` itself).
    """
    snowflake, segment = config.snowflake, config.segment
    if index:
        base = Path(snowflake.state_dir) if snowflake.state_dir else default_state_dir()
        own = str(base / f"process-{index}")
        grants = str(Path(segment.state_dir) / f"process-{index}") if segment.state_dir else own
        segment = msgspec.structs.replace(segment, state_dir=grants)
        address = f"{snowflake.address}+{index}" if snowflake.address is not None else None
        worker_id = snowflake.worker_id + index if snowflake.mode == "static" else snowflake.worker_id
        snowflake = msgspec.structs.replace(snowflake, state_dir=own, address=address, worker_id=worker_id)
    metrics = config.metrics
    if metrics.port is not None:
        metrics = msgspec.structs.replace(metrics, port=0, host="127.0.0.1")
    return msgspec.structs.replace(config, snowflake=snowflake, segment=segment, metrics=metrics)
