"""The image recipe without a Docker engine: the Dockerfile's own instructions, read from it, replayed
in folders that stand for the two stages' filesystems, with a fresh virtual environment in place of
/opt/venv and the CPU torch 2.13.0 from this machine's disk in place of the CUDA one.

What is replayed, in order, per stage: WORKDIR, COPY (through .dockerignore), ENV, ARG (with the
build arguments below), and every RUN that calls a script of deploy/docker/ (bind mounts from
the build stage become links). The other RUN lines must be image plumbing (apt-get, the user, the
venv; see PLUMBING), so no install step can hide in a line this test skips. Then the runtime
stage's ENTRYPOINT starts the service with the stage's ENV, and its HEALTHCHECK command must say
not ready before and ready after the warm-up. What stays untested here: the CUDA bases, apt, the
csrc compile (BUILD_CSRC=0), and the non-root user (the test runs as the CI user).

The stages are replayed in a child process (`build_job`), which the session starts in the background
once it has collected this module (tests/background.py); the test then checks what it built.
"""

from __future__ import annotations

import functools
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import httpx
import pytest

from tests import background
from tests.deploy.common import (
    ROOT,
    SCRIPTS,
    Stage,
    arg_declaration,
    assignments,
    dockerfile_stages,
    dockerignore_patterns,
    exec_form,
    healthcheck,
    in_build_context,
    split_flags,
)
from tests.helpers import OUTSIDE_PROXIES
from tests.serverproc import START_TIMEOUT_S, ServerProcess

# `docker build --build-arg` equivalents: the CPU torch (the +cpu local version exists only as
# this machine's file, so pip can never fall back to a multi-GB CUDA download) and no csrc library.
BUILD_ARGS = {"TORCH_REQUIREMENT": "torch==2.13.0+cpu", "BUILD_CSRC": "0"}
# RUN lines that only set up the image itself; a fresh virtual environment replaces the venv line.
VENV_LINE = re.compile(r"^python3 -m venv (/\S+)$")
PLUMBING = (re.compile(r"^apt-get update "), re.compile(r"^groupadd "), VENV_LINE)
STEP_TIMEOUT_S = 420  # a cold pip cache downloads the service's dependencies (torch is local)
ENV_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")


class StageFs:
    """A stage's filesystem as a local folder: image path /a/b -> root/a/b."""

    def __init__(self, root: Path):
        self.root = root

    def local(self, image_path: str) -> Path:
        assert image_path.startswith("/"), image_path
        return self.root / image_path.lstrip("/")

    def map_words(self, command: str) -> str:
        """Every word that is an absolute image path, as a local path."""
        return " ".join(str(self.local(w)) if w.startswith("/") else w for w in command.split())

    def map_value(self, value: str, env: dict[str, str]) -> str:
        """An ENV value: absolute paths in a `:` list mapped, then $VARs expanded from `env`."""
        mapped = ":".join(str(self.local(p)) if p.startswith("/") else p for p in value.split(":"))
        return ENV_VAR.sub(lambda m: env.get(m.group(1) or m.group(2), ""), mapped)


def copy_into(sources: list[str], dest: Path, dest_is_dir: bool, patterns: list[str]) -> None:
    """COPY semantics for context paths: a folder's contents, or a file, through .dockerignore."""
    for source in sources:
        src = ROOT / source
        files = [src] if src.is_file() else [p for p in src.rglob("*") if p.is_file()]
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if not in_build_context(rel, patterns):
                continue
            if src.is_file():
                target = dest / f.name if dest_is_dir else dest
            else:
                target = dest / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)


def replay(stage: Stage, fs: StageFs, args: dict[str, str | None], base_env: dict[str, str],
           stages_fs: dict[str, StageFs]) -> tuple[dict[str, str], str]:
    """Run a stage's instructions; returns the environment a container of it starts with (the
    stage's ENV over `base_env`; ARGs are seen by RUN only) and its WORKDIR."""
    patterns = dockerignore_patterns()
    workdir, env, build_args, scripts_dir = "/", dict(base_env), {}, None
    for inst in stage.instructions:
        if inst.name == "WORKDIR":
            workdir = posixpath.join(workdir, inst.value)
            fs.local(workdir).mkdir(parents=True, exist_ok=True)
        elif inst.name == "COPY":
            flags, rest = split_flags(inst.value)
            assert not flags, f"line {inst.line}: COPY flags are not replayed: {flags}"
            *sources, dest = rest.split()
            dest_abs = posixpath.join(workdir, dest)
            copy_into(sources, fs.local(dest_abs), dest.endswith("/") or len(sources) > 1, patterns)
            if [s.rstrip("/") for s in sources] == [SCRIPTS.relative_to(ROOT).as_posix()]:
                scripts_dir = dest_abs.rstrip("/") + "/"
        elif inst.name == "ARG":
            for key, default in arg_declaration(inst.value).items():
                build_args[key] = BUILD_ARGS.get(key, default if default is not None else args.get(key) or "")
        elif inst.name == "ENV":
            for key, value in assignments(inst.value).items():
                env[key] = fs.map_value(value, env)
        elif inst.name == "RUN":
            flags, command = split_flags(inst.value)
            command = " ".join(command.split())
            if any(p.match(command) for p in PLUMBING):
                if m := VENV_LINE.match(command):
                    venv.create(fs.local(m.group(1)), with_pip=True, clear=True)  # fresh: no system packages
                continue
            assert scripts_dir and command.startswith(scripts_dir), (
                f"line {inst.line}: a RUN that is neither plumbing nor a deploy/docker script is not "
                f"tested; move it into deploy/docker/: {command!r}")
            for flag in flags:
                bind = dict(kv.split("=", 1) for kv in flag.removeprefix("--mount=").split(","))
                if bind.get("type") == "bind":
                    target = fs.local(bind["target"])
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.symlink_to(stages_fs[bind["from"]].local(bind["source"]))
            result = subprocess.run(["bash", "-c", fs.map_words(command)], cwd=fs.local(workdir),
                                    env={**env, **build_args}, capture_output=True, text=True,
                                    timeout=STEP_TIMEOUT_S)
            assert result.returncode == 0, (f"line {inst.line}: {command} failed ({result.returncode}):\n"
                                            f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return env, workdir


def build_image(root: Path) -> dict:
    """Replay every stage into root/<stage name>: the image's (the last stage's) environment and
    WORKDIR, as {"env": ..., "workdir": ...}."""
    global_args, stages = dockerfile_stages()
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("MOE_")}
    base_env["PIP_NO_COMPILE"] = "1"  # speed only: no .pyc for torch's thousands of files
    stages_fs = {name: StageFs(root / name) for name in stages}
    for name, stage in stages.items():
        image_env, workdir = replay(stage, stages_fs[name], global_args, base_env, stages_fs)
    return {"env": image_env, "workdir": workdir}


