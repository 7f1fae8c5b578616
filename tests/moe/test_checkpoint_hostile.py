"""Checkpoints built to mislead the loader: every one is refused with a WeightsError naming the file, key or
setting, never read outside what the user pointed at, never a hang, a traceback or wrong weights.

E experts, H hidden, I intermediate, R ranks.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from service.errors import WeightsError
from service.moe import checkpoint
from service.moe.checkpoint import inspect_layer

E, H, I = 4, 8, 6  # noqa: E741
PREFIX = "model.layers.0.mlp."
CONFIG = {"model_type": "qwen3_moe", "num_experts": E, "num_experts_per_tok": 2, "hidden_act": "silu"}


def hf_tensors(prefix: str = PREFIX, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        out[f"{prefix}experts.{e}.gate_proj.weight"] = torch.randn(I, H, generator=gen)  # [I, H]
        out[f"{prefix}experts.{e}.up_proj.weight"] = torch.randn(I, H, generator=gen)  # [I, H]
        out[f"{prefix}experts.{e}.down_proj.weight"] = torch.randn(H, I, generator=gen)  # [H, I]
    return out


def model_dir(path, shards: dict[str, dict], weight_map: dict | None = None, config: dict = CONFIG) -> str:
    """A model directory: config.json, the shards and an index (its weight_map as given, else the shards')."""
    os.makedirs(path, exist_ok=True)
    for name, tensors in shards.items():
        save_file(tensors, os.path.join(path, name))
    if weight_map is None:
        weight_map = {k: name for name, tensors in shards.items() for k in tensors}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


# ------------------------------------------------------------------------------------- the index


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_index_naming_a_shard_outside_its_directory_is_refused(tmp_path, where):
    """A weight_map entry '../other/x.safetensors' or '/abs/x.safetensors' was read (os.path.join keeps an
    absolute name whole): the service loaded weights from outside the directory it was pointed at."""
    tensors = hf_tensors()
    keys = sorted(tensors)
    outside = tmp_path / "other"
    outside.mkdir()
    save_file({k: tensors[k] for k in keys[6:]}, str(outside / "x.safetensors"))
    name = "../other/x.safetensors" if where == "parent" else str(outside / "x.safetensors")
    weight_map = {k: "a.safetensors" for k in keys[:6]} | {k: name for k in keys[6:]}
    m = model_dir(tmp_path / "model", {"a.safetensors": {k: tensors[k] for k in keys[:6]}}, weight_map)
    with pytest.raises(WeightsError, match=r"model.safetensors.index.json' names shard '.*x.safetensors' for key"):
        inspect_layer(m)


def test_index_shard_in_a_subfolder_and_a_symlinked_shard_are_read(tmp_path):
    """What the refusal above must not catch: a shard in a subfolder, a shard that is a symlink (the Hub's
    cache links every file of a snapshot to its blob)."""
    tensors = hf_tensors()
    keys = sorted(tensors)
    blob = tmp_path / "blobs" / "b"
    blob.parent.mkdir()
    save_file({k: tensors[k] for k in keys[6:]}, str(blob))
    os.makedirs(tmp_path / "model" / "sub")
    m = model_dir(tmp_path / "model", {"sub/a.safetensors": {k: tensors[k] for k in keys[:6]}},
                  {k: "sub/a.safetensors" for k in keys[:6]} | {k: "b.safetensors" for k in keys[6:]})
    os.symlink(blob, os.path.join(m, "b.safetensors"))
    assert inspect_layer(m).E == E


@pytest.mark.parametrize("value", [3, None, ""])
def test_index_entry_that_is_not_a_file_name_is_refused(tmp_path, value):
    """A weight_map value of another JSON type was a TypeError traceback from os.path.join."""
    tensors = hf_tensors()
    weight_map = {k: "a.safetensors" for k in tensors} | {sorted(tensors)[-1]: value}
    m = model_dir(tmp_path, {"a.safetensors": tensors}, weight_map)
    with pytest.raises(WeightsError, match=rf"names shard {value!r} for key"):
        inspect_layer(m)


def test_index_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    """A model directory whose *.safetensors.index.json is a FIFO: open() blocked for ever (the service hung at
    start); now refused like any index that is not a file."""
    m = model_dir(tmp_path, {"a.safetensors": hf_tensors()})
    os.remove(os.path.join(m, "model.safetensors.index.json"))
    os.mkfifo(os.path.join(m, "model.safetensors.index.json"))
    with pytest.raises(WeightsError, match=r"model.safetensors.index.json' does not exist or is not a file"):
        inspect_layer(m)


def test_a_config_that_is_a_fifo_is_named_as_not_a_file(tmp_path):
    """A config.json that is a FIFO was reported as missing ("has no config.json")."""
    m = model_dir(tmp_path, {"a.safetensors": hf_tensors()})
    os.remove(os.path.join(m, "config.json"))
    os.mkfifo(os.path.join(m, "config.json"))
    with pytest.raises(WeightsError, match=r"the config.json of model directory .* is not a regular file"):
        inspect_layer(m)


# ------------------------------------------------------------------------------------ dtypes, dbrx


def dbrx_dir(path, experts: int, tensors: dict | None = None) -> str:
    """A dbrx block of E experts stacked [E*I, H], and a config.json saying `experts` of ffn_hidden_size I."""
    gen = torch.Generator().manual_seed(1)
    p = "transformer.blocks.0.ffn.experts.mlp."
    stacked = {p + n: torch.randn(E * I, H, generator=gen) for n in ("w1", "v1", "w2")}  # [E*I, H]
    config = {"model_type": "dbrx", "d_model": H, "ffn_config": {"moe_num_experts": experts, "moe_top_k": 2,
                                                                 "ffn_hidden_size": I, "ffn_act_fn": {"name": "silu"}}}
    return model_dir(path, {"model.safetensors": stacked | {p + k: v for k, v in (tensors or {}).items()}},
                     config=config)


@pytest.mark.parametrize("experts", [2, 8])
def test_dbrx_experts_that_contradict_ffn_hidden_size_are_refused(tmp_path, experts):
    """dbrx's E comes from config.json only: a moe_num_experts of 2 for 4 experts cut the [E*I, H] rows into
    2 experts of 2I rows and served them, every weight in the wrong place, without a word."""
    with pytest.raises(WeightsError, match=rf"ffn_hidden_size={I}, but .* split into E={experts} experts .* "
                                           rf"of I={E * I // experts} rows"):
        inspect_layer(dbrx_dir(tmp_path, experts))
    assert inspect_layer(dbrx_dir(tmp_path / "right", E)).I == I


@pytest.mark.parametrize("name,dtype", [("v1", torch.int32), ("w2", torch.float8_e4m3fn)])
def test_dbrx_up_and_down_dtypes_are_checked(tmp_path, name, dtype):
    """Only w1's dtype was checked: an integer v1, or an FP8 w2 without scales, was cast value by value."""
    wrong = {name: torch.ones(E * I, H).to(dtype)}
    with pytest.raises(WeightsError, match=rf"experts.mlp.{name}' in .* has dtype"):
        inspect_layer(dbrx_dir(tmp_path, E, wrong))


def test_gpt_oss_bias_dtype_is_checked(tmp_path):
    """gpt-oss biases of an integer dtype were cast without a word (a bool bias read as 0 / 1)."""
    gen = torch.Generator().manual_seed(2)
    p = PREFIX + "experts."
    tensors = {p + "gate_up_proj": torch.randn(E, H, 2 * I, generator=gen), p + "down_proj": torch.randn(E, I, H),
               p + "gate_up_proj_bias": torch.zeros(E, 2 * I), p + "down_proj_bias": torch.ones(E, H, dtype=torch.bool)}
    config = {"model_type": "gpt_oss", "num_local_experts": E, "num_experts_per_tok": 2}
    with pytest.raises(WeightsError, match=r"down_proj_bias' in .* has dtype BOOL"):
        inspect_layer(model_dir(tmp_path, {"model.safetensors": tensors}, config=config))


# ------------------------------------------------------------------------------------------- FP8

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_tensors(block: int, scale_block: dict | None = None) -> dict:
    """hf_tensors quantized to F8_E4M3 with `{key}_scale_inv` per block x block (scale_block: key -> another
    block size for that key's scales)."""
    out = {}
    for key, w in hf_tensors().items():  # w [out, in]
        b = (scale_block or {}).get(key, block)
        rows, cols = -(-w.shape[0] // b), -(-w.shape[1] // b)
        scale = torch.stack([torch.stack([w[r * b:(r + 1) * b, c * b:(c + 1) * b].abs().max() / FP8_MAX
                                          for c in range(cols)]) for r in range(rows)])  # [rows, cols]
        full = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:w.shape[0], :w.shape[1]]
        out[key], out[key + "_scale_inv"] = (w / full).to(torch.float8_e4m3fn), scale
    return out


def fp8_config(block) -> dict:
    return CONFIG | {"quantization_config": {"quant_method": "fp8", "weight_block_size": block}}


@pytest.mark.parametrize("e,role,block", [(0, "up", 2), (2, "gate", 2), (1, "down", 8)])
def test_fp8_scales_of_every_expert_and_role_are_checked(tmp_path, e, role, block):
    """Only expert 0's gate and down scales were checked against weight_block_size: scales of another block size
    elsewhere were read as if of that one (wrong weights, no error) or broke the load with a traceback."""
    key = f"{PREFIX}experts.{e}.{role}_proj.weight"
    m = model_dir(tmp_path, {"model.safetensors": fp8_tensors(4, {key: block})}, config=fp8_config([4, 4]))
    with pytest.raises(WeightsError, match=rf"'{key}_scale_inv' in .* has shape .* for 4x4 blocks"):
        inspect_layer(m)


@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn])
def test_fp8_scales_of_a_non_float_dtype_are_refused(tmp_path, dtype):
    """Integer or FP8 scales were multiplied in as read: wrong weights without an error."""
    tensors = fp8_tensors(4)
    key = f"{PREFIX}experts.3.gate_proj.weight_scale_inv"
    tensors[key] = tensors[key].to(dtype)
    m = model_dir(tmp_path, {"model.safetensors": tensors}, config=fp8_config([4, 4]))
    with pytest.raises(WeightsError, match=rf"'{key}' in .* has dtype .*; block scales are a float dtype"):
        inspect_layer(m)


