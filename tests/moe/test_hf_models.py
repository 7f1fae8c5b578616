"""Real Hugging Face MoE architectures: tiny random models built by transformers (from config
objects, no downloads), saved sharded, one layer served from the directory, compared with the
model's own experts module on the same (x, ids, w) in fp32.

The layer is run the way the ranks run it: every rank of R = 2 loads its slice
(load_rank_weights) and computes its partial sum with the serial layer's CPU path; the partial
sums add up to the answer (the reduce-scatter's sum). tests/test_cli.py and tests/api/test_e2e_hf.py
run it through the rank group and a live server.

E experts, H hidden, I expert intermediate size, K top-k, T tokens.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from service.config import LayerConfig
from service.errors import ConfigError, WeightsError
from service.moe.checkpoint import inspect_layer
from service.moe.serial import SerialLayer
from service.moe.weights import checkpoint_layer, load_rank_weights
from tests.helpers import TOL, one_thread, rel_err, routing  # noqa: F401  (one_thread: fixture)
from tests.hf_models import X_SCALE, E, H, I, build, expert_output, experts_module

R = 2
T = 37


def served(path, cfg: LayerConfig, prefix: str, x, ids, w):
    """The layer's answer as R ranks compute it: each rank's partial sum over its slice, added up."""
    out = torch.zeros(x.shape[0], cfg.H)
    for rank in range(cfg.R):
        rw = load_rank_weights(path, cfg, rank, prefix=prefix)
        layer = SerialLayer(cfg.replace(R=1, I=cfg.Ir), rw, rank=0, device=torch.device("cpu"))
        out += layer.forward(x, ids.int(), w, seq=1)
    return out


def base_cfg() -> LayerConfig:
    return LayerConfig(E=8, H=8, I=8, K=1, R=R, C=64, dtype=torch.float32)


def check_model(model, path, layer: int, T: int, x_scale: float = 1.0, routing_kind: str = "empty_expert",
                model_type: str = ""):
    cfg, spec = checkpoint_layer(base_cfg(), path)
    assert spec.layer == layer and (cfg.E, cfg.H, cfg.I) == (E, H, I)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen) * x_scale
    ids, w = routing(T, cfg.E, cfg.K, routing_kind, gen)
    with torch.no_grad():
        ref = expert_output(model, model_type, layer, x, ids, w)
    out = served(path, cfg, spec.prefix, x, ids, w)
    assert rel_err(out, ref) <= TOL[torch.float32], (rel_err(out, ref), spec)
    return cfg, spec, x


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """model_type -> (model, directory), built once per module."""
    built = {}

    def get(model_type):
        if model_type not in built:
            d = str(tmp_path_factory.mktemp(model_type))
            built[model_type] = build(model_type, d), d
        return built[model_type]

    return get


# --------------------------------------------------------------------------------------- layouts

# model_type -> (layer served by default, layout, K)
EXPECT = {
    "mixtral": (0, "mixtral", 2), "qwen3_moe": (1, "hf", 3), "deepseek_v3": (1, "hf", 2), "olmoe": (0, "hf", 2),
    "granitemoe": (0, "granite", 2), "granitemoe_swa": (0, "fused", 2), "gpt_oss": (0, "gpt_oss", 2),
    "deepseek_v4": (0, "mixtral", 2), "dbrx": (0, "dbrx", 2), "jetmoe": (0, "granite", 2),
    "qwen3_vl_moe": (0, "fused", 2), "hunyuan_v1_moe": (0, "hf", 3), "minimax_m3_vl": (0, "mixtral", 2),
    "bailing_hybrid": (1, "hf", 2),
}


@pytest.mark.parametrize("model_type", sorted(EXPECT))
def test_model_directory_matches_the_models_experts(models, model_type, one_thread):  # noqa: F811
    model, path = models(model_type)
    layer, layout, K = EXPECT[model_type]
    cfg, spec, x = check_model(model, path, layer, T, X_SCALE.get(model_type, 1.0), model_type=model_type)
    assert spec.layout == layout and cfg.K == K
    if model_type in X_SCALE:  # the clamp must be active, or the test would not test it
        gate = experts_module(model, layer)
        assert spec.act.limit is not None
        pre = x @ _gate_weight(gate, model_type).T  # [T, E*I] every expert's gate pre-activation
        assert (pre > spec.act.limit).float().mean() > 0.05, "inputs too small to reach the clamp"
    if model_type == "jetmoe":  # the block's output bias stays with the client, and the log says so
        assert any("output bias" in n for n in spec.notes), spec.notes
    cfg1, _, _ = check_model(model, path, layer, 1, model_type=model_type)  # T = 1
    assert cfg1 == cfg


def _gate_weight(experts, model_type: str) -> torch.Tensor:
    gu = experts.gate_up_proj  # [E, H, 2I] (gpt-oss, interleaved) or [E, 2I, H]
    if model_type == "gpt_oss":
        return gu[:, :, 0::2].permute(0, 2, 1).reshape(-1, H)
    return gu[:, :I].reshape(-1, H)


def test_dense_layer_is_refused_and_later_layers_served(models):
    model, path = models("deepseek_v3")
    with pytest.raises(WeightsError, match=r"layer 0 .* no routed experts.*layers with experts: 1"):
        inspect_layer(path, layer=0)
    assert inspect_layer(path, layer=1).prefix == "model.layers.1.mlp."
    spec = inspect_layer(path)
    assert spec.notes and "shared experts" in spec.notes[0]


def test_top_k_given_per_layer(models, one_thread):  # noqa: F811
    """Hunyuan's moe_topk is a list, one K per layer: --layer 1 serves K = 2."""
    model, path = models("hunyuan_v1_moe")
    cfg, spec = checkpoint_layer(base_cfg(), path, layer=1)
    assert (spec.layer, cfg.K) == (1, 2) and "shared experts" in spec.notes[0]
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(T, H, generator=gen)
    ids, w = routing(T, E, 2, "skewed", gen)
    with torch.no_grad():
        ref = expert_output(model, "hunyuan_v1_moe", 1, x, ids, w)
    assert rel_err(served(path, cfg, spec.prefix, x, ids, w), ref) <= TOL[torch.float32]


