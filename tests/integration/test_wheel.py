"""The wheel as a user gets it: built from the checkout, installed alone into a clean venv, the client used.

The base install is the client (nats-py, msgspec): no worker driver comes with it, ``dispenser serve`` says
in one line which extra to install, and the client from that venv takes IDs from a worker running here.
The product's wheel holds none of the lab; the lab's wheel (``lab/``, leaf-dispenser-lab), installed beside
it, brings the servers with their poms and the implementations of ``dispenser bench`` and ``dispenser dev``.
The client's dependencies come from a wheelhouse in ``~/.cache/leaf-dispenser/wheelhouse`` (filled from
the package index on the first run, offline afterwards), so the test takes seconds, not a resolution.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dispenser_lab.servers import NatsServer

from .segment_support import prepare, running_worker, worker_config

# Builds and installs a wheel: ~7 s on an idle machine, ~15 s at a load of 8.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "leaf-dispenser" / "wheelhouse"
DRIVERS = ("asyncpg", "kazoo", "aiokafka", "prometheus_client", "aiohttp", "uvloop")

CLIENT = """
import asyncio, importlib.util, json, sys
from dispenser.client import BlockingIdClient, IdClient

async def main(url):
    async with IdClient.over_nats(url) as ids:
        return [await ids.next_id("demo") for _ in range(5)] + await ids.take("demo", 100)

url = sys.argv[1]
taken = asyncio.run(main(url))
with BlockingIdClient.over_nats(url) as client:
    taken += client.take("demo", 10)
drivers = [name for name in sys.argv[2:] if importlib.util.find_spec(name) is not None]
print(json.dumps({"ids": taken, "drivers": drivers}))
"""

# The lab from its installed wheel: its Java servers find their poms as package data (no checkout), and the
# modules of the product it imports are public. Java is not started (seconds of JVM).
KIT = """
import json
from pathlib import Path
from dispenser_lab.servers import kafka, zookeeper
from dispenser_lab.servers.maven import packaged_pom
from dispenser_lab.servers.process import free_port, port_is_free
poms = {name: str(packaged_pom(name)) for name in ("zookeeper", "kafka")}
texts = {name: Path(pom).read_text() for name, pom in poms.items()}
print(json.dumps({
    "poms": poms,
    "defaults": [str(zookeeper.POM), str(kafka.POM)],
    "versions": [zookeeper.ZOOKEEPER_VERSION in texts["zookeeper"], "kafka.version" in texts["kafka"]],
    "port": port_is_free(free_port()),
}))
"""


def _run(
    *command: str | Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    # check=False: the callers assert on the status, with the output in the message.
    return subprocess.run(
        [str(c) for c in command], check=False, capture_output=True, text=True, timeout=240, env=env, cwd=cwd
    )


def _pip(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return _run(sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args)


def _lab_wheel(where: Path) -> Path:
    """The lab's wheel (``lab/``), built from a copy of it into ``where/lab-dist``."""
    source = where / "lab-source"
    shutil.copytree(ROOT / "lab", source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    built = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", where / "lab-dist", source)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (where / "lab-dist").glob("leaf_dispenser_lab-*.whl")
    return wheel


def _clean_venv(where: Path) -> Path:
    """A venv under ``where`` holding only the wheel (in ``where/dist``) and its base install; its ``bin``."""
    # Built from a copy of what the wheel is made of: an in-tree build would leave build/ in the checkout,
    # and a stale build/lib could ship modules the checkout no longer has.
    source = where / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "dispenser", source / "dispenser", ignore=shutil.ignore_patterns("__pycache__"))
    # No build isolation: the test extra brings a setuptools that builds wheels, so no index is needed.
    built = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", where / "dist", source)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (where / "dist").glob("leaf_dispenser-*.whl")
    venv = where / "venv"
    made = _run(sys.executable, "-m", "venv", "--without-pip", venv)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    offline = ("--no-index", "--find-links", WHEELHOUSE)
    installed = _pip("--python", python, "install", "-q", *offline, wheel)
    if installed.returncode != 0:  # first run, or the requirements moved: fill the wheelhouse, once
        # `pip wheel`, not `pip download`: a requirement published as an sdist only (nkeys) is built once
        # here, so that the offline install needs no build backend from the index.
        fetched = _pip("wheel", "-q", "--wheel-dir", WHEELHOUSE, wheel)
        assert fetched.returncode == 0, fetched.stdout + fetched.stderr
        for copy in WHEELHOUSE.glob("leaf_dispenser-*"):  # the wheel under test is never taken from here
            copy.unlink()
        installed = _pip("--python", python, "install", "-q", *offline, wheel)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return venv / "bin"


