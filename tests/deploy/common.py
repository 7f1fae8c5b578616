"""Helpers of the deployment tests: paths, YAML, the Dockerfile's stages, .dockerignore, PromQL
metric names and a Prometheus scrape (the moe-serve process is tests/serverproc.py)."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
import shlex
from pathlib import Path

import httpx
import promql_parser
import yaml
from dockerfile_parse import DockerfileParser
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE = ROOT / "docker-compose.yml"
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "moe-serve.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
SCRIPTS = DEPLOY / "docker"  # copied into the image; the Dockerfile's RUN steps call them

# Grafana's variables stand for these when a dashboard query is parsed as PromQL.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h", "$instance": ".*"}
# Series Prometheus makes itself for every target; the service cannot export them.
PROMETHEUS_OWN = {"up"}
# Labels Prometheus adds to every scraped series (target labels), absent from /metrics.
TARGET_LABELS = {"instance", "job", "namespace", "pod", "service", "endpoint", "container"}


def load_yaml(path: Path):
    with open(path) as f:
        return yaml.safe_load(f)


def load_yaml_all(path: Path) -> list:
    with open(path) as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


# ---- Dockerfile --------------------------------------------------------------------------------


@dataclasses.dataclass
class Instruction:
    name: str    # RUN, COPY, ... (upper case)
    value: str   # the arguments, continuation lines joined
    line: int    # 1-based line of the instruction


@dataclasses.dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction]

    def all(self, name: str) -> list[Instruction]:
        return [i for i in self.instructions if i.name == name]

    def one(self, name: str) -> Instruction:
        found = self.all(name)
        assert len(found) == 1, f"stage {self.name}: expected one {name}, found {len(found)}"
        return found[0]

    def env(self) -> dict[str, str]:
        """ENV of this stage, in order, values unexpanded (`$PATH` stays as written)."""
        out: dict[str, str] = {}
        for inst in self.all("ENV"):
            out.update(assignments(inst.value))
        return out

    def args(self) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for inst in self.all("ARG"):
            out.update(arg_declaration(inst.value))
        return out


def dockerfile_stages(path: Path = DOCKERFILE) -> tuple[dict[str, str | None], dict[str, Stage]]:
    """Global ARGs (before the first FROM) and the stages by name, from dockerfile-parse."""
    parser = DockerfileParser(str(path))
    global_args: dict[str, str | None] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for item in parser.structure:
        inst = Instruction(item["instruction"].upper(), item["value"], item["startline"] + 1)
        if inst.name == "COMMENT":
            continue
        if inst.name == "FROM":
            words = inst.value.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            current = Stage(name, words[0], [])
            stages[name] = current
        elif current is None:
            assert inst.name == "ARG", f"line {inst.line}: only ARG may precede the first FROM"
            global_args.update(arg_declaration(inst.value))
        else:
            current.instructions.append(inst)
    return global_args, stages


def assignments(value: str) -> dict[str, str]:
    """`K=V K2="v 2"` (the ENV and LABEL form) -> dict."""
    out = {}
    for word in shlex.split(value):
        key, eq, val = word.partition("=")
        assert eq, f"use the KEY=VALUE form, not {value!r}"
        out[key] = val
    return out


def arg_declaration(value: str) -> dict[str, str | None]:
    word = shlex.split(value)
    assert len(word) == 1, f"one ARG per line, got {value!r}"
    key, eq, default = word[0].partition("=")
    return {key: default if eq else None}


def exec_form(value: str) -> list[str]:
    """The JSON (exec) form of ENTRYPOINT / CMD / HEALTHCHECK CMD, or an AssertionError."""
    try:
        words = json.loads(value)
    except json.JSONDecodeError:
        raise AssertionError(f"not in exec (JSON) form: {value!r}") from None
    assert isinstance(words, list) and all(isinstance(w, str) for w in words), value
    return words


def split_flags(value: str) -> tuple[list[str], str]:
    """Leading `--flag=...` words of RUN / COPY / HEALTHCHECK, and the rest."""
    flags = []
    rest = value.strip()
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        flags.append(word)
        rest = rest.strip()
    return flags, rest


def healthcheck(stage: Stage) -> tuple[dict[str, str], list[str]]:
    """HEALTHCHECK options (--interval=15s -> {'interval': '15s'}) and its exec-form command."""
    flags, rest = split_flags(stage.one("HEALTHCHECK").value)
    options = dict(f[2:].split("=", 1) for f in flags)
    assert rest.startswith("CMD "), f"HEALTHCHECK must run a command, got {rest!r}"
    return options, exec_form(rest[4:])


def duration_s(text: str | int | float) -> float:
    """A Docker / Prometheus duration ('1m30s', '600s', '15s', '2m') in seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def dockerignore_patterns(path: Path = DOCKERIGNORE) -> list[str]:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def in_build_context(relpath: str, patterns: list[str]) -> bool:
    """Whether Docker sends `relpath` with the build context: the last pattern that matches the
    path or one of its parent folders decides (`!` lets it through). fnmatch's `*` also crosses
    `/`, which is close enough for the allow-list this project keeps."""
    parts = Path(relpath).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    included = True
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        if pat.startswith("**/"):
            candidates = [pat, pat[3:]]
        else:
            candidates = [pat]
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates):
            included = negate
    return included


