"""Weights: checkpoint round trips per rank, synthetic slices, every loader error, slice-only reads.

E experts, H hidden, I intermediate, R ranks, Ir = I / R.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from service.config import LayerConfig
from service.errors import ConfigError, WeightsError
from service.moe import checkpoint
from service.moe import weights as W
from service.moe.weights import (
    RankWeights,
    expert_key,
    inspect_checkpoint,
    load_rank_weights,
    synthetic_expert,
    synthetic_rank_weights,
    write_synthetic_checkpoint,
)

# I = 144 crosses synthetic row-block boundaries (64, 128) inside rank slices for every R below.
E, H, I = 5, 40, 144  # noqa: E741
RANKS = (1, 2, 3, 4)
SEED = 1234
PREFIX = "model.layers.0.block_sparse_moe."


def make_cfg(R: int = 2, dtype: torch.dtype = torch.float32, **changes) -> LayerConfig:
    shape = dict(E=E, H=H, I=I, K=2, R=R, C=4, dtype=dtype)
    shape.update(changes)
    return LayerConfig(**shape)


def full_synthetic(cfg: LayerConfig, seed: int = SEED):
    experts = [synthetic_expert(cfg, seed, e) for e in range(cfg.E)]
    return [torch.stack(m) for m in zip(*experts, strict=True)]  # gate [E, I, H], up [E, I, H], down [E, H, I]


def expected_slice(gate, up, down, rank: int, Ir: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = slice(rank * Ir, (rank + 1) * Ir)
    w13 = torch.cat([gate[:, rows].transpose(1, 2), up[:, rows].transpose(1, 2)], dim=2)  # [E, H, 2*Ir]
    w2 = down[:, :, rows].transpose(1, 2)  # [E, Ir, H]
    return w13, w2


def hf_tensors(cfg: LayerConfig, prefix: str = "", naming: str = "hf", seed: int = SEED) -> dict:
    gate, up, down = full_synthetic(cfg, seed)
    out = {}
    for e in range(cfg.E):
        for role, m in zip(W.ROLES, (gate, up, down), strict=True):
            out[expert_key(prefix, e, role, naming)] = m[e].to(cfg.dtype).contiguous()
    return out


def save(path, tensors: dict) -> str:
    save_file(tensors, str(path), metadata={"format": "pt"})
    return str(path)


# ----------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("naming,prefix", [("hf", ""), ("mixtral", ""), ("hf", "model.layers.0.mlp."),
                                           ("mixtral", PREFIX)])
def test_round_trip_every_rank(tmp_path, naming, prefix, dtype):
    base = make_cfg(dtype=dtype)
    path = tmp_path / "ckpt.safetensors"
    write_synthetic_checkpoint(path, base, SEED, prefix=prefix, naming=naming)
    assert inspect_checkpoint(path, prefix) == (E, H, I)
    gate, up, down = full_synthetic(base)
    for R in RANKS:
        cfg = make_cfg(R=R, dtype=dtype)
        shards = [load_rank_weights(path, cfg, r, prefix=prefix) for r in range(R)]
        for r, rw in enumerate(shards):
            assert rw.w13.shape == (E, H, 2 * cfg.Ir) and rw.w2.shape == (E, cfg.Ir, H)
            assert rw.w13.dtype == dtype and rw.w2.dtype == dtype
            assert rw.w13.is_contiguous() and rw.w2.is_contiguous()
            w13, w2 = expected_slice(gate, up, down, r, cfg.Ir)
            assert torch.equal(rw.w13.float(), w13), f"R={R} rank {r} w13"
            assert torch.equal(rw.w2.float(), w2), f"R={R} rank {r} w2"
        # The ranks' slices put back together are the full matrices.
        rebuilt_gate = torch.cat([rw.w13[:, :, :cfg.Ir].transpose(1, 2) for rw in shards], dim=1)
        rebuilt_up = torch.cat([rw.w13[:, :, cfg.Ir:].transpose(1, 2) for rw in shards], dim=1)
        rebuilt_down = torch.cat([rw.w2.transpose(1, 2) for rw in shards], dim=2)
        assert torch.equal(rebuilt_gate.float(), gate)
        assert torch.equal(rebuilt_up.float(), up)
        assert torch.equal(rebuilt_down.float(), down)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("R", RANKS)
def test_synthetic_rank_weights_match_loaded_checkpoint(tmp_path, R, dtype):
    cfg = make_cfg(R=R, dtype=dtype)
    path = tmp_path / "ckpt.safetensors"
    write_synthetic_checkpoint(path, cfg, SEED)
    for r in range(R):
        synth = synthetic_rank_weights(cfg, r, SEED)
        loaded = load_rank_weights(path, cfg, r)
        assert synth.w13.dtype == dtype and synth.w13.is_contiguous() and synth.w2.is_contiguous()
        assert torch.equal(synth.w13, loaded.w13), f"rank {r} w13"
        assert torch.equal(synth.w2, loaded.w2), f"rank {r} w2"


def test_load_casts_checkpoint_dtype_to_config_dtype(tmp_path):
    cfg = make_cfg(R=2, dtype=torch.bfloat16)
    tensors = {k: v.to(torch.float16) for k, v in hf_tensors(make_cfg(R=2)).items()}
    path = save(tmp_path / "fp16.safetensors", tensors)
    rw = load_rank_weights(path, cfg, 1)
    gate, up, down = full_synthetic(make_cfg(R=2))
    w13, w2 = expected_slice(gate, up, down, 1, cfg.Ir)
    assert rw.w13.dtype == torch.bfloat16
    assert torch.equal(rw.w13, w13.half().to(torch.bfloat16))
    assert torch.equal(rw.w2, w2.half().to(torch.bfloat16))


# ------------------------------------------------------------------------------ synthetic values


def test_synthetic_expert_deterministic_rounded_and_scaled():
    cfg = make_cfg(dtype=torch.bfloat16)
    gate, up, down = synthetic_expert(cfg, SEED, 3)
    assert gate.shape == (I, H) and up.shape == (I, H) and down.shape == (H, I)
    for m in (gate, up, down):
        assert m.dtype == torch.float32
        assert torch.equal(m, m.to(torch.bfloat16).float())  # already rounded to cfg.dtype
    again = synthetic_expert(cfg, SEED, 3)
    assert all(torch.equal(a, b) for a, b in zip((gate, up, down), again, strict=True))
    # Independent of R, K, C: every rank of every group shape sees the same experts.
    other = synthetic_expert(make_cfg(R=4, K=3, C=7, dtype=torch.bfloat16), SEED, 3)
    assert all(torch.equal(a, b) for a, b in zip((gate, up, down), other, strict=True))
    assert not torch.equal(gate, synthetic_expert(cfg, SEED, 4)[0])
    assert not torch.equal(gate, synthetic_expert(cfg, SEED + 1, 3)[0])
    assert not torch.equal(gate, up)
    # 1/sqrt(fan_in) scaling keeps activations O(1).
    assert gate.std().item() == pytest.approx(1 / math.sqrt(H), rel=0.1)
    assert down.std().item() == pytest.approx(1 / math.sqrt(I), rel=0.1)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(0))  # [T, H]
    y = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T  # [T, H]
    assert 0.05 < y.std().item() < 5


# ------------------------------------------------------------------------------- slice-only reads


class _SliceSpy:
    def __init__(self, inner, key, log):
        self._inner, self._key, self._log = inner, key, log

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __getitem__(self, index):
        out = self._inner[index]
        self._log.append((self._key, tuple(out.shape)))
        return out


class _HandleSpy:
    """Wraps a safe_open handle: records slice reads, fails on any whole-tensor read."""

    def __init__(self, inner, log):
        self._inner, self._log = inner, log

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def keys(self):
        return self._inner.keys()

    def get_slice(self, key):
        return _SliceSpy(self._inner.get_slice(key), key, self._log)

    def get_tensor(self, key):
        raise AssertionError(f"get_tensor({key!r}) read a whole tensor")


@pytest.mark.parametrize("naming", ["hf", "mixtral"])
def test_load_reads_only_the_rank_slice(tmp_path, monkeypatch, naming):
    cfg = make_cfg(R=3)
    path = tmp_path / "ckpt.safetensors"
    write_synthetic_checkpoint(path, cfg, SEED, prefix=PREFIX, naming=naming)
    reads: list[tuple[str, tuple[int, ...]]] = []
    real_open = checkpoint.safe_open
    monkeypatch.setattr(checkpoint, "safe_open", lambda *a, **k: _HandleSpy(real_open(*a, **k), reads))
    rw = load_rank_weights(path, cfg, 2, prefix=PREFIX)
    assert isinstance(rw, RankWeights)
    assert len(reads) == 3 * E  # exactly one slice read per expert tensor
    want = {"gate": (cfg.Ir, H), "up": (cfg.Ir, H), "down": (H, cfg.Ir)}
    for e in range(E):
        for role in W.ROLES:
            assert (expert_key(PREFIX, e, role, naming), want[role]) in reads


# ---------------------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    path = tmp_path / "nope.safetensors"
    with pytest.raises(WeightsError, match="nope.safetensors"):
        load_rank_weights(path, make_cfg(), 0)
    with pytest.raises(WeightsError, match="nope.safetensors"):
        inspect_checkpoint(path)


def test_directory_and_not_safetensors(tmp_path):
    with pytest.raises(WeightsError, match=str(tmp_path)):
        inspect_checkpoint(tmp_path)
    junk = tmp_path / "junk.safetensors"
    junk.write_text("this is not a safetensors file")
    with pytest.raises(WeightsError, match="junk.safetensors.*not a readable safetensors"):
        load_rank_weights(junk, make_cfg(), 0)
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(WeightsError, match="empty.safetensors"):
        inspect_checkpoint(empty)


def test_directory_with_a_key_in_two_files_is_refused(tmp_path):
    """Without an index, a directory whose files hold the same key twice (a stale copy beside the
    shards) is ambiguous: the file sorted last used to win without a word."""
    tensors = hf_tensors(make_cfg(), prefix=PREFIX)
    (tmp_path / "config.json").write_text('{"model_type": "mixtral", "num_local_experts": 5}')
    save(tmp_path / "model.safetensors", tensors)
    key = expert_key(PREFIX, 3, "gate")
    save(tmp_path / "model.stale.safetensors", {key: tensors[key] * 2})
    with pytest.raises(WeightsError, match=rf"{key}.* both .*model.safetensors.* and .*model.stale.safetensors"):
        inspect_checkpoint(tmp_path)


def test_index_naming_the_wrong_shard_for_a_key(tmp_path):
    """An index whose weight_map sends a key to a shard without it: a WeightsError naming both (it was a raw
    SafetensorError traceback, exit 1)."""
    tensors = hf_tensors(make_cfg(), prefix=PREFIX)
    keys = sorted(tensors)
    save(tmp_path / "a.safetensors", {k: tensors[k] for k in keys[:6]})
    save(tmp_path / "b.safetensors", {k: tensors[k] for k in keys[6:]})
    weight_map = {k: "a.safetensors" for k in keys[:6]} | {k: "a.safetensors" for k in keys[6:]}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightsError, match=r"says key '(.*)' is in '.*a.safetensors', which does not hold it") as err:
        inspect_checkpoint(tmp_path / "model.safetensors.index.json", prefix=PREFIX)
    assert err.value.args[0].split("says key '")[1].split("'")[0] in keys[6:]


@pytest.mark.parametrize("role,shape", [("up", "[144, 40]"), ("down", "[40, 144]")])
def test_missing_key_names_key_and_shape(tmp_path, role, shape):
    tensors = hf_tensors(make_cfg())
    key = expert_key("", 2, role)
    del tensors[key]
    path = save(tmp_path / "ckpt.safetensors", tensors)
    with pytest.raises(WeightsError) as err:
        load_rank_weights(path, make_cfg(), 0)
    assert key in str(err.value) and shape in str(err.value)


def test_missing_gate_of_expert_zero(tmp_path):
    tensors = hf_tensors(make_cfg())
    del tensors[expert_key("", 0, "gate")]
    path = save(tmp_path / "ckpt.safetensors", tensors)
    with pytest.raises(WeightsError, match=r"experts\.0\.gate_proj\.weight.*\[I, H\]"):
        inspect_checkpoint(path)


@pytest.mark.parametrize("role,bad", [("up", (I, H + 1)), ("down", (I, H)), ("gate", (I, H, 1))])
def test_wrong_shape_names_key_expected_and_actual(tmp_path, role, bad):
    tensors = hf_tensors(make_cfg())
    e = 0 if role == "gate" else 3
    key = expert_key("", e, role)
    tensors[key] = torch.zeros(bad)
    path = save(tmp_path / "ckpt.safetensors", tensors)
    with pytest.raises(WeightsError) as err:
        load_rank_weights(path, make_cfg(), 0)
    msg = str(err.value)
    assert key in msg and str(list(bad)) in msg
    if role != "gate":
        assert str([H, I] if role == "down" else [I, H]) in msg


def test_wrong_prefix_suggests_the_right_one(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    write_synthetic_checkpoint(path, make_cfg(), SEED, prefix=PREFIX, naming="mixtral")
    for wrong in ("", "model.layers.0.mlp.", "model.layers.0.block_sparse_moe"):
        with pytest.raises(WeightsError) as err:
            load_rank_weights(path, make_cfg(), 0, prefix=wrong)
        msg = str(err.value)
        assert f"prefix={PREFIX!r}" in msg  # the suggestion
        assert f"{PREFIX}experts.0.w1.weight" in msg  # a key actually found


def test_unknown_naming_lists_keys(tmp_path):
    tensors = {f"experts.{e}.{n}.weight": torch.zeros(I, H) for e in range(2) for n in ("fc1", "fc2")}
    path = save(tmp_path / "ckpt.safetensors", tensors)
    with pytest.raises(WeightsError, match=r"unknown expert tensor names.*experts\.0\.fc1\.weight"):
        inspect_checkpoint(path)


def test_mixed_naming(tmp_path):
    tensors = hf_tensors(make_cfg())
    for role in W.ROLES:
        tensors[expert_key("", 1, role, "mixtral")] = tensors.pop(expert_key("", 1, role, "hf"))
    path = save(tmp_path / "ckpt.safetensors", tensors)
    with pytest.raises(WeightsError, match=r"mixes expert namings.*hf.*mixtral"):
        load_rank_weights(path, make_cfg(), 0)


def test_non_float_dtype(tmp_path):
    tensors = hf_tensors(make_cfg())
    key = expert_key("", 4, "down")
    tensors[key] = torch.zeros(H, I, dtype=torch.int8)
    path = save(tmp_path / "ckpt.safetensors", tensors)
    with pytest.raises(WeightsError) as err:
        load_rank_weights(path, make_cfg(), 0)
    assert key in str(err.value) and "I8" in str(err.value)


@pytest.mark.parametrize("value,dtype,why", [
    (float("nan"), torch.float32, "NaN or infinity"), (float("inf"), torch.bfloat16, "NaN or infinity"),
    (7e4, torch.float16, r"values up to 70000, beyond the range of torch.float16")])
def test_non_finite_weights_are_refused_at_load(tmp_path, value, dtype, why):
    """A NaN or infinity, or an fp32 value past float16's 65504 loaded into an fp16 layer, would make every answer
    through that expert non-finite (the warm-up then blamed the slots): refused naming the expert and the rank."""
    tensors = hf_tensors(make_cfg())
    tensors[expert_key("", 3, "down")][5, I - 1] = value  # [H, I]: the last rank's columns
    path = save(tmp_path / "ckpt.safetensors", tensors)
    cfg = make_cfg(dtype=dtype)
    load_rank_weights(path, cfg, 0)  # rank 0's slice holds no bad value
    with pytest.raises(WeightsError, match=rf"expert 3's down .*rank 1's slice\) holds {why}"):
        load_rank_weights(path, cfg, 1)


@pytest.mark.parametrize("field,value", [("E", 4), ("E", 6), ("H", 48), ("I", 96)])
def test_shape_mismatch_with_config(tmp_path, field, value):
    path = tmp_path / "ckpt.safetensors"
    write_synthetic_checkpoint(path, make_cfg(), SEED)
    have = {"E": E, "H": H, "I": I}[field]
    with pytest.raises(WeightsError) as err:
        load_rank_weights(path, make_cfg(**{field: value}), 0)
    assert f"{field}={have}" in str(err.value) and f"{field}={value}" in str(err.value)


def test_bad_rank_and_naming(tmp_path):
    cfg = make_cfg(R=2)
    path = tmp_path / "ckpt.safetensors"
    write_synthetic_checkpoint(path, cfg, SEED)
    for rank in (-1, 2):
        with pytest.raises(ConfigError, match="rank"):
            load_rank_weights(path, cfg, rank)
        with pytest.raises(ConfigError, match="rank"):
            synthetic_rank_weights(cfg, rank, SEED)
    with pytest.raises(ConfigError, match="naming"):
        write_synthetic_checkpoint(tmp_path / "x.safetensors", cfg, SEED, naming="llama")


def test_whole_model_file_suggests_first_layer_and_quotes_expert_keys(tmp_path):
    cfg = make_cfg(E=2)
    tensors = {"model.embed_tokens.weight": torch.zeros(3, H), "lm_head.weight": torch.zeros(3, H)}
    for layer in (0, 1, 10):
        tensors.update(hf_tensors(cfg, prefix=f"model.layers.{layer}.mlp."))
        tensors[f"model.layers.{layer}.mlp.shared_experts.0.gate_proj.weight"] = torch.zeros(I, H)
    path = save(tmp_path / "model.safetensors", tensors)
    with pytest.raises(WeightsError) as err:
        inspect_checkpoint(path)
    msg = str(err.value)
    assert "did you mean prefix='model.layers.0.mlp.'" in msg
    assert "model.layers.0.mlp.experts.0.down_proj.weight" in msg and "embed_tokens" not in msg
    assert inspect_checkpoint(path, "model.layers.10.mlp.") == (2, H, I)