async def test_the_wheel_alone_in_a_clean_venv_is_a_typed_licensed_client(
    tmp_path: Path, nats_server: NatsServer, pg_dsn: str
) -> None:
    """Typed, licensed, no driver; serve names the extra, schemas refuses outside a checkout and writes where told; the client takes IDs.

    `dispenser serve` fails in one line naming the extra; IdClient, BlockingIdClient and `dispenser get` run
    from the venv against a worker in this process. One test, so that the wheel is built and installed once (a fixture would be built again by each xdist
    worker that runs one of several tests).
    """
    bin_dir = await asyncio.to_thread(_clean_venv, tmp_path)
    (wheel,) = (tmp_path / "dist").glob("leaf_dispenser-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert "dispenser/py.typed" in names
        licence = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
        assert b"Apache License" in archive.read(licence)

    (site,) = (bin_dir.parent / "lib").glob("python*/site-packages")
    assert [driver for driver in DRIVERS if (site / driver).exists()] == []
    served = await asyncio.to_thread(
        _run, bin_dir / "dispenser", "serve", env={**os.environ, "DISPENSER_NATS_URL": "nats://127.0.0.1:9"}
    )
    assert served.returncode == 2
    assert served.stdout == ""
    assert served.stderr.count("\n") == 1, served.stderr
    assert "pip install 'leaf-dispenser[server]'" in served.stderr
    # A permuted tag's ID needs the cipher's libraries (numpy, pycryptodome) to decode: named too, no traceback.
    decoded = await asyncio.to_thread(
        _run, bin_dir / "dispenser", "decode", "--tag", "order", "1909854577332565212"
    )
    assert decoded.returncode == 2, decoded.stdout + decoded.stderr
    assert "Traceback" not in decoded.stderr
    assert "pip install 'leaf-dispenser[server]'" in decoded.stderr
    # Outside a checkout (the test's directory, not the repository's: from there it would write into it).
    schemas = await asyncio.to_thread(_run, bin_dir / "dispenser", "schemas", cwd=tmp_path)
    assert schemas.returncode == 2, schemas.stdout + schemas.stderr
    assert "Traceback" not in schemas.stderr
    # Given where to write, it writes them with the base install alone (no PyYAML, no Kafka driver).
    written = await asyncio.to_thread(
        _run,
        *(bin_dir / "dispenser", "schemas", "--dir", tmp_path / "schemas"),
        *("--asyncapi", tmp_path / "asyncapi.yaml"),
        cwd=tmp_path,
    )
    assert written.returncode == 0, written.stderr
    assert (tmp_path / "asyncapi.yaml").read_text() == (ROOT / "docs" / "asyncapi.yaml").read_text()

    await prepare(pg_dsn, [("demo", 1000)])
    async with running_worker(worker_config(nats_server.url, pg_dsn)):
        # Outside the checkout: `python -c` puts the working directory first on sys.path, and the checkout's
        # dispenser/ would then be imported instead of the wheel's.
        used = await asyncio.to_thread(
            _run, bin_dir / "python", "-c", CLIENT, nats_server.url, *DRIVERS, cwd=tmp_path
        )
        assert used.returncode == 0, used.stderr
        result = json.loads(used.stdout)
        got = await asyncio.to_thread(
            _run,
            bin_dir / "dispenser",
            "get",
            "demo",
            "3",
            env={**os.environ, "DISPENSER_NATS_URL": nats_server.url},
        )
        assert got.returncode == 0, got.stderr
    ids = result["ids"]
    assert len(ids) == 115
    assert ids == sorted(set(ids))
    assert result["drivers"] == []
    later = [int(line) for line in got.stdout.split()]
    assert len(later) == 3
    assert min(later) > max(ids)

    # The product alone has no lab: not in the wheel, and its commands say where they come from.
    assert not [name for name in names if name.startswith(("dispenser_lab", "dispenser/testing/servers"))]
    assert not [name for name in names if "bench" in name or "devstack" in name or "faultproxy" in name]
    alone = await asyncio.to_thread(_run, bin_dir / "dispenser", "bench", "snowflake", cwd=tmp_path)
    assert alone.returncode == 2
    assert "leaf-dispenser-lab" in alone.stderr
    assert "Traceback" not in alone.stderr

    # The lab beside it (--no-deps: the drivers it names are not what this test is about).
    await _check_the_lab_beside(tmp_path, bin_dir, site)


async def _check_the_lab_beside(tmp_path: Path, bin_dir: Path, site: Path) -> None:
    """The lab's wheel beside the product's: its own files only, the wheel's poms found, `dispenser bench` runs."""
    lab_wheel = await asyncio.to_thread(_lab_wheel, tmp_path)
    with zipfile.ZipFile(lab_wheel) as archive:
        lab_names = archive.namelist()
    assert not [name for name in lab_names if name.startswith("dispenser/")]
    assert {
        "dispenser_lab/servers/poms/zookeeper/pom.xml",
        "dispenser_lab/servers/poms/kafka/pom.xml",
    } <= set(lab_names)
    beside = await asyncio.to_thread(
        _pip, "--python", bin_dir / "python", "install", "-q", "--no-deps", lab_wheel
    )
    assert beside.returncode == 0, beside.stdout + beside.stderr
    kit = await asyncio.to_thread(
        _run, bin_dir / "python", "-c", KIT, env={**os.environ, "PYTHONPATH": ""}, cwd=tmp_path
    )
    assert kit.returncode == 0, kit.stderr
    found = json.loads(kit.stdout)
    assert found["defaults"] == [found["poms"]["zookeeper"], found["poms"]["kafka"]]
    for pom in found["poms"].values():
        assert Path(pom).is_relative_to(site), pom  # the wheel's, not the checkout's
    assert found["versions"] == [True, True]
    assert found["port"] is True
    # `dispenser bench` now runs the lab's benchmark (the in-process snowflake one needs no server).
    report = tmp_path / "bench.json"
    benched = await asyncio.to_thread(
        _run,
        bin_dir / "dispenser",
        "bench",
        "snowflake",
        "--duration",
        "0.1",
        "--json",
        str(report),
        env={**os.environ, "PYTHONPATH": ""},
        cwd=tmp_path,
    )
    assert benched.returncode == 0, benched.stderr
    assert json.loads(report.read_text())
