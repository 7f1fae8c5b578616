"""Layer configuration and settings: presets, impossible values named, environment overrides."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from service import config
from service.config import PRESETS, LayerConfig, Settings, preset
from service.errors import ConfigError


def test_presets():
    seed = PRESETS["seed"]
    assert (seed.E, seed.H, seed.I, seed.K, seed.R, seed.C, seed.dtype) == (64, 4096, 3072, 8, 4, 512, torch.bfloat16)
    assert seed.Ir == 768 and seed.tokens_per_step == 2048
    assert seed.S % 128 == 0 and seed.S >= 2048 * 8 + 64 * 127
    assert preset("cpu", C=7).C == 7


@pytest.mark.parametrize("changes,field", [
    (dict(I=3073), "I (3073) must be divisible by R"),
    (dict(K=65), "K (top-k = 65) must not exceed E"),
    (dict(C=0), "C must be a positive integer"),
    (dict(H=-1), "H must be a positive integer"),
    (dict(E=2.5), "E must be a positive integer"),
    (dict(dtype=torch.int8), "dtype must be one of"),
])
def test_impossible_values_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(")", r"\)")):
        PRESETS["seed"].replace(**changes)


def test_layer_config_dtype_is_required():
    """Before: dtype's default was a pydantic Field inside a stdlib dataclass, so leaving dtype out
    gave a ConfigError about a FieldInfo; every caller passes it (docs/CONTRACTS.md lists no default)."""
    field = {f.name: f for f in dataclasses.fields(LayerConfig)}["dtype"]
    assert field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    with pytest.raises(TypeError, match="dtype"):
        LayerConfig(E=4, H=8, I=8, K=2, R=1, C=4)  # type: ignore[call-arg]
    assert LayerConfig(E=4, H=8, I=8, K=2, R=1, C=4, dtype=torch.float16).dtype is torch.float16


def test_unknown_preset():
    with pytest.raises(ConfigError, match="preset must be one of"):
        preset("huge")


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("MOE_HTTP_PORT", "9000")
    monkeypatch.setenv("MOE_CAPACITY", "64")
    monkeypatch.setenv("MOE_PRESET", "cpu")
    s = Settings()
    assert s.http_port == 9000
    cfg = s.layer_config("cpu")
    assert cfg.C == 64 and cfg.E == PRESETS["cpu"].E


@pytest.mark.parametrize("env,word", [
    ({"MOE_HTTP_PORT": "70000"}, "http_port"),
    ({"MOE_PRESET": "nope"}, "preset"),
    ({"MOE_GRPC_PORT": "8000"}, "must differ"),
    ({"MOE_WORLD_SIZE": "0"}, "world_size"),
    ({"MOE_MODEL_NAME": "stats"}, "taken by GET /v2/models/stats"),
    ({"MOE_MODEL_NAME": "a/b"}, "one URL path segment"),
])
def test_settings_reject_impossible_values(monkeypatch, env, word):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValidationError, match=word):
        Settings()


def test_env_example_uncommented_as_it_stands_gives_the_defaults(monkeypatch):
    """deploy/env.example says "uncomment what you change": every MOE_* line uncommented unchanged
    (the unset ones are empty, `MOE_PRESET=`) must start the service with its defaults, not fail
    validation on an empty string."""
    example = Path(__file__).resolve().parents[1] / "deploy" / "env.example"
    lines = [ln.removeprefix("# ") for ln in example.read_text().splitlines() if ln.startswith("# MOE_")]
    assert len(lines) == len(Settings.model_fields), lines
    assert any(ln.endswith("=") for ln in lines)  # the case this test is for is in the file
    for name in [k for k in os.environ if k.startswith("MOE_")]:
        monkeypatch.delenv(name)
    defaults = Settings().model_dump()
    for line in lines:
        name, _, value = line.partition("=")
        monkeypatch.setenv(name, value)
    assert Settings().model_dump() == defaults


def test_device_resolution_without_gpu(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert Settings().resolve_device()[0] == "cpu"
    with pytest.raises(ConfigError, match="no CUDA device"):
        Settings(device="cuda").resolve_device()
    monkeypatch.setattr(config, "usable_cpus", lambda: 4)  # as many cores as the preset's ranks
    assert Settings().layer_config("cpu") == PRESETS["cpu"]
    assert isinstance(Settings(world_size=2).layer_config("cpu"), LayerConfig)


@pytest.mark.parametrize("cpus,R,C", [(64, 4, 128), (4, 4, 128), (3, 2, 256), (2, 2, 256), (1, 1, 512)])
def test_cpu_ranks_are_capped_by_the_usable_cores(monkeypatch, caplog, cpus, R, C):
    """On the CPU the preset's R=4 ranks become as many as the usable cores (a divisor of I), the step's
    tokens R*C the preset's; --world-size is kept whatever the cores (as is --capacity)."""
    monkeypatch.setattr(config, "usable_cpus", lambda: cpus)
    for name in ("MOE_WORLD_SIZE", "MOE_CAPACITY", "MOE_PRESET"):  # (a test server's environment names R)
        monkeypatch.delenv(name, raising=False)
    base = PRESETS["cpu"]
    with caplog.at_level("WARNING", logger="service.config"):
        cfg = Settings().layer_config("cpu")
    assert (cfg.R, cfg.C, cfg.R * cfg.C) == (R, C, base.R * base.C)
    assert cfg.replace(R=base.R, C=base.C) == base  # nothing else changes
    assert (f"running R={R}, C={C}" in caplog.text) == (R != base.R), caplog.text
    assert (Settings(world_size=4).layer_config("cpu").R, Settings(world_size=4).layer_config("cpu").C) == (4, 128)
    assert Settings(capacity=64).layer_config("cpu").C == 64