@pytest.mark.parametrize("block", [[0, 4], [4], "4x4", [4.5, 4], [-4, -4]])
def test_fp8_weight_block_size_that_is_not_two_positive_integers_is_refused(tmp_path, block):
    """[0, 4] was a ZeroDivisionError, [4] an IndexError, '4x4' a ValueError: tracebacks at start."""
    m = model_dir(tmp_path, {"model.safetensors": fp8_tensors(4)}, config=fp8_config(block))
    with pytest.raises(WeightsError, match=r"quantization_config.weight_block_size is .*two positive integers"):
        inspect_layer(m)
    assert inspect_layer(model_dir(tmp_path / "right", {"model.safetensors": fp8_tensors(4)},
                                   config=fp8_config([4, 4]))).block == (4, 4)


def test_an_fp8_format_other_than_e4m3_is_named_as_such(tmp_path):
    """E5M2 weights with their scales beside them were refused as "without its block scales"."""
    tensors = fp8_tensors(4)
    key = f"{PREFIX}experts.0.gate_proj.weight"
    tensors[key] = tensors[key].float().to(torch.float8_e5m2)
    m = model_dir(tmp_path, {"model.safetensors": tensors}, config=fp8_config([4, 4]))
    with pytest.raises(WeightsError, match=rf"'{key}' in .* has dtype F8_E5M2 \(an FP8 format other than F8_E4M3\)"):
        inspect_layer(m)


