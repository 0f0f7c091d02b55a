"""A throw-away certificate authority for TLS tests, made with the ``openssl`` command line tool."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Pki", "make_pki"]

_EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")  # quick to generate

# What a verifying client (Python's ssl, libpq) expects of a CA and of a server certificate, including
# the key identifiers that OpenSSL's strict mode (Python 3.13's default) insists on.
_CA_EXTENSIONS = (
    "-addext",
    "basicConstraints=critical,CA:TRUE",
    "-addext",
    "keyUsage=critical,keyCertSign,cRLSign",
    "-addext",
    "subjectKeyIdentifier=hash",
)
_SERVER_EXTENSIONS = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
"""
_CLIENT_EXTENSIONS = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
"""


@dataclass(frozen=True)
class Pki:
    """PEM files: a CA, a server and a client certificate it signed (server: 127.0.0.1 and localhost), and an unrelated CA."""

    ca: Path
    cert: Path
    key: Path
    other_ca: Path
    """A CA that signed nothing the server presents: trusting only it must fail verification."""
    client_cert: Path
    """A client certificate (CN ``leaf-dispenser``) the CA signed, for servers that require one."""
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise AssertionError("the TLS tests need the openssl command (apt-get install openssl)")
    result = subprocess.run(
        [openssl, *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=60
    )
    if result.returncode != 0:
        raise AssertionError(f"openssl {' '.join(args)} failed: {result.stderr}")


def _make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    _openssl(
        "req", "-x509", *_EC, "-keyout", str(key), "-out", str(cert), "-days", "2",
        "-subj", f"/CN=leaf-dispenser test {name}", *_CA_EXTENSIONS,
        cwd=directory,
    )  # fmt: skip
    return cert, key


def _sign(
    directory: Path, name: str, subject: str, extensions: str, *, ca: Path, ca_key: Path
) -> tuple[Path, Path]:
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.crt"
    extfile = directory / f"{name}.ext"
    extfile.write_text(extensions)
    _openssl("req", "-new", *_EC, "-keyout", str(key), "-out", str(csr), "-subj", subject, cwd=directory)
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", "2", "-extfile", str(extfile),
        cwd=directory,
    )  # fmt: skip
    return cert, key


def make_pki(directory: Path) -> Pki:
    """Create the CA, the server and client certificates and keys, and the unrelated CA in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _make_ca(directory, "ca")
    other_ca, _ = _make_ca(directory, "other-ca")
    cert, key = _sign(directory, "server", "/CN=127.0.0.1", _SERVER_EXTENSIONS, ca=ca, ca_key=ca_key)
    client_cert, client_key = _sign(
        directory, "client", "/CN=leaf-dispenser", _CLIENT_EXTENSIONS, ca=ca, ca_key=ca_key
    )
    return Pki(ca=ca, cert=cert, key=key, other_ca=other_ca, client_cert=client_cert, client_key=client_key)