def test_top_k_flag_and_environment(monkeypatch):
    """K of the served layer: --top-k / MOE_TOP_K over the preset's (a model directory's
    config.json gives it otherwise: tests/moe/test_hf_models.py)."""
    assert Settings().layer_config("cpu").K == PRESETS["cpu"].K
    assert Settings(top_k=2).layer_config("cpu").K == 2
    monkeypatch.setenv("MOE_TOP_K", "3")
    assert Settings().layer_config("cpu").K == 3
    with pytest.raises(ConfigError, match="K .top-k = 17. must not exceed E"):
        Settings(top_k=17).layer_config("cpu")
    with pytest.raises(ValidationError, match="top_k"):
        Settings(top_k=0)


def test_with_weights_r_and_k_are_checked_against_the_checkpoint_not_the_preset(tmp_path):
    """--weights replaces the preset's E, H, I: --world-size 3 and a checkpoint with I = 48 were refused with
    'I (512) must be divisible by R (3)', the cpu preset's I; --top-k 20 with 'must not exceed E (experts = 16)'."""
    from safetensors.torch import save_file

    from service.moe.weights import checkpoint_layer

    E, H, I = 24, 8, 48  # noqa: E741
    path = str(tmp_path / "experts.safetensors")
    save_file({f"experts.{e}.{n}.weight": torch.zeros(s) for e in range(E)
               for n, s in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}, path)
    cfg, _ = checkpoint_layer(Settings(weights=path, world_size=3).layer_config("cpu"), path)
    assert (cfg.R, cfg.I, cfg.E) == (3, 48, 24)
    s = Settings(weights=path, top_k=20)
    cfg, _ = checkpoint_layer(s.layer_config("cpu"), path, top_k=s.top_k)
    assert (cfg.K, cfg.E) == (20, 24)
    with pytest.raises(ConfigError, match="I=48 .* does not split over R=5"):  # the checkpoint's I decides
        checkpoint_layer(Settings(weights=path, world_size=5).layer_config("cpu"), path)


def test_layer_needs_weights_and_activation_is_checked():
    from service.config import Activation

    with pytest.raises(ValidationError, match="no weights are set"):
        Settings(layer=3)
    with pytest.raises(ConfigError, match="activation must be one of"):
        Activation("relu2")
    with pytest.raises(ConfigError, match="clamp limit must be positive"):
        Activation("silu", limit=0.0)
    assert "act=gpt_oss limit=7 alpha=1.702" in preset("cpu").replace(act=Activation("gpt_oss", limit=7.0)).describe()


def test_unknown_moe_variables_are_named():
    """A typo such as MOE_HTTP_PROT was ignored without a word (extra="ignore"); the server now warns
    naming it (user's trial 4). Settings' own variables, any case, are not named."""
    from service.config import unknown_variables

    env = {"MOE_HTTP_PROT": "1", "MOE_HTTP_PORT": "8000", "moe_log_level": "INFO", "MOE_SHM_DIRECT": "true",
           "PATH": "/bin", "MOEX": "1"}
    assert unknown_variables(env) == ["MOE_HTTP_PROT"]