def test_minimax_m3_computes_gpt_oss_activation_on_concatenated_halves(models):
    """MiniMax-M3's experts compute gpt-oss's (u + 1) * g * sigmoid(1.702 g) with its clamp, on gate / up
    halves that are not interleaved, while its saved config.json says hidden_act "silu"."""
    _, path = models("minimax_m3_vl")
    spec = inspect_layer(path)
    assert (spec.layout, spec.act.kind, spec.act.limit, spec.act.alpha) == ("mixtral", "gpt_oss", 7.0, 1.702)
    assert not spec.bias


def test_clamp_after_the_activation_is_refused_where_it_applies(models, one_thread):  # noqa: F811
    """Bailing-hybrid (and Step-3.5) clamp per layer *after* the activation: min(silu(g), L) * clamp(u, -L, L),
    which the kernels do not compute. Its layer 1 (limit 0: no clamp) is served, layer 2 (limit 3) refused."""
    model, path = models("bailing_hybrid")
    why = r"layer 2 .*expert_swiglu_limit_list.*3.*after the activation.*routed experts and no such clamp: 1$"
    with pytest.raises(WeightsError, match=why):
        inspect_layer(path, layer=2)
    cfg, spec = checkpoint_layer(base_cfg(), path, layer=1)
    assert spec.act.limit is None and cfg.K == 2
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=gen) * 6.0
    ids, w = routing(T, E, 2, "skewed", gen)
    with torch.no_grad():
        ref = expert_output(model, "bailing_hybrid", 1, x, ids, w)
    assert rel_err(served(path, cfg, spec.prefix, x, ids, w), ref) <= TOL[torch.float32]


@pytest.mark.parametrize("name", ["num_experts_per_tok", "moe_k", "num_experts_per_token", "top_k_experts"])
def test_top_k_read_under_each_models_name(tmp_path, name):
    """ERNIE-4.5 says moe_k, Kimi-Linear and Bailing num_experts_per_token, Gemma 4 top_k_experts: K comes from
    config.json whatever the name, so that a contradicting --top-k is refused as the README says."""
    prefix = "model.layers.0.mlp."
    path = _plain_dir(tmp_path, {"model_type": "x", "num_experts": E, name: 3}, _hf_experts(prefix))
    assert inspect_layer(path).K == 3
    with pytest.raises(ConfigError, match=r"MOE_TOP_K=2 contradicts"):
        checkpoint_layer(base_cfg(), path, top_k=2)


def test_intermediate_size_that_does_not_split_over_the_ranks_names_the_flag(models):
    """I = 30 over the cpu preset's R = 4: the message says where each number comes from and what to set."""
    _, path = models("olmoe")
    why = r"I=30 \(layer 0 of .*R=4 ranks \(--world-size.*divisor of 30 \(1, 2, 3, 5, 6"
    with pytest.raises(ConfigError, match=why):
        checkpoint_layer(base_cfg().replace(R=4), path)


