"""The Kubernetes manifests against published schemas, offline, and against what the service needs.

Built-in kinds: the Kubernetes OpenAPI schemas shipped in kubernetes-validate (strict: unknown fields
fail). ServiceMonitor and PrometheusRule: the pydantic models generated from the Prometheus Operator
CRDs (cloudcoil-models-prometheus-operator); they ignore unknown fields, so a round trip that loses
one fails. Not validated against a schema: kustomization.yaml and the prometheus-adapter Helm values
(none on PyPI); their references are checked here.
"""

from __future__ import annotations

import kubernetes_validate
import pytest
from cloudcoil.models.prometheus_operator import v1 as monitoring

from service.config import Settings
from tests.deploy.common import (
    DEPLOY,
    K8S,
    ROOT,
    dockerfile_stages,
    duration_s,
    hardening_problems,
    load_yaml,
    load_yaml_all,
)

KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())  # oldest we support, newest shipped
CRD_MODELS = {("monitoring.coreos.com/v1", "ServiceMonitor"): monitoring.ServiceMonitor,
              ("monitoring.coreos.com/v1", "PrometheusRule"): monitoring.PrometheusRule}
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "prometheus-adapter-values.yaml")


def docs_by_kind() -> dict[str, dict]:
    out = {}
    for path in MANIFESTS:
        for doc in load_yaml_all(path):
            assert doc["kind"] not in out, f"two {doc['kind']} manifests"
            out[doc["kind"]] = doc
    return out


@pytest.fixture(scope="module")
def kinds() -> dict[str, dict]:
    return docs_by_kind()


@pytest.fixture(scope="module")
def pod(kinds) -> dict:
    return kinds["Deployment"]["spec"]["template"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    (c,) = pod["spec"]["containers"]
    return c


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_matches_its_schema(path, version):
    for doc in load_yaml_all(path):
        model = CRD_MODELS.get((doc["apiVersion"], doc["kind"]))
        if model is None:
            kubernetes_validate.validate(doc, version, strict=True)
        else:
            back = model.model_validate(doc).model_dump(by_alias=True, exclude_unset=True, mode="json")
            assert back == doc, f"{path.name}: fields the {doc['kind']} CRD does not know were dropped"


def test_kustomization_applies_every_manifest():
    kustomization = load_yaml(DEPLOY / "kustomization.yaml")
    resources = {DEPLOY / r for r in kustomization["resources"]}
    assert resources == set(MANIFESTS), "kustomization.yaml and deploy/k8s/ disagree"
    for generator in kustomization["configMapGenerator"]:
        for f in generator["files"]:
            assert (DEPLOY / f).is_file(), f"configMapGenerator file {f} is missing"
    (dashboard,) = kustomization["configMapGenerator"]
    assert dashboard["options"]["labels"] == {"grafana_dashboard": "1"}


def test_four_gpus_and_shared_memory(container, pod):
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 4
    assert resources.get("requests", {}).get("nvidia.com/gpu", 4) == 4, "GPU requests must equal limits"
    (shm,) = [v for v in pod["spec"]["volumes"] if v["name"] in
              {m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"}]
    assert shm["emptyDir"]["medium"] == "Memory" and "sizeLimit" in shm["emptyDir"]
    gib = lambda q: int(q.removesuffix("Gi"))  # noqa: E731  the manifests use Gi throughout
    assert gib(resources["limits"]["memory"]) > gib(shm["emptyDir"]["sizeLimit"]), \
        "the shm tmpfs counts against the memory limit"


def test_probes_on_the_v2_health_endpoints(container):
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    fields = Settings.model_fields
    assert ports == {"http": fields["http_port"].default, "grpc": fields["grpc_port"].default}
    paths = {kind: container[kind]["httpGet"]["path"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert paths == {"startupProbe": "/v2/health/ready", "readinessProbe": "/v2/health/ready",
                     "livenessProbe": "/v2/health/live"}
    for kind in paths:
        assert container[kind]["httpGet"]["port"] in ports
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= fields["start_timeout_s"].default, \
        "the startup probe must outlast the rank group start-up limit"


def test_termination_outlasts_prestop_and_drain(container, pod):
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    drain = float(env.get("MOE_DRAIN_TIMEOUT_S", Settings.model_fields["drain_timeout_s"].default))
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    assert pod["spec"]["terminationGracePeriodSeconds"] > float(command[1]) + drain + 10


def test_environment_holds_valid_settings(container):
    env = {e["name"]: e["value"] for e in container.get("env", []) if e["name"].startswith("MOE_")}
    fields = {f"MOE_{name.upper()}": name for name in Settings.model_fields}
    assert set(env) <= set(fields), f"not settings of the service: {set(env) - set(fields)}"
    Settings(**{fields[k]: v for k, v in env.items()})


def test_runs_as_the_images_user(pod, container):
    user = dockerfile_stages()[1]["runtime"].all("USER")[-1].value
    uid, _, gid = user.partition(":")
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    assert str(security["runAsUser"]) == uid and str(security["runAsGroup"]) == (gid or uid)
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_service_servicemonitor_and_hpa_point_at_the_deployment(kinds, pod):
    labels = pod["metadata"]["labels"]
    deployment = kinds["Deployment"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()

    service = kinds["Service"]
    assert service["spec"]["selector"].items() <= labels.items()
    container_ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports

    monitor = kinds["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert duration_s(endpoint["scrapeTimeout"]) < duration_s(endpoint["interval"])

    hpa = kinds["HorizontalPodAutoscaler"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert any(m["type"] == "Pods" for m in hpa["spec"]["metrics"]), "scale on a per-pod custom metric"


def test_the_hpa_owns_the_replica_count(kinds):
    """Before: `replicas: 1` in the Deployment beside the HPA: every `kubectl apply -k` scaled an
    HPA-grown fleet back to one pod (Kubernetes' HPA docs: leave spec.replicas out)."""
    deployment, hpa = kinds["Deployment"], kinds["HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert "replicas" not in deployment["spec"], "the HPA sets the count; apply must not reset it"


def test_the_rollout_gap_is_documented(kinds):
    """maxSurge 0 / maxUnavailable 1 with the HPA's minimum of one pod: a rollout stops the only
    pod before its replacement is ready. DEPLOY must say so, and how to avoid it."""
    rolling = kinds["Deployment"]["spec"]["strategy"]["rollingUpdate"]
    if rolling["maxSurge"] == 0 and kinds["HorizontalPodAutoscaler"]["spec"]["minReplicas"] == 1:
        k8s = (ROOT / "docs" / "DEPLOY.md").read_text().split("## Kubernetes", 1)[1].split("\n## ", 1)[0]
        k8s = " ".join(k8s.split())  # (lines wrap anywhere)
        assert "every rollout is an outage" in k8s and "minReplicas: 2" in k8s, "DEPLOY must warn of the rollout gap"


def test_pod_is_hardened(pod, container):
    """Before: a writable root filesystem and the service-account token mounted."""
    assert not hardening_problems(pod["spec"], container, pod["spec"]["volumes"])


def test_disruption_budget_and_network_policy_select_the_pods(kinds, pod, container):
    labels = pod["metadata"]["labels"]
    pdb = kinds["PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"], \
        "one replica at a time, and never a budget that blocks every drain"
    policy = kinds["NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert allowed == {p["name"] for p in container["ports"]}, "ingress to exactly the service's ports"
    egress = {(p["port"], p["protocol"]) for rule in policy["spec"]["egress"] for p in rule["ports"]}
    assert egress == {(53, "UDP"), (53, "TCP")}, "egress: DNS only"
