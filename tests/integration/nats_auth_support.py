"""Helpers for the NATS authentication tests: worker configs with credentials, a test CA, the documented config."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from dispenser.config import Config, load_config

ROOT = Path(__file__).resolve().parents[2]
SECURITY_DOC = ROOT / "docs" / "security.md"
PERMISSIONS_MARKER = "<!-- nats-permissions:"


def auth_config(nats_url: str, dsn: str, **nats: str) -> Config:
    """A segment worker's config for ``nats_url`` and ``dsn``, with ``nats.<name>`` settings (credentials)."""
    env = {"DISPENSER_NATS_URL": nats_url, "DISPENSER_POSTGRES_DSN": dsn}
    env |= {f"DISPENSER_NATS_{name.upper()}": value for name, value in nats.items()}
    return load_config(environ=env)


async def refused_connection(url: str, **options: Any) -> Exception:
    """Connect with ``options``, expecting a refusal; return the error.

    nats-py leaves the socket of a refused connection open (a ResourceWarning, an error under
    ``filterwarnings = error``) unless the client is closed, hence the client object of our own.
    """
    nc = Client()
    try:
        await nc.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, **options)
    except Exception as exc:
        return exc
    finally:
        await nc.close()
    raise AssertionError(f"{url} accepted a connection with {sorted(options)}")


def documented_permissions() -> str:
    """The nats-server configuration block of docs/security.md, exactly as the reader sees it.

    It is the first fenced code block after the ``<!-- nats-permissions: … -->`` marker.
    """
    text = SECURITY_DOC.read_text()
    start = text.index(PERMISSIONS_MARKER)
    match = re.compile(r"^```[^\n]*\n(.*?)^```$", re.M | re.S).search(text, start)
    assert match is not None, f"no code block after {PERMISSIONS_MARKER!r} in {SECURITY_DOC}"
    return match.group(1)


@dataclass(frozen=True)
class Pki:
    """A CA made for one test, and a server and a client certificate it signed (PEM files)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def make_pki(directory: Path) -> Pki:
    """Make a CA, a server certificate for 127.0.0.1 and localhost, and a client certificate (EC P-256).

    The openssl CLI does it, so no Python cryptography package is needed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=leaf test CA", cwd=directory)  # fmt: skip
    (directory / "server.ext").write_text(
        "subjectAltName = IP:127.0.0.1, DNS:localhost\nextendedKeyUsage = serverAuth\n"
    )
    (directory / "client.ext").write_text("extendedKeyUsage = clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN=leaf test {name}", cwd=directory)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem",
                 cwd=directory)  # fmt: skip
    for key in directory.glob("*.key"):
        key.chmod(0o600)
    return Pki(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
    )