def test_config_without_top_k_says_where_k_comes_from(tmp_path, caplog):
    """A config.json that names K under no known name (Qwen3-Omni nests it under thinker_config): K is the
    preset's unless --top-k says otherwise, and the start-up log says so instead of a bare 'K=1'."""
    path = _plain_dir(tmp_path, {"model_type": "x", "num_experts": E}, _hf_experts("model.layers.0.mlp."))
    with caplog.at_level(logging.INFO):
        cfg, spec = checkpoint_layer(base_cfg().replace(K=4), path)
    assert cfg.K == 4 and "names no top-k" in caplog.text and "K is --top-k's, else the preset's" in spec.notes[0]
    assert checkpoint_layer(base_cfg(), path, top_k=3)[0].K == 3


def test_defaults_apply_where_config_leaves_swiglu_limit_or_activation_out(models, tmp_path, one_thread):  # noqa: F811
    """transformers clamps gpt-oss at 7 and DeepSeek-V4 at 10 when config.json has no swiglu_limit (its config
    defaults); the layer served no clamp: relative error about 3 at inputs x 6."""
    model, src = models("gpt_oss")
    path = tmp_path / "gpt_oss"
    shutil.copytree(src, path)
    config = json.load(open(path / "config.json"))
    del config["swiglu_limit"]
    json.dump(config, open(path / "config.json", "w"))
    cfg, spec, _ = check_model(model, str(path), 0, T, X_SCALE["gpt_oss"], model_type="gpt_oss")
    assert spec.act.limit == 7.0
    (tmp_path / "v4").mkdir()
    v4 = _plain_dir(tmp_path / "v4", {"model_type": "deepseek_v4", "n_routed_experts": E, "num_experts_per_tok": 2},
                    _hf_experts("model.layers.0.mlp."))
    assert inspect_layer(v4).act.limit == 10.0
    (tmp_path / "gemma4").mkdir()  # the same for the activation: Gemma 4's default is GELU-tanh, not SiLU
    gemma = _plain_dir(tmp_path / "gemma4", {"model_type": "gemma4", "text_config": {
        "model_type": "gemma4_text", "num_experts": E, "top_k_experts": 2}}, _hf_experts("model.layers.0.mlp."))
    assert inspect_layer(gemma).act.kind == "gelu_tanh"


def test_gelu_tanh_model(tmp_path, one_thread):  # noqa: F811
    model = build("qwen3_moe", str(tmp_path), hidden_act="gelu_pytorch_tanh")
    _, spec, _ = check_model(model, str(tmp_path), 1, T, x_scale=2.0)
    assert spec.act.kind == "gelu_tanh"


def test_bf16_and_fp16_checkpoints_load(tmp_path):
    model, _ = build("olmoe", str(tmp_path / "fp32")), None
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        model.to(dtype).save_pretrained(tmp_path / name, max_shard_size="20KB")
        spec = inspect_layer(str(tmp_path / name))
        assert spec.dtype == name.upper().replace("FP", "F")
        cfg, _ = checkpoint_layer(base_cfg(), str(tmp_path / name))
        rw = load_rank_weights(str(tmp_path / name), cfg, 1, prefix=spec.prefix)
        gate = experts_module(model, 0).gate_up_proj[:, cfg.Ir:I]  # [E, Ir, H] rank 1's gate rows
        assert torch.equal(rw.w13[:, :, :cfg.Ir], gate.float().transpose(1, 2))


def test_transposed_fused_file_without_config(models, tmp_path, one_thread):  # noqa: F811
    """qwen3-vl hub files: experts.gate_up_proj [E, H, 2I], experts.down_proj [E, I, H]; no config.json,
    so K comes from --top-k."""
    model, _ = models("granitemoe_swa")
    ex = experts_module(model, 1)
    path = str(tmp_path / "layer.safetensors")
    save_file({"model.layers.1.mlp.experts.gate_up_proj": ex.gate_up_proj.detach().transpose(1, 2).contiguous(),
               "model.layers.1.mlp.experts.down_proj": ex.down_proj.detach().transpose(1, 2).contiguous()}, path)
    prefix = "model.layers.1.mlp."
    with pytest.raises(WeightsError, match="did you mean prefix='model.layers.1.mlp.'"):
        inspect_layer(path)
    cfg, spec = checkpoint_layer(base_cfg(), path, prefix=prefix, top_k=3)
    assert spec.layout == "fused_t" and cfg.K == 3 and spec.K is None
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=gen)
    ids, w = routing(T, E, 3, "skewed", gen)
    with torch.no_grad():
        ref = ex(x, ids, w)
    assert rel_err(served(path, cfg, prefix, x, ids, w), ref) <= TOL[torch.float32]


