"""Deploy files that run, checked offline (no Docker daemon or cluster here):

- docker-compose.yml against the Compose Specification's JSON schema (deploy/schemas/compose-spec), and per
  profile (none, ha, gpu): every dependency and mounted file exists, every gateway config is valid and names
  only workers the profile starts, Prometheus finds targets by DNS (so only services that run) and its config
  passes `promtool check config`;
- the Kubernetes kustomizations (base = GPU workers, overlays/cpu, overlays/sim) rendered with `kubectl
  kustomize`, every object against Kubernetes 1.37's schemas (strict, kubernetes-validate) and the KEDA
  ScaledObjects against KEDA's CRD schema (deploy/schemas/keda), plus what ties them together (ScaledObject ->
  StatefulSet, gateway config -> headless Services -> pods, images named in one place)."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.config import GatewayConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy/kubernetes"
KUBE_VERSION = "1.37.0"
PROFILES = (None, "ha", "gpu", "autoscale")
SCRAPED = ("gateway", "sim", "vllm")  # services exporting /metrics: gateway*, sim, vllm-*


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def started(doc: dict, profile: str | None) -> dict[str, dict]:
    return {n: s for n, s in doc["services"].items() if not s.get("profiles") or profile in s["profiles"]}


def test_compose_file_matches_the_compose_spec_schema() -> None:
    schema = json.loads((ROOT / "deploy/schemas/compose-spec/compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(compose())
    broken = copy.deepcopy(compose())
    broken["services"]["gateway"]["profile"] = ["typo"]  # the schema does catch a misspelt key
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(broken)


@pytest.mark.parametrize("profile", PROFILES)
def test_each_compose_profile_is_a_complete_stack(profile: str | None, tmp_path) -> None:
    doc = compose()
    services = started(doc, profile)
    assert {"redis", "sim", "gateway", "prometheus", "grafana"} <= set(services)
    for name, svc in services.items():
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{name} depends on {dep}, which profile {profile} does not start"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src == "/var/run/docker.sock":  # the host's Docker socket (profile autoscale)
                assert name == "gateway-autoscale" and profile == "autoscale"
                continue
            assert (ROOT / src).exists(), f"{name} mounts {src}, which does not exist"
        if svc.get("command", [None])[0] == "serve":
            cfg_src = next(v.split(":")[0] for v in svc["volumes"] if v.endswith("fleetgate.yaml:ro"))
            cfg = load_config(ROOT / cfg_src)
            hosts = {re.match(r"https?://([^:/]+)", w.url).group(1) for w in cfg.workers}
            hosts |= {e.dns for e in cfg.worker_discovery}
            assert hosts and hosts <= set(services), f"{name}'s workers {hosts} are not all started by {profile}"
            if cfg.autoscale.actuator.kind == "docker":  # it scales services of this file, through the socket
                assert set(cfg.autoscale.actuator.docker.services.values()) <= hosts
                assert any(v.startswith(cfg.autoscale.actuator.docker.socket + ":") for v in svc["volumes"])
            redis = svc["command"][svc["command"].index("--redis-url") + 1] if "--redis-url" in svc["command"] else ""
            assert not redis or "redis" in services
    ports = [p.split(":")[0] for s in services.values() for p in s.get("ports", [])]
    assert len(ports) == len(set(ports)), f"profile {profile} publishes a host port twice: {ports}"
    # Prometheus: targets by DNS name, one per service that exports metrics, never a static (always-on) target.
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    names = {n for job in prom["scrape_configs"] for sd in job.get("dns_sd_configs", []) for n in sd["names"]}
    assert not any("static_configs" in job for job in prom["scrape_configs"])
    assert names <= set(doc["services"])
    assert {n for n in services if n.startswith(SCRAPED)} <= names


def test_prometheus_config_passes_promtool(tmp_path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is needed: apt-get install prometheus (.ci/run does)"
    cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    shutil.copy(ROOT / "deploy/prometheus/alerts.yml", tmp_path / "alerts.yml")
    cfg["rule_files"] = [str(tmp_path / "alerts.yml")]  # the container's path, here
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    r = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# --- Kubernetes ------------------------------------------------------------------------------------------------
def render(kustomization: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with its built-in kustomize) is needed to render deploy/kubernetes"
    r = subprocess.run([kubectl, "kustomize", str(K8S / kustomization)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def keda_schema() -> dict:
    crd = yaml.safe_load((ROOT / "deploy/schemas/keda/keda.sh_scaledobjects.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return version["schema"]["openAPIV3Schema"]


def validate(doc: dict) -> None:
    if doc["kind"] == "ScaledObject":
        jsonschema.Draft7Validator(keda_schema()).validate(doc)
    else:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("kustomization", ["base", "overlays/cpu", "overlays/sim"])
def test_kubernetes_manifests_validate_and_fit_together(kustomization: str) -> None:
    docs = render(kustomization)
    for doc in docs:
        validate(doc)
    by_kind: dict[str, dict[str, dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    sts = by_kind["StatefulSet"]
    assert set(sts) == {"vllm-interactive", "vllm-mixed", "vllm-batch"}
    assert {"fleetgate", "fleetgate-redis"} <= set(by_kind["Deployment"])
    # KEDA scales the StatefulSets the manifests ship, from the gateway's desired worker counts.
    cfg = load_gateway_config(by_kind["ConfigMap"]["fleetgate-config"])
    assert cfg.workers == [], "pods are found through DNS, not listed"
    found = {e.dns: e for e in cfg.worker_discovery}
    assert len(found) == len(cfg.worker_discovery) == len(by_kind["ScaledObject"])
    for so in by_kind["ScaledObject"].values():
        target = so["spec"]["scaleTargetRef"]
        assert target["kind"] == "StatefulSet" and target["name"] in sts
        pool = target["name"].removeprefix("vllm-")
        assert f'fleetgate_desired_workers{{pool="{pool}"}}' in so["spec"]["triggers"][0]["metadata"]["query"]
        # the gateway resolves the StatefulSet's headless Service, whose DNS name lists exactly its ready pods,
        # so every pod KEDA starts is found with its pool label, up to any maxReplicaCount
        st = sts[target["name"]]
        svc = by_kind["Service"][st["spec"]["serviceName"]]
        assert svc["spec"]["clusterIP"] == "None" and not svc["spec"].get("publishNotReadyAddresses")
        assert svc["spec"]["selector"] == st["spec"]["selector"]["matchLabels"]
        entry = found[svc["metadata"]["name"]]
        pod = _containers(st)[0]
        assert entry.labels == {"pool": pool}
        assert entry.port == svc["spec"]["ports"][0]["port"] == pod["ports"][0]["containerPort"]
        # the preStop hook drains the pod under the id the gateway gives it: <StatefulSet>-<pod IP>:<port>
        assert entry.prefix() == target["name"] and {"name": "POD_IP", "valueFrom": {
            "fieldRef": {"fieldPath": "status.podIP"}}} in pod["env"]
        hook = " ".join(pod["lifecycle"]["preStop"]["exec"]["command"])
        assert ("${HOSTNAME%-*}-$POD_IP:8000/drain" in hook
                or "nodename.rsplit('-', 1)[0] + '-' + os.environ['POD_IP'] + ':8000/drain'" in hook), hook
    images = [c["image"] for d in docs for c in _containers(d)]
    assert all(":" in i and not i.endswith(":latest") for i in images), images  # every image pinned
    gpus = ["nvidia.com/gpu" in json.dumps(c.get("resources", {})) for s in sts.values() for c in _containers(s)]
    assert all(gpus) if kustomization == "base" else not any(gpus)
    if kustomization == "overlays/sim":
        assert all(c["args"][0] == "sim" for s in sts.values() for c in _containers(s))
        gateway_image = _containers(by_kind["Deployment"]["fleetgate"])[0]["image"]
        assert all(c["image"] == gateway_image for s in sts.values() for c in _containers(s))


def test_kubernetes_validation_catches_mistakes() -> None:
    docs = render("base")
    dep = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    dep["spec"]["replica"] = 2  # misspelt field
    with pytest.raises(Exception, match="replica"):
        validate(dep)
    so = copy.deepcopy(next(d for d in docs if d["kind"] == "ScaledObject"))
    so["spec"]["minReplicaCount"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        validate(so)


def load_gateway_config(config_map: dict) -> GatewayConfig:
    path = Path(__file__).parent / ".k8s-fleetgate.yaml"
    try:
        path.write_text(config_map["data"]["fleetgate.yaml"])
        return load_config(path)
    finally:
        path.unlink(missing_ok=True)


def _containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", [])