@functools.cache
def build_job() -> background.Job:
    """build_image in a child process (this file run as a module), into a fresh folder of ~1 GB (its
    scratch: removed by the test, else at the session's end); ~50 s of pip installs."""
    root = tempfile.mkdtemp(prefix="moe-image-")
    env = {**os.environ, **OUTSIDE_PROXIES} if OUTSIDE_PROXIES else None  # (pip may need the runner's proxy)
    return background.Job.of("image recipe", [sys.executable, "-m", "tests.deploy.test_image_recipe", root],
                             2 * STEP_TIMEOUT_S + 60, env=env, cwd=ROOT, scratch=root)


def background_jobs() -> list[background.Job]:
    return [build_job()]


@pytest.mark.slow
# the 300 s default would cut a cold-cache install short
@pytest.mark.timeout(2 * STEP_TIMEOUT_S + START_TIMEOUT_S + 120)
def test_image_recipe_installs_starts_and_gets_ready():
    _, stages = dockerfile_stages()
    job = build_job()
    root = Path(job.scratch)
    try:  # ~1 GB: removed even on failure
        built = background.result(job)
        assert built.returncode == 0, f"replaying the Dockerfile failed ({built.returncode}):\n{built.stderr[-10000:]}"
        image = json.loads(built.stdout.strip().splitlines()[-1])
        final = list(stages)[-1]  # the image is the last stage, with its ENV and WORKDIR
        runtime, runtime_fs = stages[final], StageFs(root / final)

        # The environment the container starts with, plus ports on loopback.
        env = ServerProcess.loopback_env(image["env"])
        entrypoint = exec_form(runtime.one("ENTRYPOINT").value)
        executable = shutil.which(entrypoint[0], path=env["PATH"])
        assert executable and Path(executable).is_relative_to(runtime_fs.root), \
            f"{entrypoint[0]} resolves to {executable}, not to the image's virtual environment"
        venv_dir = Path(env["VIRTUAL_ENV"])  # already mapped into the runtime stage's folder
        assert venv_dir.is_relative_to(runtime_fs.root), venv_dir
        installed = {p.name for p in venv_dir.glob("lib/python3*/site-packages/*")}
        assert "torch-2.13.0+cpu.dist-info" in installed, "the CPU torch must be installed here, never a CUDA build"
        assert "service" in installed and any(n.startswith("moe_serve-") for n in installed), \
            "the wheel is not in the image's environment"
        site = next(venv_dir.glob("lib/python3*/site-packages"))
        assert (site / "service" / "api" / "arena_alloc.c").is_file(), \
            "the wheel lacks the arena's object allocator (--wire-arena-grpc)"
        assert list((site / "service" / "api").glob("arena_alloc-*.so")), \
            "install.sh did not prebuild the arena's object allocator"

        _, check = healthcheck(runtime)
        check = runtime_fs.map_words(" ".join(check)).split()

        def healthy() -> bool:
            return subprocess.run(check, env=env, capture_output=True, timeout=30).returncode == 0

        assert not healthy(), "HEALTHCHECK says ready with nothing listening"
        server = ServerProcess([executable, *entrypoint[1:]], root / "moe-serve.log", env=env,
                               cwd=runtime_fs.local(image["workdir"]))
        try:
            server.wait_ready(healthy, timeout=START_TIMEOUT_S)
            assert httpx.get(server.url + "/v2/health/live", timeout=5).status_code == 200
        finally:
            code = server.stop()
        assert code == 0, f"SIGTERM did not stop the service cleanly ({code}):\n{server.log()[-3000:]}"
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":  # build_job's child: the stages replayed into the folder named, then one JSON line
    sys.stdout.write(json.dumps(build_image(Path(sys.argv[1]))) + "\n")
