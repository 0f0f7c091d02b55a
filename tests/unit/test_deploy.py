"""deploy/: Kubernetes manifests valid against Kubernetes' own schemas, and wired the way docs/kubernetes.md says.

No cluster runs here: each manifest is validated offline against the JSON schemas that the
``kubernetes-validate`` package bundles (strict: an unknown or misspelt field fails), then checked for what a
schema cannot know — the probes reach the worker's metrics port and its ``/healthz`` and ``/readyz``, the
ConfigMap's file is a configuration the dispenser accepts, every variable of the Secret is a real setting,
the state directory is a volume of the pod's own, a preStop hook runs before the drain, the
PodDisruptionBudget selects the Deployment's pods, and the Service reaches the port Leaf's HTTP API is served on.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dispenser.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
KUBERNETES_VERSION = "1.37.0"


def _documents() -> list[dict[str, Any]]:
    documents: list[dict[str, Any]] = []
    for path in MANIFESTS:
        for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            assert isinstance(document, dict), f"{path.name}: not a mapping"
            documents.append(document)
    return documents


def _one(kind: str) -> dict[str, Any]:
    found = [document for document in _documents() if document["kind"] == kind]
    assert len(found) == 1, f"expected one {kind} in deploy/, found {len(found)}"
    return found[0]


def _container() -> dict[str, Any]:
    containers = _one("Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def test_the_manifests_are_there() -> None:
    kinds = sorted(document["kind"] for document in _documents())
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Secret", "Service"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_valid_against_the_kubernetes_schemas(path: Path) -> None:
    for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_strict_validation_catches_a_misspelt_field() -> None:
    deployment = _one("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {
        "httpGet": {"path": "/readyz"}
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def _config_file() -> tuple[str, str]:
    """(mount path of the ConfigMap's file, its text), as the container sees them."""
    container = _container()
    env = {item["name"]: item.get("value") for item in container.get("env", [])}
    config_path = Path(env["DISPENSER_CONFIG"])
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in _one("Deployment")["spec"]["template"]["spec"]["volumes"]}
    config_volume = next(name for name, volume in volumes.items() if "configMap" in volume)
    assert volumes[config_volume]["configMap"]["name"] == _one("ConfigMap")["metadata"]["name"]
    assert str(config_path.parent) == mounts[config_volume]
    return str(config_path), _one("ConfigMap")["data"][config_path.name]


def test_the_configmap_holds_a_configuration_the_dispenser_accepts(tmp_path: Path) -> None:
    _, text = _config_file()
    path = tmp_path / "dispenser.toml"
    path.write_text(text, encoding="utf-8")
    secret = _one("Secret")["stringData"]
    config = load_config(path, environ=secret)  # unknown keys or bad values raise ConfigError
    assert config.metrics.port is not None
    assert config.metrics.host == "0.0.0.0", "probes and Prometheus come from outside the pod"
    assert config.postgres.dsn == secret["DISPENSER_POSTGRES_DSN"], "the Secret overrides the file"


def test_every_secret_variable_is_a_setting() -> None:
    secret = _one("Secret")
    assert secret["type"] == "Opaque"
    assert _container()["envFrom"] == [{"secretRef": {"name": secret["metadata"]["name"]}}]
    for name in secret["stringData"]:
        # load_config ignores nothing it knows: a variable that maps to no setting would be silently unused.
        section, _, key = name.removeprefix("DISPENSER_").lower().partition("_")
        defaults = load_config(None, environ={})
        assert hasattr(getattr(defaults, section), key), f"{name} is not a dispenser setting"
        assert "CHANGE-ME" in secret["stringData"][name], "a placeholder, never a real secret"


def test_probes_reach_health_endpoints_on_the_metrics_port() -> None:
    container = _container()
    _, text = _config_file()
    port = tomllib.loads(text)["metrics"]["port"]
    ports = {item["name"]: item["containerPort"] for item in container["ports"]}
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}
    for probe, path in expected.items():
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        assert ports[get["port"]] == port, f"{probe} must reach the port metrics.port serves on"


def test_a_prestop_hook_before_the_drain_and_time_for_both() -> None:
    pod = _one("Deployment")["spec"]["template"]["spec"]
    pre_stop = _container()["lifecycle"]["preStop"]
    assert pre_stop["sleep"]["seconds"] > 0
    assert pod["terminationGracePeriodSeconds"] >= pre_stop["sleep"]["seconds"] + 10


def test_the_state_directory_is_a_volume_of_the_pods_own() -> None:
    _, text = _config_file()
    settings = tomllib.loads(text)
    container = _container()
    volumes = {volume["name"]: volume for volume in _one("Deployment")["spec"]["template"]["spec"]["volumes"]}
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    for section in ("segment", "snowflake"):
        state_dir = settings[section]["state_dir"]
        assert state_dir in mounts, f"{section}.state_dir must be a mounted volume"
        volume = volumes[mounts[state_dir]]
        # Never shared between pods (docs/snowflake.md): an emptyDir, not a ReadWriteMany claim.
        assert "emptyDir" in volume, volume
    assert settings["snowflake"]["mode"] == "zookeeper-lease", "pods of a Deployment get new names"


def test_the_disruption_budget_selects_the_deployments_pods() -> None:
    deployment = _one("Deployment")
    budget = _one("PodDisruptionBudget")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]


def test_the_service_reaches_leafs_http_api_on_the_deployments_pods() -> None:
    deployment = _one("Deployment")
    service = _one("Service")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    _, text = _config_file()
    http = tomllib.loads(text)["http"]
    assert http["host"] == "0.0.0.0", "callers come from outside the pod"
    ports = {item["name"]: item["containerPort"] for item in _container()["ports"]}
    (port,) = service["spec"]["ports"]
    assert ports[port["targetPort"]] == http["port"], "the Service must reach the port http.port serves on"