# ------------------------------------------------------------------------------ names and config.json


def test_expert_number_with_a_leading_zero_is_not_expert_one(tmp_path):
    """'experts.01.gate_proj.weight' counted as expert 1, then the key 'experts.1....' was looked up: a KeyError
    traceback. Now it is no expert's key, and the missing expert 1 is named."""
    tensors = {k.replace("experts.1.", "experts.01."): v for k, v in hf_tensors().items()}
    m = model_dir(tmp_path, {"model.safetensors": tensors})
    with pytest.raises(WeightsError, match=rf"missing key '{PREFIX}experts.1.gate_proj.weight'"):
        inspect_layer(m)


@pytest.mark.parametrize("change,why", [({"hidden_act": ["silu"]}, "activation"),
                                        ({"swiglu_limit": "seven"}, "activation"),
                                        ({"swiglu_limits": ["x"]}, "activation"),
                                        ({"model_type": ["qwen3_moe"]}, "model_type is not a string")])
def test_config_values_of_the_wrong_type_are_named(tmp_path, change, why):
    """A config.json value of the wrong JSON type was a TypeError / ValueError traceback (exit 1), not exit 2."""
    m = model_dir(tmp_path, {"model.safetensors": hf_tensors()}, config=CONFIG | change)
    with pytest.raises(WeightsError, match=rf"config.json of .*{why}"):
        inspect_layer(m)


def test_text_config_that_is_not_an_object_is_ignored(tmp_path):
    m = model_dir(tmp_path, {"model.safetensors": hf_tensors()}, config=CONFIG | {"text_config": "none"})
    assert inspect_layer(m).E == E


@pytest.mark.parametrize("change", [{"num_experts_per_tok": 0}, {"num_experts_per_tok": -2},
                                    {"num_experts_per_tok": None, "moe_topk": [0, 2]}])
