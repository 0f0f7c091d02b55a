"""Capture Leaf's HTTP answers from the real server: the table the drop-in tests hold the dispenser to.

``python -m dispenser_lab.leaf.capture`` starts MariaDB (Leaf's DDL and sample row) and ZooKeeper from the
lab's servers, then Meituan's Leaf 1.0.1 built by ``../shared/leaf/build.sh`` (``$ACC_LEAF_HOME``, default
``/tmp/leaf-acc/leaf/server``: its unpacked Spring Boot jar), sends every request of :data:`REQUESTS`, and
writes what came back (status, media type, the form of the body) as JSON, by default to
``tests/integration/leaf_answers.json``. The file is committed: the tests need no Leaf, and a difference
from Leaf is found by a test, not by a caller. Rerun it only to capture again (Java 17 and Maven needed).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from dispenser_lab.servers.mariadb import MariaDBServer
from dispenser_lab.servers.process import free_port
from dispenser_lab.servers.zookeeper import ZooKeeperServer

__all__ = ["REQUESTS", "Answer", "Probe", "capture", "form_of", "main"]

ROOT = Path(__file__).resolve().parents[3]
OUT = ROOT / "tests" / "integration" / "leaf_answers.json"
LEAF_HOME = Path(os.environ.get("ACC_LEAF_HOME", "/tmp/leaf-acc/leaf/server"))
TAG = "leaf-segment-test"
"""Leaf's sample row (its README), step 2000."""

# What real callers send: curl and Python (*/* or nothing), a browser, Spring's RestTemplate asked for a
# Long (Jackson on the class path) or a String, Java's HttpClient and a client that wants XML.
JSON_LONG = "application/json, application/*+json"
REST_TEMPLATE_STRING = "text/plain, application/json, application/*+json, */*"
BROWSER = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


@dataclass(frozen=True)
class Probe:
    """One request: a method, a path (with its query) and an Accept header (None: none sent)."""

    name: str
    method: str
    path: str
    accept: str | None


@dataclass(frozen=True)
class Answer:
    """What came back, in a form that holds from run to run (an ID's value and a timestamp do not)."""

    status: int
    media_type: str
    """The Content-Type without its parameters, lower case ("" when there is none)."""
    charset: str
    """The Content-Type's charset, lower case ("" when it names none)."""
    form: str
    """``id`` (the decimal digits of a positive ID), ``empty``, ``json:<sorted keys>`` or ``text``."""
    fields: dict[str, str]
    """For a JSON object: the values that hold from run to run (``error``, ``exception``, ``message``,
    ``path``, ``status``, ``errorMsg``)."""


def _probes() -> list[Probe]:
    probes: list[Probe] = []
    accepts = {
        "no-accept": None,
        "any": "*/*",
        "text": "text/plain",
        "json": "application/json",
        "resttemplate-long": JSON_LONG,
        "resttemplate-string": REST_TEMPLATE_STRING,
        "browser": BROWSER,
        "xml": "application/xml",
        "image": "image/png",
        "text-any": "text/*",
        "application-any": "application/*",
        "json-low-text-high": "application/json;q=0.5, text/plain",
    }
    for kind, key in (("segment", TAG), ("snowflake", "any-key")):
        for name, accept in accepts.items():
            probes.append(Probe(f"{kind}/{name}", "GET", f"/api/{kind}/get/{key}", accept))
        for name in ("no-accept", "resttemplate-long"):
            probes.append(
                Probe(f"{kind}/trailing-slash/{name}", "GET", f"/api/{kind}/get/{key}/", accepts[name])
            )
        probes.append(Probe(f"{kind}/post", "POST", f"/api/{kind}/get/{key}", None))
        # Spring's suffix pattern match: a key with a dot loses what follows it (leaf-segment-test.json is
        # leaf-segment-test, answered as JSON).
        probes.append(Probe(f"{kind}/dotted", "GET", f"/api/{kind}/get/{key}.json", None))
    for name in ("no-accept", "resttemplate-long", "browser"):
        probes.append(
            Probe(f"segment/unknown-tag/{name}", "GET", "/api/segment/get/no-such-tag", accepts[name])
        )
    probes.append(Probe("unknown-path/no-accept", "GET", "/api/segment/get", None))
    probes.append(Probe("unknown-path/json", "GET", "/api/nothing", "application/json"))
    for name in ("no-accept", "json"):
        probes.append(Probe(f"decode/{name}", "GET", "/decodeSnowflakeId?snowflakeId=1", accepts[name]))
    return probes


REQUESTS = _probes()
"""Every request captured, by name."""

_STABLE = ("error", "exception", "message", "path", "status", "errorMsg")