def test_fp8_block_quantized_checkpoint(models, tmp_path, one_thread):  # noqa: F811
    """DeepSeek-V3's format: F8_E4M3 weights and fp32 `weight_scale_inv` per block (here 16 x 16, so
    that a rank's 15 rows straddle blocks), dequantized at load time: w = q * scale of its block."""
    model, src = models("deepseek_v3")
    block = 16
    out_dir = tmp_path / "fp8"
    out_dir.mkdir()
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
    dequant = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(os.path.join(src, shard))
        for key in list(tensors):
            if re.search(r"layers\.1\.mlp\.experts\.\d+\.\w+\.weight$", key):
                wt = tensors[key]  # [out, in]
                o, i = wt.shape
                scale = torch.zeros(-(-o // block), -(-i // block))
                for bo in range(scale.shape[0]):
                    for bi in range(scale.shape[1]):
                        blk = wt[bo * block:(bo + 1) * block, bi * block:(bi + 1) * block]
                        scale[bo, bi] = blk.abs().max() / 448.0
                full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:o, :i]
                q = (wt / full).to(torch.float8_e4m3fn)
                tensors[key], tensors[key + "_scale_inv"] = q, scale
                index["weight_map"][key + "_scale_inv"] = shard
                dequant[key] = q.float() * full
        save_file(tensors, str(out_dir / shard), metadata={"format": "pt"})
    json.dump(index, open(out_dir / "model.safetensors.index.json", "w"))
    config = json.load(open(os.path.join(src, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    json.dump(config, open(out_dir / "config.json", "w"))
    assert dequant
    spec = inspect_layer(str(out_dir))
    assert spec.dtype == "F8_E4M3" and spec.block == (block, block)
    config["quantization_config"]["weight_block_size"] = [128, 128]  # scales that do not tile the weights
    json.dump(config, open(out_dir / "config.json", "w"))
    with pytest.raises(WeightsError, match=r"_scale_inv.*has shape \[2, 3\], expected \[1, 1\]"):
        inspect_layer(str(out_dir))
    config["quantization_config"]["weight_block_size"] = [block, block]
    json.dump(config, open(out_dir / "config.json", "w"))
    # The reference: the model's experts module holding the dequantized weights.
    ex = experts_module(model, 1)
    with torch.no_grad():
        for e in range(E):
            get = lambda n, e=e: dequant[f"model.layers.1.mlp.experts.{e}.{n}_proj.weight"]  # noqa: E731
            ex.gate_up_proj[e] = torch.cat([get("gate"), get("up")])
            ex.down_proj[e] = get("down")
        assert check_model(model, str(out_dir), 1, T)


# -------------------------------------------------------------------------------------- refusals


def test_router_scaling_the_input_is_refused(tmp_path):
    build("llama4_text", str(tmp_path), num_local_experts=E, num_experts_per_tok=1, intermediate_size=I,
          intermediate_size_mlp=48)
    with pytest.raises(WeightsError, match="router scales the expert input"):
        inspect_layer(str(tmp_path))


def _plain_dir(tmp_path, config: dict, tensors: dict) -> str:
    save_file(tensors, str(tmp_path / "model.safetensors"))
    json.dump(config, open(tmp_path / "config.json", "w"))
    return str(tmp_path)


def _hf_experts(prefix: str, roles=("gate_proj", "up_proj", "down_proj")) -> dict:
    gen = torch.Generator().manual_seed(0)
    shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
    return {f"{prefix}experts.{e}.{r}.weight": torch.randn(*shapes[r], generator=gen) for e in range(E) for r in roles}


def test_non_gated_zero_experts_unknown_activation_and_mxfp4_are_refused(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    prefix = "model.layers.0.mlp."
    path = _plain_dir(tmp_path / "a", {"model_type": "nemotron_h", "hidden_act": "relu2"},
                      _hf_experts(prefix, ("up_proj", "down_proj")))
    with pytest.raises(WeightsError, match="non-gated"):
        inspect_layer(path)
    path = _plain_dir(tmp_path / "b", {"model_type": "longcat_flash", "zero_expert_num": 2},
                      _hf_experts(prefix))
    with pytest.raises(WeightsError, match=r"zero \(identity\) experts"):
        inspect_layer(path)
    path = _plain_dir(tmp_path / "c", {"model_type": "qwen3_moe", "hidden_act": "gelu", "num_experts": E},
                      _hf_experts(prefix))
    with pytest.raises(WeightsError, match="activation 'gelu'"):
        inspect_layer(path)
    (tmp_path / "d").mkdir()
    mxfp4 = {f"{prefix}experts.{n}_{part}": torch.zeros(E, 2 * I, 2, 16, dtype=torch.uint8)
             for n in ("gate_up_proj", "down_proj") for part in ("blocks", "scales")}
    path = _plain_dir(tmp_path / "d", {"model_type": "gpt_oss", "num_local_experts": E}, mxfp4)
    with pytest.raises(WeightsError, match="MXFP4"):
        inspect_layer(path)


def test_experts_in_a_layout_not_read_are_named(tmp_path):
    """Step-3.5 stacks each role as 'moe.gate_proj.weight' [E, I, H]: refused, naming those keys, not asked
    whether the model is a Mixture-of-Experts."""
    gen = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.1.moe.{r}.weight": torch.randn(E, *s, generator=gen)
               for r, s in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}
    tensors["model.layers.0.mlp.gate_proj.weight"] = torch.randn(I, H, generator=gen)
    tensors["model.layers.1.share_expert.gate_proj.weight"] = torch.randn(I, H, generator=gen)
    path = _plain_dir(tmp_path, {"model_type": "step3p5", "n_routed_experts": E}, tensors)
    with pytest.raises(WeightsError, match=r"expert tensors in a layout that is not read .*layers.1.moe.down_proj"):
        inspect_layer(path)


def test_top_k_contradicting_config_names_both(models, caplog):
    _, path = models("mixtral")
    with pytest.raises(ConfigError, match=r"MOE_TOP_K=3 contradicts num_experts_per_tok=2"):
        checkpoint_layer(base_cfg(), path, top_k=3)
    with caplog.at_level(logging.INFO):
        cfg, _ = checkpoint_layer(base_cfg(), path, top_k=2)
    assert cfg.K == 2 and "K=2 from config.json" in caplog.text


@pytest.mark.parametrize("model_type", ["mixtral", "granitemoe_swa", "gpt_oss"])
def test_rank_reads_its_slice_from_the_shards_that_hold_the_layer(models, monkeypatch, model_type):
    """Slices only (get_tensor never called), each [.., Ir, ..] or [.., 2*Ir] wide, and only the
    shards holding the layer's expert tensors are opened."""
    from service.moe import checkpoint
    from tests.moe.test_weights import _HandleSpy

    _, path = models(model_type)
    cfg, spec = checkpoint_layer(base_cfg(), path)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    holding = {os.path.join(path, f) for k, f in index.items() if k.startswith(spec.prefix + "experts")}
    assert len(set(index.values())) > len(holding) >= 1
    reads, opened = [], []
    real_open = checkpoint.safe_open

    def spy_open(file, *a, **k):
        opened.append(file)
        return _HandleSpy(real_open(file, *a, **k), reads)

    monkeypatch.setattr(checkpoint, "safe_open", spy_open)
    load_rank_weights(path, cfg, 1, prefix=spec.prefix)
    assert reads and set(opened) <= holding, sorted(set(opened) - holding)
    for key, shape in reads:
        assert not key.endswith("down_proj_bias"), "rank 1 read the down bias, which rank 0 alone adds"
        assert cfg.Ir in shape or 2 * cfg.Ir in shape, (key, shape)


@pytest.mark.parametrize("model_type", ["hy_v4", "glm5_next", "lfm2_moe"])
def test_experts_that_compute_silu_whatever_hidden_act_says_are_served_silu(tmp_path, model_type):
    """transformers' experts modules of these types call F.silu themselves: a config.json naming another
    activation must not change what is served (reviewer RB: hy_v4 with gelu_pytorch_tanh was 1.4e-2 off)."""
    prefix = "model.layers.0.mlp."
    path = _plain_dir(tmp_path, {"model_type": model_type, "hidden_act": "gelu_pytorch_tanh", "num_experts": E,
                                 "num_experts_per_tok": 2}, _hf_experts(prefix))
    assert inspect_layer(path).act.kind == "silu"


def test_a_soft_capped_swiglu_is_refused_by_model_type(tmp_path):
    """Inkling 2's experts squash the gated product with tanh: refused by its type whatever the layout, so a
    later layout reader cannot start serving it as plain SwiGLU."""
    path = _plain_dir(tmp_path, {"model_type": "inkling2", "hidden_act": "silu", "num_experts": E,
                                 "num_experts_per_tok": 2}, _hf_experts("model.layers.0.mlp."))
    with pytest.raises(WeightsError, match="soft-capped SwiGLU"):
        inspect_layer(path)