def test_a_top_k_below_one_is_refused_not_taken_for_none(tmp_path, change):
    """num_experts_per_tok 0 read as "no top-k" let K fall back to --top-k or the preset's without a word."""
    m = model_dir(tmp_path, {"model.safetensors": hf_tensors()}, config=CONFIG | change)
    with pytest.raises(WeightsError, match=r"config.json of .* says (num_experts_per_tok|moe_topk)=-?\d: each "
                                           r"token's experts \(top-k\) must be at least 1"):
        inspect_layer(m)
    assert inspect_layer(model_dir(tmp_path / "good", {"model.safetensors": hf_tensors()})).K == 2


@pytest.mark.parametrize("change,shown", [({"num_experts_per_tok": 1.5}, "num_experts_per_tok=1.5"),
                                          ({"num_experts_per_tok": True}, "num_experts_per_tok=True"),
                                          ({"num_experts_per_tok": float("inf")}, "num_experts_per_tok=inf"),
                                          ({"num_experts": float("inf")}, "num_experts=inf"),
                                          ({"num_experts": "4"}, "num_experts='4'")])
def test_config_counts_must_be_whole_numbers(tmp_path, change, shown):
    """A top-k of 1.5 or true was truncated to K=1 without a word; 1e400 (json's inf) was an OverflowError
    traceback. 8.0 is 8."""
    m = model_dir(tmp_path, {"model.safetensors": hf_tensors()}, config=CONFIG | change)
    with pytest.raises(WeightsError, match=rf"config.json of .* says {re.escape(shown)}: expected a whole number"):
        inspect_layer(m)
    assert inspect_layer(model_dir(tmp_path / "float", {"model.safetensors": hf_tensors()},
                                   config=CONFIG | {"num_experts_per_tok": 2.0})).K == 2


def test_dbrx_config_oddities_are_named_not_tracebacks(tmp_path):
    """ffn_act_fn as a bare name was an AttributeError traceback (it is read as the name now; a number is
    refused); an ffn_hidden_size of the wrong type was shown as if equal to I."""
    m = dbrx_dir(tmp_path, E)
    config = json.load(open(os.path.join(m, "config.json")))
    for act_fn, ok in (("silu", True), (5, False)):
        config["ffn_config"]["ffn_act_fn"] = act_fn
        json.dump(config, open(os.path.join(m, "config.json"), "w"))
        if ok:
            assert inspect_layer(m).I == I
        else:
            with pytest.raises(WeightsError, match=r"ffn_config.ffn_act_fn is 5, expected"):
                inspect_layer(m)
    config["ffn_config"].update(ffn_act_fn={"name": "silu"}, ffn_hidden_size=str(I))
    json.dump(config, open(os.path.join(m, "config.json"), "w"))
    with pytest.raises(WeightsError, match=rf"ffn_hidden_size='{I}', but"):
        inspect_layer(m)


def test_a_config_beside_an_index_that_is_a_fifo_is_refused_not_passed_over(tmp_path):
    """Given the index, a config.json beside it that is not a regular file was passed over: the layer then
    loaded without the model's config (its top-k and activation from the defaults)."""
    m = model_dir(tmp_path, {"a.safetensors": hf_tensors()})
    os.remove(os.path.join(m, "config.json"))
    os.mkfifo(os.path.join(m, "config.json"))
    with pytest.raises(WeightsError, match=r"the config.json of model directory .* is not a regular file"):
        inspect_layer(os.path.join(m, "model.safetensors.index.json"))


def test_fp8_scales_in_ue8m0_are_read_as_powers_of_two(tmp_path):
    """transformers' fine-grained FP8 may store its block scales as UE8M0 (F8_E8M0, powers of two): read
    exactly, as before b6778ed refused every non-float scale dtype."""
    tensors = fp8_tensors(4)
    for key in [k for k in tensors if k.endswith("_scale_inv")]:
        tensors[key] = tensors[key].to(torch.float8_e8m0fnu)
    m = model_dir(tmp_path, {"model.safetensors": tensors}, config=fp8_config([4, 4]))
    spec = inspect_layer(m)
    with checkpoint.Shards(m) as sh:
        (experts, gate, up, down, _, _), *_ = checkpoint.read_rank_slice(sh, spec, 0, I, [2])
    key = f"{PREFIX}experts.2.gate_proj.weight"
    scale = tensors[key + "_scale_inv"].float().repeat_interleave(4, 0).repeat_interleave(4, 1)[:I, :H]
    assert torch.equal(gate[0], tensors[key].float() * scale)
    assert scale.unique().log2().frac().eq(0).all()  # the scales are powers of two
