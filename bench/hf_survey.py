"""Survey: every MoE architecture transformers knows, served from its saved directory, against its own experts.

For each model_type given: a tiny random model built from its config class (no downloads: the class
defaults shrunk to H=40, I=30, E=5, K=2 where those fields exist, plus JSON overrides), every parameter
redrawn, saved sharded; the layer loaded as the ranks load it (R=2, service.moe.weights) and compared in
fp32 with the model's own experts module on the same (x, ids, w), inputs scaled by 6 so that clamps bite.
Prints one line per model: the layer, layout, E/H/I/K, activation and relative error (WRONG above 1e-4),
or the refusal (WeightsError / ConfigError: the safe outcome), or why the tiny model could not be built.

    python bench/hf_survey.py mixtral qwen2_moe 'step3p7={"text_extra": {"mlp_layer_types": ["dense", "sparse"]}}'

JSON keys: extra (config overrides), text_extra (its text_config's, for multimodal configs), layer, x_scale.
Needs transformers (the test extra). A run over 58 model types of transformers 5.25 took about 15 min on
2 cores (bench/NOTES.md, "User's trial 5").
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

import torch
import transformers

# Run as a script, bench/ would come first on sys.path; the repository root holds service/ and tests/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.errors import MoEError
from service.moe.weights import checkpoint_layer
from tests.helpers import rel_err, routing
from tests.moe.test_hf_models import base_cfg, served

H, I, E, K = 40, 30, 5, 2  # noqa: E741
# Field names as the config classes spell them; only those a class has are set.
SMALL = dict(hidden_size=H, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
             vocab_size=64, max_position_embeddings=64, intermediate_size=48, moe_intermediate_size=I,
             num_experts=E, num_local_experts=E, n_routed_experts=E, moe_num_experts=E, num_experts_per_tok=K,
             moe_k=K, moe_topk=K, top_k=K, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
             v_head_dim=10, n_group=1, topk_group=1, first_k_dense_replace=1, expert_ffn_hidden_size=I,
             moe_hidden_size=H, n_shared_experts=1, num_shared_experts=1, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
WRONG = 1e-4


def tiny(cls, extra: dict) -> dict:
    fields = cls().to_dict()
    return {**{k: v for k, v in SMALL.items() if k in fields}, **extra}


def build(model_type: str, path: str, extra: dict, text_extra: dict):
    cls = transformers.CONFIG_MAPPING[model_type]
    if isinstance(cls().to_dict().get("text_config"), dict):
        cfg = cls(text_config=tiny(type(cls().text_config), text_extra), **extra)
    else:
        cfg = cls(**tiny(cls, extra))
    torch.manual_seed(11)
    error: Exception | None = None
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText, transformers.AutoModel):
        try:
            model = auto.from_config(cfg, experts_implementation="eager").float().eval()
            break
        except (ValueError, KeyError, TypeError) as exc:
            error = exc
    else:
        raise error  # type: ignore[misc]
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(path, max_shard_size="20KB")
    return model


def experts_module(model, layer: int):
    pattern = re.compile(rf"(?:layers|blocks)\.{layer}\.(?:[^.]+\.)?experts$")
    found = [m for n, m in model.named_modules() if pattern.search(n)]
    if len(found) != 1:
        names = [n for n, _ in model.named_modules() if pattern.search(n)]
        raise LookupError(f"experts modules of layer {layer}: {names}")
    return found[0]


def check(model_type: str, extra=None, text_extra=None, layer=None, x_scale: float = 6.0, T: int = 23) -> str:
    path = tempfile.mkdtemp(prefix=f"hf_survey_{model_type}_")
    model = build(model_type, path, extra or {}, text_extra or {})
    try:
        cfg, spec = checkpoint_layer(base_cfg(), path, layer=layer)
    except MoEError as exc:
        return f"refused ({type(exc).__name__}): {exc}"
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, cfg.H, generator=gen) * x_scale  # [T, H]
    ids, w = routing(T, cfg.E, cfg.K, "balanced", gen)  # [T, K]
    with torch.no_grad():
        ref = experts_module(model, spec.layer)(x, ids, w).reshape(T, cfg.H)
    err = rel_err(served(path, cfg, spec.prefix, x, ids, w), ref)
    return (f"layer {spec.layer} {spec.layout} E={cfg.E} H={cfg.H} I={cfg.I} K={cfg.K} {spec.act.describe()} "
            f"{spec.dtype}: relative error {err:.1e} {'WRONG' if err > WRONG else 'ok'}")


def main(args: list[str]) -> None:
    torch.set_num_threads(1)
    for arg in args:
        model_type, _, overrides = arg.partition("=")
        try:
            print(f"{model_type}: {check(model_type, **(json.loads(overrides) if overrides else {}))}", flush=True)
        except Exception as exc:  # a tiny config the class refuses, an experts module not found: say so, go on
            print(f"{model_type}: not built/compared: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
