"""deploy/: Kubernetes manifests valid against Kubernetes' own schemas, and wired the way docs/kubernetes.md says.

No cluster runs here: each manifest is validated offline against the JSON schemas that the
``kubernetes-validate`` package bundles (strict: an unknown or misspelt field fails), then checked for what a
schema cannot know — the probes reach the worker's metrics port and its ``/healthz`` and ``/readyz``, the
ConfigMap's file is a configuration the dispenser accepts, every variable of the Secret is a real setting,
the state directory is a claim of the pod's own that outlives it (a StatefulSet's volumeClaimTemplates, so a
rolling update keeps the grant memory), a preStop hook runs before the drain, the PodDisruptionBudget selects
the workers' pods, and the Service reaches the port Leaf's HTTP API is served on.
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
WORKERS = "StatefulSet"
"""The kind that runs the workers: each pod's state directory a claim of its own (docs/kubernetes.md)."""


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
    containers = _one(WORKERS)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def test_the_manifests_are_there() -> None:
    kinds = sorted(document["kind"] for document in _documents())
    assert kinds == ["ConfigMap", "PodDisruptionBudget", "Secret", "Service", "StatefulSet"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_valid_against_the_kubernetes_schemas(path: Path) -> None:
    for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_strict_validation_catches_a_misspelt_field() -> None:
    workers = _one(WORKERS)
    workers["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/readyz"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(workers, KUBERNETES_VERSION, strict=True)


def _config_file() -> tuple[str, str]:
    """(mount path of the ConfigMap's file, its text), as the container sees them."""
    container = _container()
    env = {item["name"]: item.get("value") for item in container.get("env", [])}
    config_path = Path(env["DISPENSER_CONFIG"])
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in _one(WORKERS)["spec"]["template"]["spec"]["volumes"]}
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
    pod = _one(WORKERS)["spec"]["template"]["spec"]
    pre_stop = _container()["lifecycle"]["preStop"]
    assert pre_stop["sleep"]["seconds"] > 0
    assert pod["terminationGracePeriodSeconds"] >= pre_stop["sleep"]["seconds"] + 10


def test_the_state_directory_is_a_claim_of_the_pods_own_that_outlives_it() -> None:
    """segment.state_dir and snowflake.state_dir are mounted from a volumeClaimTemplates claim, never an emptyDir.

    An emptyDir dies with its pod, so every rolling update erased the grant memory (issue 29 item 9); a
    StatefulSet's claim is handed to the pod that replaces it. ReadWriteOnce: never shared between workers.
    """
    _, text = _config_file()
    settings = tomllib.loads(text)
    workers = _one(WORKERS)
    pod_volumes = {volume["name"]: volume for volume in workers["spec"]["template"]["spec"]["volumes"]}
    claims = {
        claim["metadata"]["name"]: claim["spec"] for claim in workers["spec"].get("volumeClaimTemplates", [])
    }
    mounts = {mount["mountPath"]: mount["name"] for mount in _container()["volumeMounts"]}
    for section in ("segment", "snowflake"):
        state_dir = settings[section]["state_dir"]
        assert state_dir in mounts, f"{section}.state_dir must be a mounted volume"
        name = mounts[state_dir]
        assert name not in pod_volumes, (
            f"{section}.state_dir is a pod volume ({pod_volumes.get(name)}): it dies with the pod"
        )
        assert name in claims, f"{section}.state_dir must be a volumeClaimTemplates claim"
        assert claims[name]["accessModes"] in (["ReadWriteOnce"], ["ReadWriteOncePod"]), "never shared"
    retention = workers["spec"]["persistentVolumeClaimRetentionPolicy"]
    assert retention == {"whenScaled": "Retain", "whenDeleted": "Retain"}, "a scale-down keeps the memory"
    assert settings["snowflake"]["mode"] == "zookeeper-lease", "lease mode: IDs recycled safely"


def test_every_claim_is_mounted_and_a_rollout_replaces_one_pod_at_a_time() -> None:
    """Kubernetes refuses a claim template no container mounts; pods start in parallel, roll one by one."""
    workers = _one(WORKERS)["spec"]
    mounted = {mount["name"] for mount in _container()["volumeMounts"]}
    for claim in workers["volumeClaimTemplates"]:
        assert claim["metadata"]["name"] in mounted
    assert workers["podManagementPolicy"] == "Parallel", "no worker waits for another to be ready"
    strategy = workers["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert (
        strategy["rollingUpdate"]["maxUnavailable"] <= _one("PodDisruptionBudget")["spec"]["maxUnavailable"]
    )


def test_the_disruption_budget_selects_the_workers_pods() -> None:
    workers = _one(WORKERS)
    budget = _one("PodDisruptionBudget")
    labels = workers["spec"]["template"]["metadata"]["labels"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert workers["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["maxUnavailable"] < workers["spec"]["replicas"]


def test_the_service_reaches_leafs_http_api_on_the_workers_pods() -> None:
    workers = _one(WORKERS)
    service = _one("Service")
    labels = workers["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    _, text = _config_file()
    http = tomllib.loads(text)["http"]
    assert http["host"] == "0.0.0.0", "callers come from outside the pod"
    ports = {item["name"]: item["containerPort"] for item in _container()["ports"]}
    (port,) = service["spec"]["ports"]
    assert ports[port["targetPort"]] == http["port"], "the Service must reach the port http.port serves on"
