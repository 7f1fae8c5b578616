"""Reading one MoE layer's routed experts from a Hugging Face checkpoint, header first, slice by slice.

Dimension letters: E experts, H hidden, I expert intermediate size, R ranks, Ir = I / R.

Where the tensors are (`Shards`): a safetensors file, a `*.safetensors.index.json` (its
`weight_map` names the shard of every key), or a model directory (config.json plus one or more
shards, with or without an index). Only headers are read until a rank asks for its slice.

Which layer (`find_layer`): with a config.json the experts block of decoder layer `layer`
(default: the first layer that has routed experts, so dense early layers, e.g. DeepSeek-V3's
`first_k_dense_replace`, Qwen's `mlp_only_layers` / `decoder_sparse_step`, are skipped because
they hold no expert tensors); an explicit prefix wins. Without a config.json the prefix is
`--weights-prefix` (default "").

Layouts under a prefix P, detected from names and shapes (transformers' conventions, checked
against each model's own experts module in tests/moe/test_hf_models.py):

    hf          P experts.{e}.gate_proj / up_proj .weight [I, H], down_proj.weight [H, I]
    mixtral     P experts.{e}.w1 / w3 .weight [I, H], w2.weight [H, I]      (also DeepSeek-V4)
    fused       P experts.gate_up_proj [E, 2I, H] (gate rows, then up rows), experts.down_proj [E, H, I]
    fused_t     P experts.gate_up_proj [E, H, 2I] (gate columns, then up), experts.down_proj [E, I, H]
                (qwen3-vl hub files, llama4)
    gpt_oss     as fused_t but gate/up columns interleaved (gate 2j, up 2j+1), with
                gate_up_proj_bias [E, 2I] (interleaved too) and down_proj_bias [E, H]
    granite     P input_linear.weight [E, 2I, H] (gate, then up), output_linear.weight [E, H, I]
                (GraniteMoE, JetMoE)
    dbrx        P experts.mlp.w1 / v1 [E*I, H] (gate / up), experts.mlp.w2 [E*I, H] (down^T)

FP8 (`F8_E4M3` per-expert weights with `{key}_scale_inv` [ceil(out/b0), ceil(in/b1)] block scales
of a float dtype or UE8M0, DeepSeek-V3's format; [b0, b1] is config.json's quantization_config.weight_block_size,
default 128x128, checked for every expert) is dequantized while the slice is read: w = q * scale of its
block. bf16 / fp16 / fp32 / fp64 tensors are cast to the layer dtype.

What the layer cannot compute exactly is refused here (WeightsError, so the service exits 2
before starting) with a message naming the feature: a router that scales the expert input
(Llama 4), non-gated experts (ReLU^2, Nemotron-H), zero / identity experts (LongCat-Flash), an
activation the kernels do not have, a clamp applied after the activation (Bailing-hybrid,
Step-3.5). Shared experts, a block-level output bias (JetMoE) and the router itself stay with
the client: the layer serves the routed experts, and `LayerSpec.notes` says so in the start-up
log. The activation comes from config.json's hidden_act, except for model types whose experts
ignore it (MiniMax-M3: gpt-oss's activation, GPT_OSS_ACT_MODELS; HY-V4, GLM-5-Next, LFM2-MoE:
SiLU, SILU_ACT_MODELS); Inkling 2's soft-capped SwiGLU is refused by model type.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from service.config import GPT_OSS_ALPHA, Activation, cdiv
from service.errors import MoEError, WeightsError

log = logging.getLogger(__name__)

Tensor = torch.Tensor

# safetensors dtypes cast straight to the layer dtype; F8_E4M3 needs its block scales.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
FP8 = "F8_E4M3"
# Block scales: a float dtype, or UE8M0 (powers of two; transformers' fine-grained FP8 "ue8m0" scales).
SCALE_DTYPES = (*FLOAT_DTYPES, "F8_E8M0")
FP8_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size; config.json's quantization_config may differ
_EXAMPLES = 5  # keys quoted in an error message

# Per-expert 2-D tensors: name -> (naming, role).
PER_EXPERT_NAMES = {"gate_proj": ("hf", "gate"), "up_proj": ("hf", "up"), "down_proj": ("hf", "down"),
                    "w1": ("mixtral", "gate"), "w3": ("mixtral", "up"), "w2": ("mixtral", "down")}
NAMINGS = {"hf": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
           "mixtral": {"gate": "w1", "up": "w3", "down": "w2"}}
# The expert number as transformers writes it: "experts.01." is not expert 1 (expert_key would not find it).
_PER_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?)experts\.(?P<e>0|[1-9]\d*)\.(?P<name>[^.]+)\.weight$")
# Keys that mark an experts block, whatever the layout: group 1 is the block's prefix.
_BLOCK_KEYS = (
    _PER_EXPERT,
    re.compile(r"^(?P<prefix>(?:.*\.)?)experts\.(?:gate_up_proj|down_proj|up_proj)(?:_blocks)?$"),
    re.compile(r"^(?P<prefix>(?:.*\.)?)(?:input_linear|output_linear)\.weight$"),
    re.compile(r"^(?P<prefix>(?:.*\.)?)experts\.mlp\.(?:w1|v1|w2)$"),
)
_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.")  # decoder layer (dbrx: transformer.blocks.N)
_ATTENTION = re.compile(r"attn|attention")  # JetMoE's mixture of attention heads is not an MLP
# Keys of a decoder layer's experts in a layout not read (Step-3.5 'moe.gate_proj.weight' [E, I, H], Aria
# 'experts.fc1.weight'): named in the error rather than "is this a Mixture-of-Experts model?".
_EXPERT_LIKE = re.compile(r"(?:layers|blocks)\.\d+\.(?:.*\.)?(?:experts?|moe)\.")

# config.json model types whose experts the layer cannot compute exactly.
_SOFTCAP = ("the experts compute a soft-capped SwiGLU (Inkling 2: the gate and up products squashed by "
            "tanh), which the kernels do not")
REFUSED_MODELS = {
    **{t: _SOFTCAP for t in ("inkling2", "inkling2_text", "inkling2_loop", "inkling2_loop_text")},
    "llama4": "the router scales the expert input (Llama 4 multiplies x by the routing weight "
              "before the experts), which the layer, applying weights to expert outputs, cannot do",
    "llama4_text": "the router scales the expert input (Llama 4 multiplies x by the routing weight "
                   "before the experts), which the layer, applying weights to expert outputs, cannot do",
}
INTERLEAVED_MODELS = ("gpt_oss",)  # gate_up_proj columns alternate gate, up
# Experts computing gpt-oss's (u + 1) * g * sigmoid(alpha * g) with its clamp, whatever hidden_act says (MiniMax-M3
# saves "silu": transformers' experts module ignores it), on gate / up halves that are not interleaved.
GPT_OSS_ACT_MODELS = ("minimax_m3_vl", "minimax_m3_vl_text")
# Experts computing SiLU whatever hidden_act says (transformers' experts modules call F.silu themselves).
SILU_ACT_MODELS = ("hy_v4", "hy_v4_vl", "hy_v4_vl_text", "glm5_next", "glm5_next_text", "lfm2_moe")
# transformers' activation default where config.json names none (every other MoE model type's is silu).
ACT_DEFAULTS = {t: "gelu_pytorch_tanh" for t in ("gemma4", "gemma4_text", "diffusion_gemma", "diffusion_gemma_text")}
# transformers' swiglu_limit default for models whose experts always clamp: it applies where config.json leaves
# the key out (a config.json written by hand or by other tools), so it must here too.
CLAMP_DEFAULTS = {"gpt_oss": 7.0, "minimax_m3_vl": 7.0, "minimax_m3_vl_text": 7.0, "deepseek_v4": 10.0,
                  "hy_v4": 10.0, "hy_v4_vl": 10.0, "hy_v4_vl_text": 10.0, "glm5_next": 10.0, "glm5_next_text": 10.0}
# Per-layer clamps applied *after* the activation, min(act(g), L) * clamp(u, -L, L) (transformers'
# `limit_after_act`: Step-3.5 / Step-3.7 `swiglu_limits`, Bailing-hybrid `expert_swiglu_limit_list`); 0 = none.
# The kernels clamp g before the activation, so a layer whose limit is set is refused.
POST_ACT_LIMITS = ("swiglu_limits", "expert_swiglu_limit_list")
# config.json activation names -> Activation.kind (exact equals: gelu_new / gelu_fast are the tanh form).
ACT_NAMES = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
             "gelu_fast": "gelu_tanh"}
_SHARED = re.compile(r"shared_expert|shared_mlp")


@dataclass(frozen=True)
class LayerSpec:
    """One experts block of a checkpoint, as read from headers (and config.json)."""

    path: str
    prefix: str  # key prefix of the block, ends with '.' or is ''
    layout: str
    E: int
    H: int
    I: int  # noqa: E741
    K: int | None  # experts per token from config.json; None without one
    act: Activation
    bias: bool
    dtype: str  # safetensors dtype of the expert weights
    layer: int | None  # decoder layer number, when the prefix names one
    notes: tuple[str, ...] = ()  # logged at start: what stays with the client
    block: tuple[int, int] = FP8_BLOCK  # FP8 scale block (rows, columns)


# --------------------------------------------------------------------------- where the tensors are


class Shards:
    """Key -> shard file of a file, an index or a model directory; handles opened lazily, once."""

    def __init__(self, path: str | os.PathLike):
        self.path = path = os.fspath(path)
        self.config: dict | None = None
        self._handles: dict[str, object] = {}
        if os.path.isdir(path):
            self.config = _read_config(os.path.join(path, "config.json"), path)
            # transformers' own index first (Mistral repos also ship consolidated.safetensors.index.json)
            indexes = sorted((f != "model.safetensors.index.json", f) for f in os.listdir(path)
                             if f.endswith(".safetensors.index.json"))
            if indexes:
                self.where = _read_index(os.path.join(path, indexes[0][1]))
            else:
                files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
                if not files:
                    raise WeightsError(f"model directory {path!r} holds no *.safetensors file")
                self.where = {}
                for f in files:
                    for k in self._open(os.path.join(path, f)).keys():
                        if k in self.where:  # without an index no file is the right one
                            raise WeightsError(f"key {k!r} is in both {self.where[k]!r} and {os.path.join(path, f)!r} "
                                               f"in {path!r}, which has no *.safetensors.index.json to say which "
                                               f"is meant; remove the stale copy")
                        self.where[k] = os.path.join(path, f)
        elif path.endswith(".json"):
            self.where = _read_index(path)
            beside = os.path.join(os.path.dirname(path), "config.json")
            if os.path.exists(beside):  # (one that is not a regular file is refused there, not passed over)
                self.config = _read_config(beside, os.path.dirname(path))
        else:
            if not os.path.isfile(path):
                raise WeightsError(f"checkpoint {path!r} does not exist or is not a file")
            self.where = {k: path for k in self._open(path).keys()}

    def _open(self, file: str):
        if file not in self._handles:
            if not os.path.isfile(file):
                raise WeightsError(f"shard {file!r} named by {self.path!r} does not exist or is not a file")
            try:
                self._handles[file] = safe_open(file, framework="pt", device="cpu")
            except (OSError, SafetensorError) as exc:
                raise WeightsError(f"checkpoint {file!r} is not a readable safetensors file: {exc}") from exc
        return self._handles[file]

    def keys(self) -> list[str]:
        return list(self.where)

    def slice(self, key: str):
        try:
            return self._open(self.where[key]).get_slice(key)
        except SafetensorError as exc:  # an index that names the wrong shard for a key
            raise WeightsError(f"{self.path!r} says key {key!r} is in {self.where[key]!r}, which does not hold it "
                               f"({exc})") from exc

    def shape(self, key: str) -> list[int]:
        return list(self.slice(key).get_shape())

    def dtype(self, key: str) -> str:
        return self.slice(key).get_dtype()

    def close(self) -> None:
        for h in self._handles.values():
            if hasattr(h, "__exit__"):
                h.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise WeightsError(f"cannot read {what} {path!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise WeightsError(f"{what} {path!r} is not a JSON object")
    return data


def _read_config(path: str, where: str) -> dict:
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block open() for ever
        raise WeightsError(f"the config.json of model directory {where!r} is not a regular file")
    if not os.path.isfile(path):
        raise WeightsError(f"model directory {where!r} has no config.json (E, H, I, K and the activation come "
                           f"from it); pass a .safetensors file or its index instead")
    return _read_json(path, "config")


def _read_index(path: str) -> dict[str, str]:
    if not os.path.isfile(path):  # a FIFO would block open() for ever
        raise WeightsError(f"checkpoint index {path!r} does not exist or is not a file")
    weight_map = _read_json(path, "checkpoint index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError(f"checkpoint index {path!r} has no 'weight_map'")
    # Shards are named relative to the index, as transformers writes them: an absolute name or one through '..'
    # would read outside what the user pointed at (symlinked shards, as in the Hub's cache, are followed).
    for k, v in weight_map.items():
        if not isinstance(v, str) or not v or os.path.isabs(v) or ".." in re.split(r"[/\\]", v):
            raise WeightsError(f"checkpoint index {path!r} names shard {v!r} for key {k!r}: expected a file name "
                               f"beside the index")
    base = os.path.dirname(path)
    return {k: os.path.join(base, v) for k, v in weight_map.items()}


# --------------------------------------------------------------------------- config.json


def _text_config(config: dict) -> dict:
    """The language model's part of a config (multimodal configs nest it under text_config)."""
    text = config.get("text_config")
    return text if isinstance(text, dict) and text else config