def form_of(status: int, content_type: str, body: bytes) -> Answer:
    """The stable form of one answer."""
    media_type, _, parameters = (part.strip().lower() for part in content_type.partition(";"))
    charset = next(
        (
            value.strip('"')
            for name, _, value in (p.strip().partition("=") for p in parameters.split(";"))
            if name == "charset"
        ),
        "",
    )
    text = body.decode("utf-8", "replace")
    fields: dict[str, str] = {}
    if not body:
        form = "empty"
    elif re.fullmatch(r"[1-9][0-9]*", text):
        form = "id"
    else:
        try:
            value = json.loads(text)
        except ValueError:
            form = "text"
        else:
            if isinstance(value, dict):
                form = "json:" + ",".join(sorted(value))
                fields = {k: str(value[k]) for k in _STABLE if k in value}
            else:
                form = "json:" + type(value).__name__
    return Answer(status, media_type, charset, form, fields)


def ask(port: int, probe: Probe) -> Answer:
    """Send one probe to 127.0.0.1:port; its answer."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.putrequest(probe.method, probe.path, skip_accept_encoding=True)
        if probe.accept is not None:
            connection.putheader("Accept", probe.accept)
        if probe.method == "POST":
            connection.putheader("Content-Length", "0")
        connection.endheaders()
        response = connection.getresponse()
        return form_of(response.status, response.getheader("Content-Type", ""), response.read())
    finally:
        connection.close()


@contextmanager
def _leaf(workdir: Path, jdbc_port: int, database: str, zookeeper: str) -> Iterator[int]:
    """Leaf's server on a free port of 127.0.0.1, segment and snowflake on; its port."""
    conf = workdir / "conf"
    conf.mkdir(parents=True)
    (workdir / "tmp").mkdir()
    port = free_port()
    (conf / "leaf.properties").write_text(
        "leaf.name=capture\nleaf.segment.enable=true\n"
        f"leaf.jdbc.url=jdbc:mysql://127.0.0.1:{jdbc_port}/{database}"
        "?useUnicode=true&characterEncoding=utf8&useSSL=false\n"
        "leaf.jdbc.username=root\nleaf.jdbc.password=\n"
        f"leaf.snowflake.enable=true\nleaf.snowflake.zk.address={zookeeper}\nleaf.snowflake.port={port}\n"
    )
    app = LEAF_HOME / "app" / "BOOT-INF"
    command = [
        shutil.which("java") or "java",
        "--add-opens",
        "java.base/java.lang=ALL-UNNAMED",
        f"-Djava.io.tmpdir={workdir / 'tmp'}",
        "-cp",
        f"{conf}:{app / 'classes'}:{app / 'lib' / '*'}",
        "com.sankuai.inf.leaf.server.LeafServerApplication",
        f"--server.port={port}",
        "--server.address=127.0.0.1",
    ]
    with (workdir / "leaf.log").open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 90
            while ask_ready(port) is False:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Leaf did not start: {(workdir / 'leaf.log').read_text()[-3000:]}")
                time.sleep(0.5)
            yield port
        finally:
            process.terminate()
            process.wait(30)


def ask_ready(port: int) -> bool:
    """Whether Leaf answers a segment ID (its caches are loaded)."""
    try:
        return ask(port, Probe("ready", "GET", f"/api/segment/get/{TAG}", None)).form == "id"
    except OSError:
        return False


def capture() -> dict[str, object]:
    """Start the servers and Leaf, send every probe; the table."""
    if not (LEAF_HOME / "app" / "BOOT-INF" / "classes").is_dir():
        raise RuntimeError(f"no Leaf build in {LEAF_HOME}: run ../shared/leaf/build.sh (ACC_LEAF_HOME)")
    with tempfile.TemporaryDirectory(prefix="leaf-capture-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        with MariaDBServer(work / "mariadb") as mariadb, ZooKeeperServer(work / "zookeeper") as zookeeper:
            mariadb.create_database("leaf")
            ddl = (Path(__file__).resolve().parent / "leaf_alloc.sql").read_text()
            mariadb.sql(ddl, database="leaf")
            with _leaf(work / "leaf", mariadb.port, "leaf", zookeeper.hosts) as port:
                answers = {probe.name: asdict(ask(port, probe)) for probe in REQUESTS}
    return {
        "leaf": "Meituan-Dianping/Leaf 1.0.1 (86a6441d), Spring Boot 1.5, built by ../shared/leaf/build.sh",
        "captured": time.strftime("%Y-%m-%d", time.gmtime()),
        "requests": [asdict(probe) for probe in REQUESTS],
        "answers": answers,
    }


def main(argv: list[str] | None = None) -> int:
    """Capture and write the table; 0 when written."""
    parser = argparse.ArgumentParser(prog="python -m dispenser_lab.leaf.capture", description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT, help=f"where the table goes (default {OUT})")
    args = parser.parse_args(argv)
    table = capture()
    args.out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{len(REQUESTS)} answers of Leaf written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
