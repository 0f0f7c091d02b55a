"""What a Patroni node is configured with: its ``patroni.yml`` and the ownership of its directory.

:func:`node_config` is one node's configuration document (REST API, DCS, PostgreSQL, access rules), and
:func:`write_node_config` writes it and, when we are root, hands the node's directory to ``postgres``. The
cluster-wide ``bootstrap.dcs`` section comes from :class:`~dispenser_lab.servers.patroni.PatroniCluster`.
"""

from __future__ import annotations

import json
import os
import pwd
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dispenser_lab.servers.patroni_env import ensure_traversable
from dispenser_lab.servers.process import LOOPBACK

__all__ = ["POSTGRES_USER", "node_config", "write_node_config"]

POSTGRES_USER = "postgres"
"""The user Patroni and its PostgreSQL run as when we are root."""


def node_config(
    *,
    scope: str,
    name: str,
    zookeeper_hosts: str,
    bootstrap: Mapping[str, Any],
    rest_port: int,
    port: int,
    workdir: Path,
    data_dir: Path,
    bin_dir: Path,
) -> dict[str, Any]:
    """One node's Patroni configuration: everything on 127.0.0.1, trust authentication, no passwords."""
    return {
        "scope": scope,
        "namespace": "/service/",
        "name": name,
        "log": {"level": "INFO"},
        "restapi": {
            "listen": f"{LOOPBACK}:{rest_port}",
            "connect_address": f"{LOOPBACK}:{rest_port}",
        },
        "zookeeper": {"hosts": zookeeper_hosts.split(",")},
        "bootstrap": {
            "dcs": bootstrap,
            "initdb": [{"encoding": "UTF8"}, {"locale": "C"}, "data-checksums"],
        },
        "postgresql": {
            "listen": f"{LOOPBACK}:{port}",
            "connect_address": f"{LOOPBACK}:{port}",
            "data_dir": str(data_dir),
            "bin_dir": str(bin_dir),
            "pgpass": str(workdir / "pgpass"),
            "authentication": {
                "superuser": {"username": "postgres"},
                "replication": {"username": "replicator"},
                "rewind": {"username": "postgres"},
            },
            "parameters": {"unix_socket_directories": str(workdir)},
            "pg_hba": [
                "local all all trust",
                f"host all all {LOOPBACK}/32 trust",
                f"host replication all {LOOPBACK}/32 trust",
            ],
        },
    }


def write_node_config(path: Path, config: Mapping[str, Any], workdir: Path) -> None:
    """Write ``config`` to ``path`` (JSON, which YAML reads as is); as root, give ``workdir`` to ``postgres``."""
    path.write_text(json.dumps(config, indent=2) + "\n")
    if os.geteuid() == 0:
        entry = pwd.getpwnam(POSTGRES_USER)
        ensure_traversable(workdir)
        for root, dirs, files in os.walk(workdir):
            for name in (*dirs, *files):
                os.chown(os.path.join(root, name), entry.pw_uid, entry.pw_gid, follow_symlinks=False)
        os.chown(workdir, entry.pw_uid, entry.pw_gid)
        workdir.chmod(0o700)