def test_moe_variables_read_outside_settings_are_not_named(monkeypatch, tmp_path):
    """MOE_CACHE_DIR (where the wire arena's C library is built) is no setting but is read: the
    server logged "ignored: MOE_CACHE_DIR ... name no setting" at every start. It is exempt by its
    exact name only (arena_objects reads no other case), and arena_objects does read it."""
    from service.api import arena_objects
    from service.config import READ_ELSEWHERE, unknown_variables

    assert "MOE_CACHE_DIR" in READ_ELSEWHERE
    assert not READ_ELSEWHERE & {f"MOE_{name.upper()}" for name in Settings.model_fields}
    env = {"MOE_CACHE_DIR": "/tmp/x", "moe_cache_dir": "/tmp/x", "MOE_HTTP_PROT": "1"}
    assert unknown_variables(env) == ["MOE_HTTP_PROT", "moe_cache_dir"]
    monkeypatch.setenv("MOE_CACHE_DIR", str(tmp_path))
    assert arena_objects.cache_dir() == tmp_path


def test_the_server_warns_of_unknown_moe_variables(monkeypatch, caplog):
    from service import server

    monkeypatch.setenv("MOE_HTTP_PROT", "1")
    monkeypatch.setattr(server.logfilter, "install", lambda: None)  # (serve's process-wide set-up, not this test's)
    monkeypatch.setattr(server, "ensure_file_limit", lambda n: None)
    monkeypatch.setattr(server, "Server", lambda settings: (_ for _ in ()).throw(ConfigError("stop here")))
    with caplog.at_level("WARNING", logger="moe-serve"):
        assert server.serve(Settings(device="cpu")) == 2
    assert any("MOE_HTTP_PROT" in r.getMessage() and "no setting" in r.getMessage() for r in caplog.records)


def _cgroup_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_usable_cpus_is_the_affinity_capped_by_every_cgroup_quota_above(monkeypatch, tmp_path):
    """A container's CPU quota caps the cores the service sizes itself by (CPU ranks' threads, the
    default front ends), wherever it is set above the process; no quota or "max" leaves the affinity."""
    from service.config import usable_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    proc = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    proc.write_text("0::/pod/box\n")
    _cgroup_tree(v2, {"cpu.max": "max 100000\n", "pod/cpu.max": "250000 100000\n",
                      "pod/box/cpu.max": "max 100000\n"})
    assert usable_cpus(str(v2), str(proc)) == 3  # 2.5 cores, rounded up, set on the parent
    (v2 / "pod/box/cpu.max").write_text("50000 100000\n")
    assert usable_cpus(str(v2), str(proc)) == 1  # the tighter one wins; half a core is one
    _cgroup_tree(v2, {"pod/cpu.max": "max 100000\n", "pod/box/cpu.max": "max 100000\n"})
    assert usable_cpus(str(v2), str(proc)) == 64  # no limit anywhere
    assert usable_cpus(str(tmp_path / "absent"), str(proc)) == 64
    assert usable_cpus(str(v2), str(tmp_path / "no-proc-file")) == 64

    v1 = tmp_path / "v1"
    proc.write_text("12:memory:/other\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    _cgroup_tree(v1, {"cpu/docker/abc/cpu.cfs_quota_us": "400000\n", "cpu/docker/abc/cpu.cfs_period_us": "100000\n",
                      "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert usable_cpus(str(v1), str(proc)) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert usable_cpus(str(v1), str(proc)) == 2  # a cpuset narrower than the quota


def test_usable_cpus_finds_each_mount_layout_and_never_fails_a_start(monkeypatch, tmp_path):
    """A container with its own cgroup namespace ("0::/": its own limit at the root), a hybrid host's
    v2 tree at unified/, v1's cpu,cpuacct without a cpu link; a /proc/self/cgroup that cannot be
    parsed counts no limit rather than failing the server's start."""
    from service.config import usable_cpus

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    _cgroup_tree(tmp_path / "ns", {"cpu.max": "200000 100000\n"})
    assert usable_cpus(str(tmp_path / "ns"), str(proc)) == 2
    proc.write_text("4:memory:/x\n0::/svc\n")
    _cgroup_tree(tmp_path / "hybrid", {"unified/svc/cpu.max": "300000 100000\n"})
    assert usable_cpus(str(tmp_path / "hybrid"), str(proc)) == 3
    proc.write_text("3:cpu,cpuacct:/job\n")
    _cgroup_tree(tmp_path / "v1", {"cpu,cpuacct/job/cpu.cfs_quota_us": "150000\n",
                                   "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"})
    assert usable_cpus(str(tmp_path / "v1"), str(proc)) == 2
    _cgroup_tree(tmp_path / "bad", {"cpu.max": "garbage\n"})
    for text in (b"not a cgroup line\n", b"0::/\xff\xfe\n", b""):
        proc.write_bytes(text)
        assert usable_cpus(str(tmp_path / "bad"), str(proc)) == 64, text
