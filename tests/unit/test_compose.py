"""compose/: valid against the Compose Specification, and wired the way the docs say a stack must be.

CI has no Docker engine, so ``docker compose config`` cannot run: the file is validated against the
Compose Specification's JSON Schema (vendored in tests/data/, see its README), then checked for what the
schema cannot know — every service has a health check and a restart policy, every ``DISPENSER_*``
variable is a real setting with a usable value, every ``dispenser`` command in it parses, the servers the
workers are pointed at are services of the file, snowflake workers keep their state in a volume of their
own, and the build context sends what the image needs and not the virtualenv or the git history.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import io
import json
import re
import shlex
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from dispenser import cli
from dispenser.config import Config, load_config
from dispenser_lab.servers.kafka import KAFKA_VERSION
from dispenser_lab.servers.nats import find_nats_server
from dispenser_lab.servers.postgres import find_postgres_installs
from dispenser_lab.servers.zookeeper import ZOOKEEPER_VERSION

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILES = sorted([*COMPOSE_DIR.glob("*.yml"), *COMPOSE_DIR.glob("*.yaml")])
SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"
SCHEMA_NOTE = ROOT / "tests" / "data" / "README.md"

RESTART_POLICIES = re.compile(r"^(always|unless-stopped|on-failure(:\d+)?)$")
# Settings whose value names a server: the host must be a service of the file, not a machine elsewhere.
SERVER_SETTINGS = (
    "DISPENSER_NATS_URL",
    "DISPENSER_POSTGRES_DSN",
    "DISPENSER_KAFKA_BOOTSTRAP_SERVERS",
    "DISPENSER_SNOWFLAKE_ZOOKEEPER_HOSTS",
)


def _load(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(document, dict), f"{path.name}: not a mapping"
    return document


def _services(path: Path) -> dict[str, dict[str, Any]]:
    services = _load(path)["services"]
    assert isinstance(services, dict)
    return services


def _environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's environment as strings (compose takes a mapping or a list of ``KEY=VALUE``)."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {key: _as_env(value) for key, value in raw.items()}


def _as_env(value: object) -> str:
    if isinstance(value, bool):  # YAML true: compose passes "true"
        return str(value).lower()
    return "" if value is None else str(value)


def _image_environment() -> dict[str, str]:
    """The ``DISPENSER_*`` variables compose/Dockerfile sets (``ENV NAME=value``) in the image."""
    text = (COMPOSE_DIR / "Dockerfile").read_text(encoding="utf-8")
    return dict(re.findall(r"^ENV (DISPENSER_\w+)=(\S+)$", text, re.MULTILINE))


def _real_variables() -> set[str]:
    config = Config()
    return {"DISPENSER_CONFIG"} | {
        f"DISPENSER_{section}_{name}".upper()
        for section in Config.__struct_fields__
        for name in getattr(config, section).__struct_fields__
    }


def _dispenser_commands(service: Mapping[str, Any]) -> list[list[str]]:
    """The ``dispenser`` command lines a service runs: its shell entrypoint's, or the image's with ``command``."""
    entrypoint = service.get("entrypoint")
    if entrypoint is None:  # the image's ENTRYPOINT ["dispenser"], CMD ["serve"]
        command = service.get("command", ["serve"])
        return [shlex.split(command) if isinstance(command, str) else list(command)]
    words = shlex.split(entrypoint) if isinstance(entrypoint, str) else list(entrypoint)
    if words[:2] != ["sh", "-c"]:
        return [words[1:]] if words and words[0] == "dispenser" else []
    commands = []
    for piece in re.split(r"&&|\|\||;|\(|\)", words[2]):
        argv = shlex.split(piece)
        if argv[:1] == ["exec"]:
            argv = argv[1:]
        if argv[:1] == ["dispenser"]:
            commands.append(argv[1:])
    return commands


def _serves(service: Mapping[str, Any]) -> bool:
    return any(argv[-1:] == ["serve"] or argv[:1] == ["serve"] for argv in _dispenser_commands(service))


def _hosts(variable: str, value: str) -> list[str]:
    """The host names a server setting points at (URLs and DSNs, or comma-separated ``host:port``)."""
    hosts = []
    for part in (raw.strip() for raw in value.split(",")):
        hosts.append((urlsplit(part).hostname or "") if "://" in part else part.rsplit(":", 1)[0])
    assert all(hosts), f"{variable}={value!r}: no host"
    return hosts


# ---------------------------------------------------------------------------------------------------------


def _schema() -> dict[str, Any]:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    assert isinstance(schema, dict)
    return schema


def test_vendored_schema_is_the_one_noted() -> None:
    """tests/data/compose-spec.json is byte for byte the file its README names (digest), and a valid schema."""
    digest = re.search(r"sha256: `([0-9a-f]{64})`", SCHEMA_NOTE.read_text(encoding="utf-8"))
    assert digest is not None, "tests/data/README.md must give the schema's sha256"
    assert hashlib.sha256(SCHEMA.read_bytes()).hexdigest() == digest.group(1)
    schema = _schema()
    assert "draft-07" in schema["$schema"]
    jsonschema.Draft7Validator.check_schema(schema)


def test_schema_rejects_what_compose_rejects() -> None:
    """The validation has teeth: a misspelt service key and a bad depends_on condition are errors."""
    validator = jsonschema.Draft7Validator(_schema())
    assert not validator.is_valid({"services": {"a": {"image": "x", "helthcheck": {}}}})
    assert not validator.is_valid(
        {"services": {"a": {"image": "x", "depends_on": {"b": {"condition": "service_ready"}}}}}
    )
    assert validator.is_valid({"services": {"a": {"image": "x", "restart": "unless-stopped"}}})


def test_compose_files_exist() -> None:
    assert [path.name for path in COMPOSE_FILES] == ["docker-compose.yml"]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda path: path.name)
def test_compose_file_is_valid(path: Path) -> None:
    """The file (YAML anchors and merge keys resolved) validates against the Compose Specification."""
    validator = jsonschema.Draft7Validator(_schema())
    errors = [
        f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
        for error in validator.iter_errors(_load(path))
    ]
    assert errors == []


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda path: path.name)
def test_every_service_has_health_check_and_restart_policy(path: Path) -> None:
    """Health checks for every service (disabled only for one-shot jobs), restart policies everywhere."""
    services = _services(path)
    for name, service in services.items():
        restart = service.get("restart")
        assert isinstance(restart, str), f"{name}: no restart policy"
        assert RESTART_POLICIES.match(restart), f"{name}: restart {restart!r} restarts nothing"
        healthcheck = service.get("healthcheck")
        assert isinstance(healthcheck, dict), f"{name}: no healthcheck"
        if healthcheck.get("disable"):
            # Only a job that runs to completion has nothing to probe; the services after it wait for
            # its exit, and it must not be restarted after it succeeded.
            assert restart.startswith("on-failure"), f"{name}: a one-shot job restarts on failure only"
            waiting = [
                (other, dependency["condition"])
                for other, spec in services.items()
                for target, dependency in (spec.get("depends_on") or {}).items()
                if target == name
            ]
            assert waiting, f"{name}: health check disabled but no service waits for it"
            assert all(cond == "service_completed_successfully" for _, cond in waiting), waiting
        else:
            test = healthcheck.get("test")
            assert isinstance(test, list), f"{name}: healthcheck.test is not a list"
            assert test[0] in ("CMD", "CMD-SHELL"), f"{name}: healthcheck.test runs nothing"


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda path: path.name)
def test_dependencies_exist_and_can_be_waited_for(path: Path) -> None:
    """depends_on names services of the file, and service_healthy only services with a health check."""
    services = _services(path)
    for name, service in services.items():
        depends_on = service.get("depends_on") or {}
        for target, dependency in depends_on.items():
            assert target in services, f"{name} depends on {target!r}, which is not a service"
            if dependency.get("condition") == "service_healthy":
                assert not services[target]["healthcheck"].get("disable"), (
                    f"{name} waits for {target}'s health"
                )


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda path: path.name)
def test_dispenser_variables_are_real_settings(path: Path) -> None:
    """Every DISPENSER_* variable is a setting (or DISPENSER_CONFIG), and the values load as a Config."""
    real = _real_variables()
    dockerfile_env = _image_environment()
    assert set(dockerfile_env) <= real, "compose/Dockerfile sets a DISPENSER_* variable that is no setting"
    seen = 0
    for name, service in _services(path).items():
        environment = _environment(service)
        ours = {key: value for key, value in environment.items() if key.startswith("DISPENSER_")}
        assert sorted(set(ours) - real) == [], f"{name}: variables that are not settings"
        if ours:
            seen += 1
            load_config(environ=dockerfile_env | ours)  # raises ConfigError on a value of the wrong type
    assert seen >= 3


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda path: path.name)
def test_dispenser_commands_parse(path: Path) -> None:
    """Every ``dispenser …`` a service runs (entrypoint script or command) parses with the real CLI."""
    seen = 0
    for name, service in _services(path).items():
        if "build" not in service:
            continue
        commands = _dispenser_commands(service)
        assert commands, f"{name}: built from our image but runs no dispenser command"
        for argv in commands:
            errors = io.StringIO()
            try:
                with contextlib.redirect_stderr(errors):
                    cli._parser().parse_args(argv)
            except SystemExit:
                pytest.fail(f"{name}: `dispenser {shlex.join(argv)}`: {errors.getvalue().strip()}")
            seen += 1
    assert seen >= 5


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda path: path.name)
def test_workers_point_at_services_of_the_file(path: Path) -> None:
    """NATS, PostgreSQL, Kafka and ZooKeeper addresses name services, and Kafka is a KRaft broker."""
    services = _services(path)
    for name, service in services.items():
        environment = _environment(service)
        for variable in SERVER_SETTINGS:
            if variable in environment:
                for host in _hosts(variable, environment[variable]):
                    assert host in services, f"{name}: {variable} points at {host!r}, not a service"
    kafka = [s for s in services.values() if str(s.get("image", "")).startswith("apache/kafka:")]
    assert len(kafka) == 1, "one Kafka broker, from the official apache/kafka image"
    broker = _environment(kafka[0])
    assert set(broker["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}, "KRaft, one node"
    advertised = {_hosts("KAFKA_ADVERTISED_LISTENERS", broker["KAFKA_ADVERTISED_LISTENERS"])[0]}
    for name, service in services.items():
        environment = _environment(service)
        if environment.get("DISPENSER_KAFKA_ENABLED") == "true":
            bootstrap = environment["DISPENSER_KAFKA_BOOTSTRAP_SERVERS"]
            assert set(_hosts("bootstrap", bootstrap)) == advertised, f"{name}: not the advertised listener"


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda path: path.name)
def test_snowflake_workers_keep_their_state_in_their_own_volume(path: Path) -> None:
    """A worker serving snowflake IDs with registered worker IDs keeps its identity in a volume of its own.

    Without snowflake.address, the identity (and with it the worker ID) lives in snowflake.state_dir
    (docs/snowflake.md): a container's own file system would lose it at every re-creation, and two
    containers must not share one.
    """
    document = _load(path)
    services = document["services"]
    declared = set(document.get("volumes") or {})
    owners: dict[str, str] = {}
    workers = 0
    for name, service in services.items():
        for volume in service.get("volumes") or []:
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            if not source.startswith((".", "/")):
                assert source in declared, f"{name}: volume {source!r} is not declared"
        environment = (_image_environment() if "build" in service else {}) | _environment(service)
        if not (_serves(service) and environment.get("DISPENSER_SNOWFLAKE_ENABLED") == "true"):
            continue
        workers += 1
        mode = environment.get("DISPENSER_SNOWFLAKE_MODE", "static")
        assert mode.startswith("zookeeper"), f"{name}: worker IDs from ZooKeeper in this stack, not {mode}"
        assert environment["DISPENSER_SNOWFLAKE_ZOOKEEPER_HOSTS"]
        if "DISPENSER_SNOWFLAKE_ADDRESS" in environment:
            continue
        state_dir = environment.get("DISPENSER_SNOWFLAKE_STATE_DIR")
        assert state_dir, f"{name}: no snowflake.state_dir (the image user's home is not writable)"
        mounts = {
            target: source
            for source, _, target in (str(v).partition(":") for v in service.get("volumes") or [])
        }
        source = mounts.get(state_dir.rstrip("/"), "")
        assert source in declared, f"{name}: {state_dir} is not a named volume"
        assert owners.setdefault(source, name) == name, f"{name} and {owners[source]} share {source}"
    assert workers >= 1, "a worker serves snowflake IDs"
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text()
    state_dirs = {_environment(s).get("DISPENSER_SNOWFLAKE_STATE_DIR") for s in services.values()}
    state_dirs.add(_image_environment().get("DISPENSER_SNOWFLAKE_STATE_DIR"))
    for state_dir in state_dirs - {None}:
        # A fresh named volume takes the owner of the image's directory: it must be the image's user's.
        assert re.search(rf"chown nobody\S* {re.escape(str(state_dir))}", dockerfile), state_dir


def _ignored(patterns: list[str], path: str) -> bool:
    """Docker's .dockerignore rule, for the paths checked here: the last pattern that matches decides.

    A pattern that matches a directory matches everything under it.
    """
    parts = path.split("/")
    candidates = ["/".join(parts[:end]) for end in range(1, len(parts) + 1)]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        bare = pattern.removeprefix("!").strip("/")
        if any(fnmatch.fnmatch(candidate, bare) for candidate in candidates):
            ignored = not negated
    return ignored


def test_build_context_sends_what_the_image_needs_only() -> None:
    """.dockerignore of the build context keeps the COPY sources and drops .venv, .git and server data."""
    for path in COMPOSE_FILES:
        for name, service in _services(path).items():
            build = service.get("build")
            if build is not None:
                context = (COMPOSE_DIR / (build if isinstance(build, str) else build["context"])).resolve()
                assert context == ROOT, f"{name}: build context {context}"
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    copied = []
    for line in (COMPOSE_DIR / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            copied.extend(line.split()[1:-1])
    assert copied, "compose/Dockerfile copies nothing"
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: no such file"
        assert not _ignored(patterns, source), f"COPY {source}: excluded by .dockerignore"
    assert not _ignored(patterns, "dispenser/core/segment.py")
    for unwanted in (".venv", ".git", ".dispenser", ".servers", "tests", "dispenser/__pycache__"):
        assert _ignored(patterns, unwanted), f"{unwanted} would be sent to the Docker daemon"


def _image_tag(prefix: str) -> str:
    images = [
        str(service["image"])
        for path in COMPOSE_FILES
        for service in _services(path).values()
        if str(service.get("image", "")).startswith(prefix)
    ]
    assert len(images) == 1, f"one {prefix!r} image, found {images}"
    return images[0].removeprefix(prefix).removesuffix("-alpine")


def test_the_servers_are_the_versions_the_tests_run() -> None:
    """What compose runs is what the suite proved: the same releases (NATS and PostgreSQL by major.minor and major)."""
    nats_server = find_nats_server()
    reported = subprocess.run([nats_server, "--version"], capture_output=True, text=True, check=True).stdout
    nats_version = re.search(r"v(\d+\.\d+)\.\d+", reported)
    assert nats_version is not None, reported
    assert _image_tag("nats:") == nats_version.group(1)
    assert _image_tag("postgres:") == str(find_postgres_installs()[0].major_version)
    assert _image_tag("zookeeper:") == ZOOKEEPER_VERSION
    assert _image_tag("apache/kafka:") == KAFKA_VERSION