# ---- PromQL and scrapes ------------------------------------------------------------------------


def promql(expr: str):
    """Parse a PromQL expression (Grafana variables replaced); ValueError names the problem."""
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    return promql_parser.parse(expr)


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names in its matchers) of every series selector in `expr`."""
    found = []

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            matchers = node.matchers.matchers
            name = node.name or next((m.value for m in matchers if m.name == "__name__"), None)
            assert name, f"a selector without a metric name in {expr!r}"
            found.append((name, {m.name for m in matchers if m.name != "__name__"}))

    promql_parser.walk(promql(expr), visit)
    return found


def grouping_labels(expr: str) -> set[str]:
    """Label names of every `by (...)` clause in `expr`."""
    labels: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            if node.modifier.type == promql_parser.AggModifierType.By:
                labels.update(node.modifier.labels)

    promql_parser.walk(promql(expr), visit)
    return labels


def scrape(url: str) -> dict[str, set[str]]:
    """Sample name -> label names seen on it, from a Prometheus text exposition at `url`."""
    response = httpx.get(url, timeout=10)
    response.raise_for_status()
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


# ---- pod hardening (deploy/k8s/deployment.yaml, deploy/kserve/) ----------------------------------

CACHE_VARIABLES = ("TRITON_HOME", "TORCHINDUCTOR_CACHE_DIR", "XDG_CACHE_HOME", "CUDA_CACHE_PATH")


def hardening_problems(pod_spec: dict, container: dict, volumes: list[dict]) -> list[str]:
    """What keeps a pod spec from the hardened shape: no service-account token, a read-only root
    filesystem with /tmp and every run-time cache on an emptyDir, no capabilities, no escalation."""
    problems = []
    if pod_spec.get("automountServiceAccountToken") is not False:
        problems.append("automountServiceAccountToken must be false")
    security = container.get("securityContext", {})
    if security.get("readOnlyRootFilesystem") is not True:
        problems.append("readOnlyRootFilesystem must be true")
    if security.get("allowPrivilegeEscalation") is not False:
        problems.append("allowPrivilegeEscalation must be false")
    if security.get("capabilities", {}).get("drop") != ["ALL"]:
        problems.append("capabilities must drop ALL")
    if True not in (security.get("runAsNonRoot"), pod_spec.get("securityContext", {}).get("runAsNonRoot")):
        problems.append("runAsNonRoot must be true")
    empty_dirs = {v["name"] for v in volumes if "emptyDir" in v}
    scratch = [m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in empty_dirs]
    env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    for name, path in [("/tmp", "/tmp")] + [(v, env.get(v, "")) for v in CACHE_VARIABLES]:
        if not any(path == d or path.startswith(d.rstrip("/") + "/") for d in scratch):
            problems.append(f"{name} ({path or 'unset'}) is not on a writable emptyDir (those: {scratch})")
    return problems
