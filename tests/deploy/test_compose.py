"""docker-compose.yml against the Compose Specification schema (vendored in check-jsonschema, from
PyPI, so no download at test time) and against what the service needs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from service.config import Settings
from tests.deploy.common import (
    COMPOSE,
    DEPLOY,
    PROMETHEUS_CONFIG,
    ROOT,
    dockerfile_stages,
    duration_s,
    healthcheck,
    load_yaml,
)

INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's `${VAR}` / `${VAR:-default}` with an empty environment unless given."""
    env = env or {}
    return INTERPOLATION.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), text)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(COMPOSE)


@pytest.fixture(scope="module")
def moe(compose) -> dict:
    return compose["services"]["moe-serve"]


def test_matches_the_compose_specification_schema():
    check = Path(sys.executable).parent / "check-jsonschema"
    result = subprocess.run([str(check), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_reserves_four_nvidia_gpus(moe):
    devices = moe["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 4, "capabilities": ["gpu"]}]


def test_shared_memory_and_memlock(moe):
    assert moe.get("ipc") == "host" or moe.get("shm_size"), "ranks and NCCL need a large /dev/shm"
    memlock = moe["ulimits"]["memlock"]
    assert memlock == -1 or memlock == {"soft": -1, "hard": -1}


def test_publishes_the_default_ports(moe):
    fields = Settings.model_fields
    wanted = {f"{p}:{p}" for p in (fields["http_port"].default, fields["grpc_port"].default)}
    assert wanted <= {interpolate(p) for p in moe["ports"]}


def test_the_containers_ports_are_the_defaults_whatever_the_settings_say(moe):
    """Before: "8000:8000" published and Prometheus on moe-serve:8000 while DEPLOY said to set
    MOE_HTTP_PORT: with MOE_HTTP_PORT=9000 the server listened on 9000, clients and Prometheus were
    refused, and the healthcheck (it reads MOE_HTTP_PORT) said healthy. The container side of every
    published port is the default, pinned in `environment` (which wins over every env_file); only
    the host side may be changed."""
    fields = Settings.model_fields
    defaults = {"MOE_HTTP_PORT": fields["http_port"].default, "MOE_GRPC_PORT": fields["grpc_port"].default}
    env = moe["environment"]
    assert {k: int(interpolate(str(env.get(k)))) for k in defaults} == defaults, env
    moved = {"HTTP_HOST_PORT": "9000", "GRPC_HOST_PORT": "9001", "MOE_HTTP_PORT": "7000", "MOE_GRPC_PORT": "7001"}
    container_ports = sorted(int(interpolate(p, moved).rsplit(":", 1)[1]) for p in moe["ports"])
    assert container_ports == sorted(defaults.values()), moe["ports"]
    assert sorted(interpolate(p, moved) for p in moe["ports"]) == ["9000:8000", "9001:8001"]


def test_deploy_never_tells_compose_users_to_set_the_ports():
    """Before: docs/DEPLOY.md's image section said to set MOE_HTTP_PORT / MOE_GRPC_PORT, with no
    word that compose publishes and scrapes the defaults. Every paragraph of the image and compose
    sections that says to set them must say that compose pins them, and the compose section says how to
    change the host side (HTTP_HOST_PORT, in the .env example it copies)."""
    text = (ROOT / "docs" / "DEPLOY.md").read_text()
    image = text.split("## The image", 1)[1].split("\n## ", 1)[0]
    compose = text.split("## docker compose", 1)[1].split("\n## ", 1)[0]
    for para in re.split(r"\n- |\n\n", image + compose):
        if ("MOE_HTTP_PORT" in para or "MOE_GRPC_PORT" in para) and re.search(r"\bset\b", para, re.I):
            assert "compose" in para and "pin" in para and "HTTP_HOST_PORT" in para, para
    assert "HTTP_HOST_PORT" in compose and "HTTP_HOST_PORT" in (DEPLOY / "compose.env.example").read_text()


def test_no_compose_variable_reaches_the_service(compose, moe):
    """Before: `env_file: .env`, the file that holds GRAFANA_ADMIN_PASSWORD, was all passed to
    moe-serve (visible in its /proc/1/environ, `docker inspect`, any crash dump). The service's
    env files hold only MOE_* settings and are not compose's .env; the files an operator fills in
    are never committed."""
    paths = [f["path"] if isinstance(f, dict) else f for f in moe["env_file"]]
    assert ".env" not in paths, paths
    for path in paths:  # the operator's own moe-serve.env is not in the tree: its example is
        example = DEPLOY / "env.example" if path == "moe-serve.env" else ROOT / path
        assert all(ln.split("=", 1)[0].startswith("MOE_") for ln in example.read_text().splitlines()
                   if ln.strip() and not ln.startswith("#")), path
    for name in ("GRAFANA_ADMIN_PASSWORD", "GRAFANA_ADMIN_USER"):
        assert all(name not in str(v) for v in moe.get("environment", {}).values())
    assert "GRAFANA_ADMIN_PASSWORD" not in (DEPLOY / "env.example").read_text()
    ignored = subprocess.run(["git", "check-ignore", "--no-index", ".env", "moe-serve.env", "checkpoints/x"],
                             cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.split()
    assert ignored == [".env", "moe-serve.env", "checkpoints/x"], ignored


def test_healthcheck_is_the_images_and_outlasts_the_start(moe):
    _, image_cmd = healthcheck(dockerfile_stages()[1]["runtime"])
    hc = moe["healthcheck"]
    assert hc["test"] == ["CMD", *image_cmd]
    start_timeout = Settings.model_fields["start_timeout_s"].default
    assert duration_s(hc["start_period"]) >= start_timeout, "start_period must cover the rank group start"


def test_stop_grace_period_exceeds_the_drain(moe):
    drain = float(interpolate(str(moe.get("environment", {}).get("MOE_DRAIN_TIMEOUT_S", "")))
                  or Settings.model_fields["drain_timeout_s"].default)
    assert duration_s(moe["stop_grace_period"]) > drain + 10, "leave time for the rank group to stop after the drain"


def test_builds_the_image_from_this_dockerfile(moe):
    assert moe["build"]["context"] == "."
    assert (ROOT / moe["build"].get("dockerfile", "Dockerfile")).is_file()


def test_environment_holds_valid_settings(moe):
    """Every MOE_* variable compose sets (its committed env file, then `environment`) is a setting
    and its default value passes Settings."""
    defaults = (ROOT / "deploy" / "compose.defaults.env").read_text().splitlines()
    env = dict(ln.split("=", 1) for ln in defaults if ln.strip() and not ln.startswith("#"))
    env.update({k: interpolate(str(v)) for k, v in moe.get("environment", {}).items()})
    assert env["MOE_DEVICE"] == "cuda", "on a GPU host a missing GPU must fail, not fall back to the CPU preset"
    fields = {f"MOE_{name.upper()}": name for name in Settings.model_fields}
    unknown = [k for k in env if k.startswith("MOE_") and k not in fields]
    assert not unknown, f"not settings of the service: {unknown}"
    Settings(**{fields[k]: v for k, v in env.items() if k in fields and v != ""})


def test_checkpoint_mounted_read_only(moe):
    mounts = [interpolate(v) for v in moe["volumes"]]
    models = [m for m in mounts if m.split(":")[1] == "/models"]
    assert len(models) == 1 and models[0].endswith(":ro"), f"the checkpoint folder must be mounted read-only: {mounts}"
    env_files = moe.get("env_file", [])
    assert env_files[-1] == {"path": "moe-serve.env", "required": False}, \
        "MOE_WEIGHTS comes from moe-serve.env, the last (winning) env file; synthetic when unset"
    assert "MOE_WEIGHTS" not in moe.get("environment", {}), "compose must not pin MOE_WEIGHTS over moe-serve.env"


def test_prometheus_scrapes_the_service_and_grafana_is_provisioned(compose):
    services = compose["services"]
    prom = services["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    config = load_yaml(PROMETHEUS_CONFIG)
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert f"moe-serve:{Settings.model_fields['http_port'].default}" in targets

    grafana = services["grafana"]
    mounts = dict(v.rsplit(":", 2)[:2] for v in grafana["volumes"] if v.startswith("./"))
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboards_dir = mounts["./deploy/grafana/dashboards"]
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "moe-serve.yml")["providers"][0]
    assert provider["options"]["path"] == dashboards_dir
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dashboards_dir + "/")
    assert (DEPLOY / "grafana" / "dashboards" / Path(home).name).is_file()
    datasource = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    for path in (v.split(":")[0] for s in services.values() for v in s.get("volumes", []) if v.startswith("./deploy")):
        assert (ROOT / path).exists(), f"compose mounts {path}, which does not exist"


def test_dashboards_are_local_and_need_a_password(compose):
    """Before: Grafana on 0.0.0.0:3000 with admin/admin and anonymous viewers."""
    services = compose["services"]
    for name in ("prometheus", "grafana"):
        for port in services[name]["ports"]:
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond the loopback"
    env = services["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    password = env["GF_SECURITY_ADMIN_PASSWORD"]
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", password), \
        f"the admin password must come from the environment with no default: {password}"


def test_deploy_says_who_is_pid_1(moe):
    """Before: DEPLOY said the server "is PID 1 and gets SIGTERM"; under compose `init: true` makes
    tini PID 1 (it forwards the signal). Every paragraph that names PID 1 must name tini too."""
    assert moe["init"] is True
    text = (ROOT / "docs" / "DEPLOY.md").read_text()
    paragraphs = [p for p in re.split(r"\n- |\n\n", text) if "PID 1" in p]
    assert paragraphs and all("tini" in p and "init: true" in p for p in paragraphs), paragraphs