def _first(config: dict, *names):
    for n in names:
        if config.get(n) is not None:
            return config[n]
    return None


def _per_layer(value, layer: int | None, name: str, where: str):
    """A config value that may be given per layer (Hunyuan's `moe_topk: [8, 8, ...]`)."""
    if not isinstance(value, (list, tuple)):
        return value
    if layer is None or not 0 <= layer < len(value):
        raise WeightsError(f"config.json of {where!r} gives {name} per layer ({value}), but the experts block "
                           f"is not of a layer it covers (layer {layer})")
    return value[layer]


def _config_top_k(config: dict, layer: int | None, where: str) -> int | None:
    """The config's top-k, at least 1: a 0 read as "not given" would let K fall back to --top-k or the
    preset's without a word."""
    if isinstance(config.get("ffn_config"), dict) and "moe_top_k" in config["ffn_config"]:  # dbrx
        name = "ffn_config.moe_top_k"
        k = _whole(config["ffn_config"]["moe_top_k"], name, where)
    else:
        # num_experts_per_tok as each model names it (transformers' attribute_map): moe_k ERNIE-4.5,
        # num_experts_per_token Kimi-Linear / Bailing, top_k_experts Gemma 4, moe_topk Hunyuan.
        names = ("num_experts_per_tok", "moe_topk", "moe_top_k", "moe_k", "num_experts_per_token", "top_k_experts",
                 "top_k", "num_selected_experts")
        name = next((n for n in names if config.get(n) is not None), "")
        if not name:
            return None
        k = _whole(_per_layer(config[name], layer, name, where), name, where)
    if k < 1:
        raise WeightsError(f"config.json of {where!r} says {name}={k}: each token's experts (top-k) must be at least 1")
    return k


