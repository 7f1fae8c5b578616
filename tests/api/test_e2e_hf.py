"""A real model directory served end to end: the service process (HTTP) and `moe-serve forward`
(the rank group), K from config.json; refusals exit 2 at start naming the feature."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import TOL, rel_err, routing
from tests.hf_models import E, H, build, experts_module
from tests.serverproc import ServerProcess

R = 2  # I = 30 splits over 2 ranks


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixtral")
    return build("mixtral", str(d)), str(d)


def test_server_serves_a_model_directory_with_its_k(mixtral, tmp_path):
    model, path = mixtral
    proc = ServerProcess.module(tmp_path / "server.log", "--weights", path, "--device", "cpu",
                                "--world-size", str(R))
    try:
        proc.wait_ready()
        with httpx.Client(base_url=proc.url, timeout=60) as http:
            meta = http.get("/v2/models/moe").json()
            assert {t["name"]: t["shape"] for t in meta["inputs"]} == {
                "hidden_states": [-1, H], "topk_ids": [-1, 2], "topk_weights": [-1, 2]}
            gen = torch.Generator().manual_seed(3)
            for T in (1, 9):
                x = torch.randn(T, H, generator=gen)
                ids, w = routing(T, E, 2, "empty_expert", gen)
                r = http.post("/moe/forward", json={"hidden_states": x.tolist(), "topk_ids": ids.tolist(),
                                                     "topk_weights": w.tolist()})
                assert r.status_code == 200, r.text
                with torch.no_grad():
                    ref = experts_module(model, 0)(x, ids, w)
                assert rel_err(torch.tensor(r.json()["output"]), ref) <= TOL[torch.float32]
            r = http.post("/moe/forward", json={"hidden_states": x.tolist(), "topk_ids": ids[:, :1].tolist(),
                                                 "topk_weights": w[:, :1].tolist()})
            assert r.status_code == 400 and "K = 2" in r.json()["error"]
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]
    assert "layer 0" in proc.log() and "from config.json" in proc.log()


def test_forward_command_serves_a_model_directory(tmp_path):
    """`moe-serve forward` takes the service's flags: a DeepSeek-V3 directory (dense layer 0), --layer 1."""
    model = build("deepseek_v3", str(tmp_path / "ds3"))
    gen = torch.Generator().manual_seed(4)
    T = 23
    x = torch.randn(T, H, generator=gen)
    ids, w = routing(T, E, 2, "skewed", gen)
    save_file({"hidden_states": x, "topk_ids": ids.int(), "topk_weights": w}, str(tmp_path / "in.safetensors"))
    cmd = [sys.executable, "-m", "service", "forward", "--input", str(tmp_path / "in.safetensors"),
           "--output", str(tmp_path / "out.safetensors"), "--weights", str(tmp_path / "ds3"),
           "--device", "cpu", "--world-size", str(R), "--capacity", "5"]  # 5 tokens per rank: several steps
    r = subprocess.run([*cmd, "--layer", "1"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "shared experts" in r.stderr
    with torch.no_grad():
        ref = experts_module(model, 1)(x, ids, w)
    assert rel_err(load_file(str(tmp_path / "out.safetensors"))["output"], ref) <= TOL[torch.float32]
    r = subprocess.run([*cmd, "--layer", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "layer 0" in r.stderr and "no routed experts" in r.stderr, r.stderr


def test_refused_model_exits_2_naming_the_feature(tmp_path):
    build("llama4_text", str(tmp_path), num_local_experts=E, num_experts_per_tok=1, intermediate_size=30,
          intermediate_size_mlp=48)
    r = subprocess.run([sys.executable, "-m", "service", "--weights", str(tmp_path), "--device", "cpu",
                        "--http-port", "0", "--grpc-port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "router scales the expert input" in r.stderr
