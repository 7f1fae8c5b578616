"""deploy/kserve/ (ServingRuntime + InferenceService) against KServe's own models and against what
the service needs.

No JSON schema of the KServe CRDs ships on PyPI; the KServe SDK (`kserve`) carries their
OpenAPI-generated models (and `kubernetes` those of the core objects inside them); kserve_models.py
lists their fields. Every field of the manifests, at every depth, must be one those models
declare, with a value of the declared kind: stricter than KServe's API server, which prunes
unknown fields silently. The pod parts (containers, volumes, security context) are then validated
strictly against the Kubernetes schemas, as the plain manifests are in test_k8s.py.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys

import kubernetes_validate
import pytest
from cloudcoil.models.prometheus_operator import v1 as monitoring

from service.config import Settings
from tests.deploy.common import (
    ALERTS,
    DEPLOY,
    K8S,
    ROOT,
    dockerfile_stages,
    hardening_problems,
    load_yaml,
    load_yaml_all,
)

KSERVE = DEPLOY / "kserve"
MODELS = {("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
          ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService"}
PODMONITOR = ("monitoring.coreos.com/v1", "PodMonitor")
QUANTITY = (str, int, float)  # quantities (and int-or-string fields typed str) are numbers in YAML too
SCALARS = {"str": QUANTITY, "ResourceQuantity": QUANTITY, "int": (int,), "float": (int, float), "bool": (bool,),
           "object": (object,), "datetime": (str,)}


@functools.cache
def model_fields() -> dict[str, dict[str, str]]:
    """{model: {JSON field: type}} from the SDKs, in a process of its own (see kserve_models.py)."""
    run = subprocess.run([sys.executable, "-m", "tests.deploy.kserve_models"], capture_output=True, text=True,
                         timeout=120, check=True, cwd=ROOT)
    return json.loads(run.stdout)


def field_problems(value, type_name: str, where: str) -> list[str]:
    """Every field of `value` that the generated model `type_name` does not declare, or whose value
    is not of the declared kind, by path."""
    if m := re.fullmatch(r"[lL]ist\[(.+)\]", type_name):  # kserve writes list[...], kubernetes List[...]
        if not isinstance(value, list):
            return [f"{where}: a list expected, got {value!r}"]
        return [p for i, item in enumerate(value) for p in field_problems(item, m.group(1), f"{where}[{i}]")]
    if m := re.fullmatch(r"dict\(str, (.+)\)|Dict\[str, (.+)\]", type_name):
        if not isinstance(value, dict):
            return [f"{where}: a map expected, got {value!r}"]
        inner = m.group(1) or m.group(2)
        return [p for k, item in value.items() for p in field_problems(item, inner, f"{where}.{k}")]
    if type_name in SCALARS:
        ok = isinstance(value, SCALARS[type_name]) and not (type_name == "int" and isinstance(value, bool))
        return [] if ok else [f"{where}: {type_name} expected, got {value!r}"]
    declared = model_fields()[type_name]
    if not isinstance(value, dict):
        return [f"{where}: a {type_name} object expected, got {value!r}"]
    problems = []
    for key, item in value.items():
        if key not in declared:
            problems.append(f"{where}.{key}: {type_name} has no such field")
        else:
            problems += field_problems(item, declared[key], f"{where}.{key}")
    return problems


def manifests() -> dict[str, dict]:
    out = {}
    for path in sorted(KSERVE.glob("*.yaml")):
        for doc in load_yaml_all(path):
            out[doc["kind"]] = doc
    return out


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    return manifests()


@pytest.fixture(scope="module")
def runtime(docs) -> dict:
    return docs["ServingRuntime"]["spec"]


@pytest.fixture(scope="module")
def predictor(docs) -> dict:
    return docs["InferenceService"]["spec"]["predictor"]


@pytest.fixture(scope="module")
def container(runtime) -> dict:
    (c,) = runtime["containers"]
    return c


def test_both_kinds_are_there(docs):
    assert {(d["apiVersion"], d["kind"]) for d in docs.values()} == {*MODELS, PODMONITOR}


@pytest.mark.parametrize("kind", ["ServingRuntime", "InferenceService"])
def test_every_field_is_one_kserve_declares(docs, kind):
    doc = docs[kind]
    assert not field_problems(doc, MODELS[(doc["apiVersion"], kind)], kind)


def test_the_field_check_can_fail():
    assert field_problems({"spec": {"containers": [{"name": "c", "imagee": "x"}]}}, "V1alpha1ServingRuntime", "r")
    assert field_problems({"spec": {"predictor": {"minReplicas": "one"}}}, "V1beta1InferenceService", "i")


@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
def test_pod_parts_match_the_kubernetes_schemas(runtime, predictor, version):
    pod_fields = {k: v for k, v in predictor.items() if k not in kserve_only_fields()}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "moe"},
           "spec": {**pod_fields, "containers": runtime["containers"], "volumes": runtime["volumes"]}}
    kubernetes_validate.validate(pod, version, strict=True)


def kserve_only_fields() -> set[str]:
    """PredictorSpec's own fields (not a PodSpec's), by JSON name."""
    return set(model_fields()["V1beta1PredictorSpec"]) - set(model_fields()["V1PodSpec"])


def test_the_inference_service_runs_on_the_runtime(docs, runtime, predictor, container):
    model = predictor["model"]
    assert model["runtime"] == docs["ServingRuntime"]["metadata"]["name"]
    formats = {(f["name"], f.get("version")) for f in runtime["supportedModelFormats"]}
    assert (model["modelFormat"]["name"], model["modelFormat"].get("version")) in formats
    assert model["protocolVersion"] in runtime["protocolVersions"]
    env = {e["name"]: e["value"] for e in container["env"]}
    # KServe routes /v2/models/<InferenceService name>/...: the service must serve that name.
    assert env["MOE_MODEL_NAME"] == docs["InferenceService"]["metadata"]["name"]
    fields = {f"MOE_{name.upper()}": name for name in Settings.model_fields}
    moe_env = {k: v for k, v in env.items() if k.startswith("MOE_")}
    assert set(moe_env) <= set(fields), f"not settings of the service: {set(moe_env) - set(fields)}"
    Settings(**{fields[k]: v for k, v in moe_env.items()})
    port = container["ports"][0]  # (the one KServe's Service serves on port 80)
    assert port["containerPort"] == int(env["MOE_HTTP_PORT"]) == 8080, "KServe's REST port"
    for probe, path in (("startupProbe", "/v2/health/ready"), ("readinessProbe", "/v2/health/ready"),
                        ("livenessProbe", "/v2/health/live")):
        assert container[probe]["httpGet"] == {"path": path, "port": port["containerPort"]}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= Settings.model_fields["start_timeout_s"].default
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert docs["InferenceService"]["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"


def test_hardened_and_run_as_the_images_user(runtime, predictor, container):
    assert not hardening_problems(predictor, container, runtime["volumes"])
    uid, _, gid = dockerfile_stages()[1]["runtime"].all("USER")[-1].value.partition(":")
    for security in (predictor["securityContext"], container["securityContext"]):
        assert str(security["runAsUser"]) == uid and str(security["runAsGroup"]) == (gid or uid)


def test_metrics_annotations_are_where_kserve_reads_them(docs, runtime):
    """Before: under the ServingRuntime's metadata.annotations, which KServe never copies to the pods
    (it merges spec.annotations, ServingRuntimePodSpec's, into the predictor's pod metadata). And no
    `serving.kserve.io/enable-prometheus-scraping: "true"`: KServe then sets prometheus.io/port to
    queue-proxy's 9091 (9088 with aggregation), absent from a RawDeployment pod (kserve/kserve,
    pkg/webhook/admission/pod/metrics_aggregate_injector.go); podmonitor.yaml scrapes instead."""
    env = {e["name"]: e["value"] for e in runtime["containers"][0]["env"]}
    assert runtime["annotations"] == {"prometheus.kserve.io/port": env["MOE_HTTP_PORT"],
                                      "prometheus.kserve.io/path": "/metrics"}
    assert not any(k.startswith("prometheus") for k in docs["ServingRuntime"]["metadata"].get("annotations", {}))
    isvc_annotations = docs["InferenceService"]["metadata"]["annotations"]
    assert isvc_annotations.get("serving.kserve.io/enable-prometheus-scraping") == "false"  # (not a cluster default)


def alerts_job() -> str:
    """The job label the shipped alerts ask `up` for."""
    (expr,) = [r["expr"] for g in load_yaml(ALERTS)["groups"] for r in g["rules"] if r.get("alert") == "MoeServeDown"]
    (job,) = set(re.findall(r'job="([^"]+)"', expr))
    return job


def test_the_podmonitor_scrapes_the_kserve_pods_as_the_alerts_job(docs, container):
    """Before: nothing scraped the KServe pods, and a Prometheus Operator target's job would have been
    `<namespace>/<monitor>`, which MoeServeDown's `up{job="moe-serve"}` never matches."""
    monitor = docs["PodMonitor"]
    back = monitoring.PodMonitor.model_validate(monitor).model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert back == monitor, "fields the PodMonitor CRD does not know were dropped"
    # KServe labels each predictor pod serving.kserve.io/inferenceservice=<InferenceService name>
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "serving.kserve.io/inferenceservice": docs["InferenceService"]["metadata"]["name"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    http = container["ports"][0]
    assert endpoint["port"] == http["name"] and endpoint["path"] == "/metrics"
    assert endpoint["relabelings"] == [{"targetLabel": "job", "replacement": alerts_job()}]
    assert monitor["metadata"]["labels"]["release"] == load_yaml(K8S / "servicemonitor.yaml")["metadata"]["labels"][
        "release"]


def test_the_grpc_port_is_declared(runtime, container):
    """Before: only http1 8080 declared while gRPC listens on 8081 and protocolVersions has grpc-v2:
    KServe's Service had no gRPC port. RawDeployment makes every declared port a Service port, with
    appProtocol kubernetes.io/h2c for a name with `h2c` or `grpc` (service_reconciler.go)."""
    assert "grpc-v2" in runtime["protocolVersions"]
    env = {e["name"]: e["value"] for e in container["env"]}
    grpc = [p for p in container["ports"] if p["containerPort"] == int(env["MOE_GRPC_PORT"])]
    assert len(grpc) == 1 and ("h2c" in grpc[0]["name"] or "grpc" in grpc[0]["name"]), container["ports"]


def test_termination_as_the_deployment(predictor, container):
    """Before: no preStop sleep, so the pod stopped serving before its endpoint removal reached the proxies."""
    (deployment,) = [d for d in load_yaml_all(K8S / "deployment.yaml") if d["kind"] == "Deployment"]
    (k8s_container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["lifecycle"] == k8s_container["lifecycle"]
    assert predictor["terminationGracePeriodSeconds"] == deployment["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]


def test_the_kserve_pods_are_not_selected_by_the_plain_manifests(docs):
    """Before: the InferenceService's label `app.kubernetes.io/name: moe-serve`, which KServe copies
    onto its pods, is what deploy/k8s's Service, NetworkPolicy and PodDisruptionBudget select: in
    the same namespace they would send the Service's traffic to the KServe pods, fence them, and
    count them in the budget."""
    pod_labels = {**docs["InferenceService"]["metadata"].get("labels", {}),
                  "serving.kserve.io/inferenceservice": docs["InferenceService"]["metadata"]["name"]}
    for path in K8S.glob("*.yaml"):
        for doc in load_yaml_all(path):
            spec = doc.get("spec", {})
            for selector in (spec.get("selector"), spec.get("podSelector")):
                if isinstance(selector, dict):
                    wanted = selector.get("matchLabels", selector)
                    assert not wanted.items() <= pod_labels.items(), \
                        f"{doc['kind']} {path.name} selects the KServe pods"


def test_the_walkthrough_pushes_the_image_and_applies_every_file():
    """Before: DEPLOY's KServe commands applied a runtime naming `moe-serve:0.1.0`, an image no node
    can pull, and left the PodMonitor out."""
    section = (ROOT / "docs" / "DEPLOY.md").read_text().split("## KServe", 1)[1].split("\n## ", 1)[0]
    commands = "\n".join(ln.strip() for ln in section.splitlines() if ln.startswith("    "))
    assert "docker push REGISTRY/moe-serve:" in commands and "image: REGISTRY/moe-serve:" in commands, commands
    for path in sorted(KSERVE.glob("*.yaml")):
        assert f"deploy/kserve/{path.name}" in commands, f"the walkthrough does not apply {path.name}"