def _config_experts(config: dict, layer: int | None, where: str) -> int | None:
    if isinstance(config.get("ffn_config"), dict) and "moe_num_experts" in config["ffn_config"]:  # dbrx
        return _whole(config["ffn_config"]["moe_num_experts"], "ffn_config.moe_num_experts", where)
    for name in ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts"):
        if config.get(name) is not None:
            return _whole(_per_layer(config[name], layer, name, where), name, where)
    return None


def _whole(value, name: str, where: str) -> int:
    """A count from config.json (experts, top-k): an integer, or a float that is one (8.0); 1.5, true,
    Infinity or a string is named, not truncated or a traceback."""
    if type(value) is float and value.is_integer():
        return int(value)
    if type(value) is not int:
        raise WeightsError(f"config.json of {where!r} says {name}={value!r}: expected a whole number")
    return value


def _config_activation(config: dict, model_types: tuple[str, ...], layer: int | None, where: str,
                       moe_layers: list[int]) -> Activation:
    """The experts' activation; `model_types` the config's and its text_config's model_type, `moe_layers` the
    decoder layers that have routed experts."""
    name = _first(config, "hidden_act", "activation_function", "hidden_activation")
    if name is None and isinstance(config.get("ffn_config"), dict):  # dbrx: ffn_act_fn {"name": ...}
        act_fn = config["ffn_config"].get("ffn_act_fn") or {}
        if not isinstance(act_fn, (dict, str)):
            raise WeightsError(f"config.json of {where!r}: ffn_config.ffn_act_fn is {act_fn!r}, expected "
                               f'{{"name": ...}}')
        name = act_fn.get("name") if isinstance(act_fn, dict) else act_fn
    name = name or next((ACT_DEFAULTS[t] for t in model_types if t in ACT_DEFAULTS), "silu")
    if any(t in SILU_ACT_MODELS for t in model_types):
        name = "silu"
    for key in POST_ACT_LIMITS:
        if config.get(key) is None:
            continue
        limits = config[key] if isinstance(config[key], (list, tuple)) else [config[key]] * (1 + (layer or 0))
        if layer is None and any(limits):
            raise WeightsError(f"config.json of {where!r} clamps experts after the activation ({key} = {limits}); "
                               f"serve a decoder layer whose limit is 0 (--layer)")
        if layer is not None and _per_layer(limits, layer, key, where):
            free = [n for n in moe_layers if n < len(limits) and not limits[n]]
            raise WeightsError(
                f"layer {layer} of {where!r}: {key}[{layer}] = {limits[layer]:g} clamps the experts after the "
                f"activation, min(act(g), L) * clamp(u, -L, L), which the kernels (clamping g before it) do not "
                f"compute; layers with routed experts and no such clamp: {_ranges(free) or 'none'}")
    if "swiglu_limit" in config:
        limit = config["swiglu_limit"]
    else:
        limit = next((CLAMP_DEFAULTS[t] for t in model_types if t in CLAMP_DEFAULTS), None)
    limit = float(limit) if limit else None
    if any(t in INTERLEAVED_MODELS or t in GPT_OSS_ACT_MODELS for t in model_types):
        return Activation("gpt_oss", limit=limit, alpha=float(config.get("swiglu_alpha", GPT_OSS_ALPHA)))
    if name not in ACT_NAMES:
        hint = " (a non-gated ReLU^2 expert)" if name == "relu2" else ""
        raise WeightsError(f"expert activation {name!r}{hint} is not one the kernels compute: "
                           f"supported {sorted(ACT_NAMES)} (gated), with an optional swiglu_limit clamp")
    return Activation(ACT_NAMES[name], limit=limit)


