"""Tiny random Hugging Face MoE models for the tests: built by transformers from config objects
(no downloads), every parameter redrawn, saved sharded. E experts, H hidden, I expert intermediate.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")  # a test dependency (pyproject [test])

H, I, E = 40, 30, 5  # noqa: E741  odd slices: Ir = 15 at R = 2
SEED = 11

# model_type -> config overrides (tiny: 2-3 layers, 4 heads of 10). Names follow each config class.
COMMON = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
              vocab_size=64, max_position_embeddings=64)
MODELS = {
    "mixtral": dict(num_local_experts=E, num_experts_per_tok=2, intermediate_size=I),
    "qwen3_moe": dict(num_experts=E, num_experts_per_tok=3, moe_intermediate_size=I, intermediate_size=48,
                      mlp_only_layers=[0], num_hidden_layers=3),  # layer 0 dense
    "deepseek_v3": dict(n_routed_experts=E, num_experts_per_tok=2, moe_intermediate_size=I, intermediate_size=48,
                        first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=16,
                        q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=10),
    "olmoe": dict(num_experts=E, num_experts_per_tok=2, intermediate_size=I),
    "granitemoe": dict(num_local_experts=E, num_experts_per_tok=2, intermediate_size=I),  # input_linear
    "granitemoe_swa": dict(num_local_experts=E, num_experts_per_tok=2, intermediate_size=I),  # native fused
    "gpt_oss": dict(num_local_experts=E, num_experts_per_tok=2, intermediate_size=I, swiglu_limit=7.0,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=16),
    "deepseek_v4": dict(n_routed_experts=E, num_experts_per_tok=2, moe_intermediate_size=I, n_shared_experts=1,
                        swiglu_limit=10.0, num_hash_layers=0),
    # multimodal: the language model's config nested under text_config, its layers under model.language_model
    "qwen3_vl_moe": dict(text_config=dict(COMMON, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=I,
                                          intermediate_size=48, rope_scaling={"rope_type": "default",
                                                                              "mrope_section": [1, 1, 3]}),
                         vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                            out_hidden_size=H, num_position_embeddings=16,
                                            deepstack_visual_indexes=[])),
    "hunyuan_v1_moe": dict(num_experts=E, moe_topk=[3, 2], intermediate_size=I),  # K per layer; shared_mlp
    "jetmoe": dict(num_local_experts=E, num_experts_per_tok=2, intermediate_size=I, kv_channels=10),
    # gpt-oss's activation on concatenated (not interleaved) gate / up halves; config.json says hidden_act "silu"
    "minimax_m3_vl": dict(text_config=dict(COMMON, num_local_experts=E, num_experts_per_tok=2, intermediate_size=I,
                                           swiglu_limit=7.0, mlp_layer_types=["sparse"] * 2,
                                           layer_types=["full_attention"] * 2, rotary_dim=10, pad_token_id=0,
                                           bos_token_id=1, eos_token_id=2, dense_intermediate_size=48,
                                           shared_intermediate_size=16),
                          vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28),
                          projector_hidden_size=16, merged_hidden_size=64),
    # K in num_experts_per_token; per-layer clamps applied after the activation (expert_swiglu_limit_list)
    "bailing_hybrid": dict(num_experts=E, num_experts_per_token=2, moe_intermediate_size=I, intermediate_size=48,
                           num_hidden_layers=3, first_k_dense_replace=1, swiglu_limits=[0, 0, 3.0],
                           num_expert_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                           qk_nope_head_dim=8, v_head_dim=10, linear_head_dim=10, linear_num_heads=4,
                           layer_group_size=2, num_nextn_predict_layers=0, pad_token_id=0, eos_token_id=2),
    "dbrx": dict(d_model=H, n_heads=4, n_layers=2, max_seq_len=64, attn_config={"kv_n_heads": 2, "rope_theta": 1e4},
                 ffn_config={"moe_num_experts": E, "moe_top_k": 2, "ffn_hidden_size": I}),
}
# Inputs scaled so that clamped activations clamp (checked in the test): the limit's activations.
X_SCALE = {"gpt_oss": 6.0, "deepseek_v4": 12.0, "minimax_m3_vl": 6.0}


def build(model_type: str, directory, **overrides):
    """A tiny random model of `model_type`, every parameter redrawn (biases too), saved sharded."""
    spec = {**MODELS.get(model_type, {}), **overrides}
    multimodal = "text_config" in spec
    cfg = transformers.AutoConfig.for_model(model_type, **(spec if multimodal else {**COMMON, **spec}))
    torch.manual_seed(SEED)
    # eager: the module's own loop over experts (the grouped_mm backend wants 16-byte strides).
    auto = transformers.AutoModelForImageTextToText if multimodal else transformers.AutoModelForCausalLM
    model = auto.from_config(cfg, experts_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    # Small shards: a layer's experts straddle several files, found through the index.
    model.save_pretrained(directory, max_shard_size="20KB")
    assert os.path.exists(os.path.join(directory, "model.safetensors.index.json"))
    return model


def experts_module(model, layer: int):
    """The experts module of decoder layer `layer`: forward(x [T, H], ids [T, K], w [T, K])."""
    pattern = re.compile(rf"(?:layers|blocks)\.{layer}\.[^.]+\.experts$")
    found = [m for n, m in model.named_modules() if pattern.search(n)]
    assert len(found) == 1, [n for n, _ in model.named_modules() if pattern.search(n)]
    return found[0]




def expert_output(model, model_type: str, layer: int, x, ids, w):
    """The model's own experts on (x [T, H], ids [T, K], w [T, K]) -> [T, H]. JetMoE's MoE block has
    no separate experts module: its router is replaced by one that returns this routing (in the
    router's own format), and the block's output bias (the client's) is taken off again."""
    if model_type != "jetmoe":
        return experts_module(model, layer)(x, ids, w).reshape(x.shape)
    block = model.model.layers[layer].mlp
    router = block.router
    E, K = router.num_experts, ids.shape[1]

    def route(hidden_states):
        _, order = ids.flatten().sort(stable=True)  # (token, k) lanes grouped by expert
        sizes = torch.bincount(ids.flatten(), minlength=E).tolist()
        return order, order.div(K, rounding_mode="trunc"), w.flatten()[order], sizes, None

    router.forward = route  # an instance attribute shadows the class's forward
    try:
        out = block(x[None])  # [1, T, H]
    finally:
        del router.forward
    return out[0] - block.bias
