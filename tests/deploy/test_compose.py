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
    assert wanted <= set(moe["ports"])


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
    """Every MOE_* variable compose sets is a setting and its default value passes Settings."""
    env = {k: interpolate(str(v)) for k, v in moe.get("environment", {}).items()}
    fields = {f"MOE_{name.upper()}": name for name in Settings.model_fields}
    unknown = [k for k in env if k.startswith("MOE_") and k not in fields]
    assert not unknown, f"not settings of the service: {unknown}"
    Settings(**{fields[k]: v for k, v in env.items() if k in fields and v != ""})


def test_checkpoint_mounted_read_only(moe):
    mounts = [interpolate(v) for v in moe["volumes"]]
    models = [m for m in mounts if m.split(":")[1] == "/models"]
    assert len(models) == 1 and models[0].endswith(":ro"), f"the checkpoint folder must be mounted read-only: {mounts}"
    env_files = moe.get("env_file", [])
    assert {"path": ".env", "required": False} in env_files, "MOE_WEIGHTS comes from .env; synthetic when unset"
    assert "MOE_WEIGHTS" not in moe.get("environment", {}), "compose must not pin MOE_WEIGHTS over .env"


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