def _config_refusal(config: dict, model_type: str) -> str | None:
    if model_type in REFUSED_MODELS:
        return REFUSED_MODELS[model_type]
    zero = _first(config, "zero_expert_num", "num_zero_experts", "n_zero_experts")
    if zero:
        return f"zero (identity) experts ({zero}, as in LongCat-Flash) are not computed by the layer"
    return None


def _fp8_block(config: dict, where: str) -> tuple[int, int]:
    q = config.get("quantization_config") or {}
    if not isinstance(q, dict):
        raise WeightsError(f"config.json of {where!r}: quantization_config is {q!r}, not a JSON object")
    if (block := q.get("weight_block_size")) is None:
        return FP8_BLOCK
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise WeightsError(f"config.json of {where!r}: quantization_config.weight_block_size is {block!r}, expected "
                           f"[rows, columns] of the FP8 scale blocks, two positive integers")
    return block[0], block[1]


# --------------------------------------------------------------------------- which block, which layout


def _blocks(keys: list[str]) -> dict[str, int]:
    """Prefix of every experts block -> number of its keys."""
    found: collections.Counter = collections.Counter()
    for k in keys:
        for pattern in _BLOCK_KEYS:
            if (m := pattern.match(k)) and not (pattern is _PER_EXPERT and m["name"] not in PER_EXPERT_NAMES):
                found[m["prefix"]] += 1
                break
    return dict(found)


def _layer_of(prefix: str) -> int | None:
    m = _LAYER.search(prefix)
    return int(m.group(1)) if m else None


def find_layer(keys: list[str], layer: int | None, where: str) -> str:
    """The experts block of decoder `layer` (default: the lowest layer that has one)."""
    blocks = {p: n for p, n in _blocks(keys).items() if not _ATTENTION.search(p) and not _SHARED.search(p)}
    by_layer: dict[int, list[str]] = collections.defaultdict(list)
    for p in blocks:
        if (n := _layer_of(p)) is not None:
            by_layer[n].append(p)
    if not by_layer:
        unknown = sorted(k for k in keys if _EXPERT_LIKE.search(k) and not _SHARED.search(k))
        if unknown:  # a MoE model whose experts are stored in a layout not read (Step-3.5, Aria)
            raise WeightsError(f"{where!r} holds expert tensors in a layout that is not read (e.g. "
                               f"{unknown[:_EXAMPLES]}); known: per-expert 'experts.<e>.gate_proj/up_proj/down_proj"
                               f".weight' or 'w1/w3/w2', fused 'experts.gate_up_proj' + 'experts.down_proj', "
                               f"'input_linear' / 'output_linear', dbrx 'experts.mlp.w1/v1/w2'")
        raise WeightsError(f"{where!r} has no routed-expert tensors under any 'layers.<n>.' prefix "
                           f"(keys: {sorted(keys)[:_EXAMPLES]}...); is this a Mixture-of-Experts model?")
    moe_layers = sorted(by_layer)
    if layer is None:
        layer = moe_layers[0]
    elif layer not in by_layer:
        raise WeightsError(f"layer {layer} of {where!r} has no routed experts (a dense layer, or past the "
                           f"last); layers with experts: {_ranges(moe_layers)}")
    if len(by_layer[layer]) > 1:
        raise WeightsError(f"layer {layer} of {where!r} has several experts blocks {sorted(by_layer[layer])}; "
                           f"pick one with --weights-prefix")
    return by_layer[layer][0]


