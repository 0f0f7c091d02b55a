"""The wheel as a user gets it: built from the checkout, installed alone into a clean venv, the client used.

The base install is the client (nats-py, msgspec): no worker driver comes with it, ``dispenser serve`` says
in one line which extra to install, and the client from that venv takes IDs from a worker running here.
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

from dispenser.testing.servers import NatsServer

from .segment_support import prepare, running_worker, worker_config

# The fixture builds and installs a wheel: ~7 s on an idle machine, ~15 s at a load of 8.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "leaf-dispenser" / "wheelhouse"
DRIVERS = ("asyncpg", "kazoo", "aiokafka", "prometheus_client", "uvloop")

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


def _run(*command: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # check=False: the callers assert on the status, with the output in the message.
    return subprocess.run(
        [str(c) for c in command], check=False, capture_output=True, text=True, timeout=240, env=env
    )


def _pip(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return _run(sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args)


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding only the wheel and what its base install requires; its ``bin`` directory."""
    where = tmp_path_factory.mktemp("wheel")
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


def test_the_wheel_ships_its_types_and_licence(clean_venv: Path) -> None:
    """py.typed (PEP 561) is in the package and the Apache-2.0 text in the wheel's metadata."""
    (wheel,) = (clean_venv.parent.parent / "dist").glob("leaf_dispenser-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "dispenser/py.typed" in names
    licence = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
    assert b"Apache License" in zipfile.ZipFile(wheel).read(licence)


def test_the_base_install_is_the_client_without_the_workers_drivers(clean_venv: Path) -> None:
    """No driver in the venv; `dispenser serve` fails in one line naming the extra; schemas refuses."""
    (site,) = (clean_venv.parent / "lib").glob("python*/site-packages")
    assert [driver for driver in DRIVERS if (site / driver).exists()] == []
    served = _run(
        clean_venv / "dispenser", "serve", env={**os.environ, "DISPENSER_NATS_URL": "nats://127.0.0.1:9"}
    )
    assert served.returncode == 2
    assert served.stdout == ""
    assert served.stderr.count("\n") == 1, served.stderr
    assert "pip install 'leaf-dispenser[server]'" in served.stderr
    schemas = _run(clean_venv / "dispenser", "schemas")
    assert schemas.returncode == 2
    assert "Traceback" not in schemas.stderr


async def test_the_client_from_the_wheel_takes_ids_from_a_worker(
    clean_venv: Path, nats_server: NatsServer, pg_dsn: str
) -> None:
    """IdClient and BlockingIdClient from the clean venv, and `dispenser get`, against a worker here."""
    await prepare(pg_dsn, [("demo", 1000)])
    async with running_worker(worker_config(nats_server.url, pg_dsn)):
        used = await asyncio.to_thread(_run, clean_venv / "python", "-c", CLIENT, nats_server.url, *DRIVERS)
        assert used.returncode == 0, used.stderr
        result = json.loads(used.stdout)
        got = await asyncio.to_thread(
            _run,
            clean_venv / "dispenser",
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