def _ranges(xs: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(xs):
        start = x if start is None else start
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def _suggest_prefixes(keys: list[str]) -> list[str]:
    # Sorted by layer, so that among the blocks the first layer comes first.
    blocks = [p for p in _blocks(keys) if not _SHARED.search(p)]
    return sorted(blocks, key=lambda p: (_layer_of(p) is None, _layer_of(p) or 0, p))[:3]


def _no_experts(path: str, keys: list[str], prefix: str) -> WeightsError:
    under = [k for k in keys if k.startswith(prefix + "experts.")]
    hint = ""
    suggestions = [p for p in _suggest_prefixes(keys) if p != prefix]
    if suggestions:
        hint = f"; did you mean prefix={suggestions[0]!r}?" + (
            f" (other candidates: {suggestions[1:]})" if len(suggestions) > 1 else "")
    examples = sorted(k for k in keys if any(p.match(k) for p in _BLOCK_KEYS)) or sorted(keys)
    what = (f"unknown expert tensor names under it (e.g. {under[:_EXAMPLES]})" if under
            else f"no '{prefix}experts.<e>.<name>.weight' keys (nor a fused layout)")
    return WeightsError(
        f"checkpoint {path!r} has {what} for prefix={prefix!r}; expected HF names "
        f"{sorted(NAMINGS['hf'].values())}, Mixtral names {sorted(NAMINGS['mixtral'].values())} or a fused "
        f"'experts.gate_up_proj' / 'input_linear' / 'experts.mlp.w1' layout. "
        f"Keys found: {examples[:_EXAMPLES]}{' ...' if len(examples) > _EXAMPLES else ''}{hint}")


def _per_expert(path: str, keys: list[str], prefix: str) -> tuple[str, dict[int, dict[str, str]]] | None:
    """Naming of per-expert keys under `prefix` and, per expert, role -> key; None when there are none."""
    experts: dict[int, dict[str, str]] = collections.defaultdict(dict)
    namings: dict[str, str] = {}
    for key in keys:
        if not key.startswith(prefix + "experts."):
            continue
        m = _PER_EXPERT.match(key[len(prefix):])
        if not m or m["prefix"] or m["name"] not in PER_EXPERT_NAMES:
            continue
        naming, role = PER_EXPERT_NAMES[m["name"]]
        namings.setdefault(naming, key)
        experts[int(m["e"])][role] = key
    if not namings:
        return None
    if len(namings) > 1:
        raise WeightsError(f"checkpoint {path!r} mixes expert namings under prefix={prefix!r}: "
                           + ", ".join(f"{n} (e.g. {k!r})" for n, k in sorted(namings.items())))
    return next(iter(namings)), experts


def expert_key(prefix: str, e: int, role: str, naming: str = "hf") -> str:
    return f"{prefix}experts.{e}.{NAMINGS[naming][role]}.weight"


def _check_dtype(sh: Shards, key: str, has_scale: bool) -> str:
    dtype = sh.dtype(key)
    if dtype == FP8 and has_scale:
        return dtype
    if dtype not in FLOAT_DTYPES:
        extra = (f" without its block scales {key + '_scale_inv'!r}" if dtype == FP8
                 else f" (an FP8 format other than {FP8})" if dtype.startswith("F8") else "")
        raise WeightsError(f"key {key!r} in {sh.path!r} has dtype {dtype}{extra}; expected a float dtype "
                           f"({', '.join(FLOAT_DTYPES)}) or {FP8} with its 'weight_scale_inv' block scales")
    return dtype


def _inspect_per_expert(sh: Shards, prefix: str, naming: str, experts: dict[int, dict[str, str]]):
    path = sh.path
    E = max(experts) + 1
    gate0 = expert_key(prefix, 0, "gate", naming)
    if "gate" not in experts.get(0, {}):
        roles = {r for ex in experts.values() for r in ex}
        if "gate" not in roles:
            raise WeightsError(f"the experts under prefix={prefix!r} in {path!r} have no gate projection "
                               f"(only {sorted(roles)}): non-gated experts (e.g. ReLU^2) are not computed by the layer")
        raise WeightsError(f"checkpoint {path!r} is missing key {gate0!r} (shape [I, H]); E, H and I are read from it")
    shape0 = sh.shape(gate0)
    if len(shape0) != 2:
        raise WeightsError(f"key {gate0!r} in {path!r} has shape {shape0}, expected a 2-D [I, H]")
    I, H = shape0  # noqa: E741
    dtypes = set()
    for e in range(E):
        for role in ("gate", "up", "down"):
            key = expert_key(prefix, e, role, naming)
            want = [H, I] if role == "down" else [I, H]
            if role not in experts.get(e, {}):
                raise WeightsError(f"checkpoint {path!r} is missing key {key!r} (expected shape {want}; "
                                   f"E={E} from the highest expert index, H={H}, I={I} from {gate0!r})")
            if (shape := sh.shape(key)) != want:
                raise WeightsError(f"key {key!r} in {path!r} has shape {shape}, expected {want} "
                                   f"(H={H}, I={I} from {gate0!r})")
            dtypes.add(_check_dtype(sh, key, key + "_scale_inv" in sh.where))
    if len(dtypes) > 1:
        raise WeightsError(f"the experts under prefix={prefix!r} in {path!r} mix dtypes {sorted(dtypes)}")
    return naming, E, H, I, dtypes.pop(), False


def _need(sh: Shards, key: str, prefix: str, layout: str) -> list[int]:
    if key not in sh.where:
        raise WeightsError(f"checkpoint {sh.path!r} has a {layout} experts block at prefix={prefix!r} "
                           f"but no {key!r}")
    if len(shape := sh.shape(key)) not in (2, 3):
        raise WeightsError(f"key {key!r} in {sh.path!r} has shape {shape}, expected a 3-D [E, ., .] tensor")
    return shape


def _inspect_fused(sh: Shards, prefix: str, interleaved: bool, E_config: int | None):
    keys = sh.where
    path = sh.path
    if prefix + "experts.gate_up_proj" in keys:
        gu_key, down_key, layout = prefix + "experts.gate_up_proj", prefix + "experts.down_proj", "fused"
    elif prefix + "input_linear.weight" in keys:
        gu_key, down_key, layout = prefix + "input_linear.weight", prefix + "output_linear.weight", "granite"
    elif prefix + "experts.mlp.w1" in keys:
        return _inspect_dbrx(sh, prefix, E_config)
    elif prefix + "experts.gate_up_proj_blocks" in keys:
        raise WeightsError(f"the experts under prefix={prefix!r} in {path!r} are MXFP4-quantized (gpt-oss "
                           f"'gate_up_proj_blocks' / '_scales'), which is not read; serve a bf16 copy (transformers "
                           f"dequantizes with Mxfp4Config(dequantize=True) and save_pretrained)")
    elif prefix + "experts.up_proj" in keys or prefix + "experts.down_proj" in keys:
        raise WeightsError(f"the experts under prefix={prefix!r} in {path!r} have no gate projection: "
                           f"non-gated experts (e.g. ReLU^2, Nemotron-H) are not computed by the layer")
    else:
        return None
    gu, down = _need(sh, gu_key, prefix, layout), _need(sh, down_key, prefix, layout)
    if len(gu) != 3 or len(down) != 3 or gu[0] != down[0]:
        raise WeightsError(f"{gu_key!r} {gu} and {down_key!r} {down} in {path!r} are not [E, ., .] tensors "
                           f"of one E")
    E, a, b = gu
    _, c, d = down
    if b == c and a == 2 * d:  # [E, 2I, H], [E, H, I]
        H, I = b, d  # noqa: E741
        if interleaved:
            raise WeightsError(f"{gu_key!r} {gu} is [E, 2I, H], but gpt-oss interleaves gate and up over "
                               f"[E, H, 2I]; this layout is not known")
    elif a == d and b == 2 * c and layout == "fused":  # [E, H, 2I], [E, I, H]
        H, I = a, c  # noqa: E741
        layout = "gpt_oss" if interleaved else "fused_t"
    else:
        raise WeightsError(f"{gu_key!r} has shape {gu} and {down_key!r} {down} in {path!r}: expected "
                           f"[E, 2I, H] + [E, H, I] or [E, H, 2I] + [E, I, H]")
    dtype = _check_dtype(sh, gu_key, False)
    _check_dtype(sh, down_key, False)
    bias = prefix + "experts.gate_up_proj_bias" in keys
    if bias != (prefix + "experts.down_proj_bias" in keys):
        raise WeightsError(f"checkpoint {path!r} has only one of gate_up_proj_bias / down_proj_bias at {prefix!r}")
    if bias:
        if layout != "gpt_oss":
            raise WeightsError(f"expert biases at {prefix!r} in {path!r} are known only for gpt-oss (a config.json "
                               f"with model_type 'gpt_oss' gives their activation); found layout {layout}")
        for key, want in ((prefix + "experts.gate_up_proj_bias", [E, 2 * I]),
                          (prefix + "experts.down_proj_bias", [E, H])):
            if sh.shape(key) != want:
                raise WeightsError(f"key {key!r} in {path!r} has shape {sh.shape(key)}, expected {want}")
            _check_dtype(sh, key, False)
    return layout, E, H, I, dtype, bias


def _inspect_dbrx(sh: Shards, prefix: str, E: int | None):
    keys = [prefix + f"experts.mlp.{n}" for n in ("w1", "v1", "w2")]
    shapes = [_need(sh, k, prefix, "dbrx") for k in keys]
    if E is None:
        raise WeightsError(f"{keys[0]!r} in {sh.path!r} stacks all experts as [E*I, H]: the number of experts "
                           f"comes from config.json (ffn_config.moe_num_experts), which is missing")
    if any(s != shapes[0] or len(s) != 2 for s in shapes) or shapes[0][0] % E:
        raise WeightsError(f"dbrx expert tensors {dict(zip(keys, shapes, strict=True))} in {sh.path!r} are not "
                           f"[E*I, H] with E={E}")
    dtype = _check_dtype(sh, keys[0], False)
    for key in keys[1:]:
        _check_dtype(sh, key, False)
    return "dbrx", E, shapes[0][1], shapes[0][0] // E, dtype, False


def read_spec(sh: Shards, prefix: str = "", layer: int | None = None) -> LayerSpec:
    """The experts block at `prefix` (when empty and there is a config.json: that of `layer`) and
    what it computes."""
    path, keys = sh.path, sh.keys()
    config = _text_config(sh.config) if sh.config is not None else None
    model_type = (sh.config or {}).get("model_type", "") if config is not None else ""
    if not isinstance(model_type, str) or not isinstance((config or {}).get("model_type", ""), str):
        raise WeightsError(f"config.json of {path!r}: model_type is not a string")
    if config is not None and (why := _config_refusal(config, model_type) or _config_refusal(sh.config, model_type)):
        raise WeightsError(f"{path!r} (model_type {model_type!r}) cannot be served: {why}")
    if config is None and layer is not None:
        raise WeightsError(f"--layer needs a config.json beside the weights ({path!r} has none); "
                           f"use --weights-prefix for a plain file")
    if not prefix:  # with a config.json: the layer's block; without one: keys at the top level
        prefix = find_layer(keys, layer, path) if config is not None else ""
    elif layer is not None and _layer_of(prefix) != layer:
        raise WeightsError(f"--layer {layer} and --weights-prefix {prefix!r} name different layers; give one")
    try:
        E_config = _config_experts(config, _layer_of(prefix), path) if config is not None else None
        K_config = _config_top_k(config, _layer_of(prefix), path) if config is not None else None
    except (TypeError, ValueError) as exc:  # a value of the wrong type: name it, do not crash
        raise WeightsError(f"config.json of {path!r}: cannot read the number of experts or top-k ({exc})") from exc
    found = _per_expert(path, keys, prefix)
    if found is not None:
        layout, E, H, I, dtype, bias = _inspect_per_expert(sh, prefix, *found)
    else:
        fused = _inspect_fused(sh, prefix, model_type in INTERLEAVED_MODELS, E_config)
        if fused is None:
            raise _no_experts(path, keys, prefix)
        layout, E, H, I, dtype, bias = fused
    if E_config is not None and E_config != E:
        raise WeightsError(f"config.json of {path!r} says {E_config} routed experts, the tensors at "
                           f"prefix={prefix!r} hold {E}")
    # dbrx's E comes from config.json alone: a wrong moe_num_experts still divides E*I rows, into the wrong experts.
    ffn = (config or {}).get("ffn_config")
    I_dbrx = ffn.get("ffn_hidden_size") if layout == "dbrx" and isinstance(ffn, dict) else None
    if I_dbrx is not None and I_dbrx != I:
        raise WeightsError(f"config.json of {path!r} says ffn_config.ffn_hidden_size={I_dbrx!r}, but the dbrx "
                           f"tensors at prefix={prefix!r} split into E={E} experts (ffn_config.moe_num_experts) of "
                           f"I={I} rows; one of the two is wrong")
    moe_layers = sorted({n for p in _blocks(keys) if (n := _layer_of(p)) is not None})
    try:
        act = (_config_activation(config, (model_type, config.get("model_type", "")), _layer_of(prefix), path,
                                  moe_layers) if config is not None else Activation())
    except MoEError:
        raise
    except (TypeError, ValueError) as exc:  # hidden_act, swiglu_limit(s) of the wrong type: name it, do not crash
        raise WeightsError(f"config.json of {path!r}: cannot read the experts' activation or its clamp "
                           f"({exc})") from exc
    if bias and config is None:
        raise WeightsError(f"expert biases at prefix={prefix!r} in {path!r} (gpt-oss) need the model's config.json "
                           f"for their activation; pass the model directory")
    block = _fp8_block(sh.config, path) if dtype == FP8 and sh.config is not None else FP8_BLOCK
    if dtype == FP8:  # every expert's scales must tile its weights in blocks of `block`, in a float dtype
        for key in (expert_key(prefix, e, role, layout) for e in range(E) for role in ("gate", "up", "down")):
            out, inn = sh.shape(key)
            want = [cdiv(out, block[0]), cdiv(inn, block[1])]
            if (got := sh.shape(key + "_scale_inv")) != want:
                raise WeightsError(f"{key + '_scale_inv'!r} in {path!r} has shape {got}, expected {want} for "
                                   f"{block[0]}x{block[1]} blocks of {key!r} {[out, inn]} (quantization_config."
                                   f"weight_block_size)")
            if (scale_dtype := sh.dtype(key + "_scale_inv")) not in SCALE_DTYPES:
                raise WeightsError(f"{key + '_scale_inv'!r} in {path!r} has dtype {scale_dtype}; block scales are a "
                                   f"float dtype ({', '.join(SCALE_DTYPES)})")
    notes = []
    block_keys = [k for k in keys if k.startswith(prefix) and _SHARED.search(k[len(prefix):])]
    if block_keys:
        notes.append(f"shared experts ({block_keys[0]!r}, ...) are the client's: serving the routed experts only")
    if config is not None and K_config is None:  # K falls back to --top-k, else the preset's: say so
        notes.append(f"the config.json of {path!r} names no top-k (num_experts_per_tok or a model's own name for "
                     f"it): K is --top-k's, else the preset's")
    if prefix + "bias" in sh.where:
        notes.append(f"the block's output bias {prefix + 'bias'!r} is the client's (added after the expert sum)")
    return LayerSpec(path=path, prefix=prefix, layout=layout, E=E, H=H, I=I,
                     K=K_config, act=act, bias=bias, dtype=dtype, layer=_layer_of(prefix), notes=tuple(notes),
                     block=block)


def inspect_layer(path: str | os.PathLike, prefix: str = "", layer: int | None = None) -> LayerSpec:
    """read_spec on a file, index or directory, headers only."""
    with Shards(path) as sh:
        return read_spec(sh, prefix, layer)


# --------------------------------------------------------------------------- reading a rank's slice


def _read(sh: Shards, spec: LayerSpec, key: str, index: tuple) -> Tensor:
    """Tensor `key` at `index` (a tuple of slices), FP8 dequantized with its block scales, on the CPU."""
    part = sh.slice(key)[index]
    if spec.dtype != FP8:
        return part
    B0, B1 = spec.block
    rows, cols = index
    r0, r1 = rows.start or 0, rows.stop
    c0, c1 = cols.start or 0, cols.stop
    out, inn = sh.shape(key)
    r1, c1 = min(r1 if r1 is not None else out, out), min(c1 if c1 is not None else inn, inn)
    scale = sh.slice(key + "_scale_inv")[r0 // B0:cdiv(r1, B0), c0 // B1:cdiv(c1, B1)].float()  # [blocks, blocks]
    full = scale.repeat_interleave(B0, 0).repeat_interleave(B1, 1)  # one value per element of the blocks
    return part.float() * full[r0 - (r0 // B0) * B0:r1 - (r0 // B0) * B0, c0 - (c0 // B1) * B1:c1 - (c0 // B1) * B1]


def read_rank_slice(sh: Shards, spec: LayerSpec, r0: int, Ir: int, experts: list[int] | None = None):
    """Yield (experts, gate [n, Ir, H], up [n, Ir, H], down^T [n, Ir, H], gate/up bias [n, 2*Ir] or None, down bias
    [n, H] or None) for rows r0..r0+Ir of I, a few experts at a time; views where the layout allows.
    `experts` limits the walk to those experts (default: all, in order)."""
    p, r1, I = spec.prefix, r0 + Ir, spec.I  # noqa: E741
    walk = range(spec.E) if experts is None else experts
    rows, every = slice(r0, r1), slice(None)
    if spec.layout in NAMINGS:
        for e in walk:
            gate = _read(sh, spec, expert_key(p, e, "gate", spec.layout), (rows, every))  # [Ir, H]
            up = _read(sh, spec, expert_key(p, e, "up", spec.layout), (rows, every))  # [Ir, H]
            down = _read(sh, spec, expert_key(p, e, "down", spec.layout), (every, rows))  # [H, Ir]
            yield slice(e, e + 1), gate[None], up[None], down.T[None], None, None
    elif spec.layout in ("fused", "granite"):
        gu_key, down_key = ((p + "experts.gate_up_proj", p + "experts.down_proj") if spec.layout == "fused"
                            else (p + "input_linear.weight", p + "output_linear.weight"))
        gu, down = sh.slice(gu_key), sh.slice(down_key)
        for e in walk:  # one expert at a time: a rank never holds more than its slice plus one
            gate = gu[e:e + 1, r0:r1]  # [1, Ir, H]
            up = gu[e:e + 1, I + r0:I + r1]  # [1, Ir, H]
            yield slice(e, e + 1), gate, up, down[e:e + 1, :, r0:r1].transpose(1, 2), None, None
    elif spec.layout in ("fused_t", "gpt_oss"):
        gu, down = sh.slice(p + "experts.gate_up_proj"), sh.slice(p + "experts.down_proj")
        for e in walk:
            if spec.layout == "fused_t":
                gate = gu[e:e + 1, :, r0:r1].transpose(1, 2)  # [1, Ir, H]
                up = gu[e:e + 1, :, I + r0:I + r1].transpose(1, 2)
                yield slice(e, e + 1), gate, up, down[e:e + 1, r0:r1], None, None
                continue
            both = gu[e:e + 1, :, 2 * r0:2 * r1]  # [1, H, 2*Ir] interleaved gate, up
            bias = sh.slice(p + "experts.gate_up_proj_bias")[e:e + 1, 2 * r0:2 * r1]  # [1, 2*Ir]
            b13 = torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1)  # [1, 2*Ir] gate, then up
            b2 = sh.slice(p + "experts.down_proj_bias")[e:e + 1] if r0 == 0 else None  # [1, H] rank 0 adds it
            yield (slice(e, e + 1), both[:, :, 0::2].transpose(1, 2), both[:, :, 1::2].transpose(1, 2),
                   down[e:e + 1, r0:r1], b13, b2)
    elif spec.layout == "dbrx":
        w1, v1, w2 = (sh.slice(p + f"experts.mlp.{n}") for n in ("w1", "v1", "w2"))
        for e in walk:
            lo, hi = e * I + r0, e * I + r1
            yield slice(e, e + 1), w1[lo:hi][None], v1[lo:hi][None], w2[lo:hi][None], None, None
    else:  # pragma: no cover - read_spec only returns the layouts above
        raise AssertionError(spec.layout)


__all__ = ["LayerSpec", "Shards", "expert_key", "find_layer", "inspect_layer", "read_rank_slice", "read_spec"]
