"""Expert weights: the tensor-parallel slice each rank holds, from a checkpoint or from a seed.

Dimension letters: E experts, H hidden, I total intermediate, R ranks, Ir = I / R.

Checkpoints (service.moe.checkpoint reads the file, index or model directory and detects the
layout: per-expert HF / Mixtral tensors or fused 3-D ones, in `nn.Linear` convention `[out, in]`).
Rank r of R holds, for every expert e (gate columns first, then up columns):

    w13[e] = cat(gate[r*Ir:(r+1)*Ir, :].T, up[r*Ir:(r+1)*Ir, :].T, dim=1)   # [H, 2*Ir]
    w2[e]  = down[:, r*Ir:(r+1)*Ir].T                                      # [Ir, H]
    b13[e] = cat(gate_bias[r*Ir:(r+1)*Ir], up_bias[r*Ir:(r+1)*Ir])        # [2*Ir]  (biased layouts)
    b2[e]  = down_bias on rank 0, absent elsewhere                         # [H]

Loading reads only that slice: every tensor goes through `safe_open(...).get_slice(key)[...]`
(the file is memory-mapped, so a rank touches about 1/R of the bytes); `get_tensor` is never
called.

Synthetic weights are a pure function of (seed, expert, matrix, row block): gate, up and down^T
are all `[I, H]` matrices split along I, so they are drawn in blocks of `SYNTH_ROW_BLOCK` rows
of I, each block from its own CPU generator seeded by a hash of (seed, e, matrix, block).
A rank then draws only the blocks that cover its slice (about 1/R of the work) and gets values
identical to the full matrices of `synthetic_expert`, whatever R, the rank or the device.
One generator per expert would force every rank to draw all 3*E*I*H values: about 28 s of CPU
per rank for the seed shape on a 2-core machine, against about 7 s per rank this way (R = 4).
The draws are always made on the CPU, so the values do not depend on the device either; they
are reproducible for a given torch version (write_synthetic_checkpoint pins them in a file).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import dataclass
from typing import Literal

import torch
from safetensors.torch import save_file

from service.config import LayerConfig, cdiv
from service.errors import ConfigError, WeightsError
from service.moe.checkpoint import (
    NAMINGS,
    LayerSpec,
    Shards,
    expert_key,
    inspect_layer,
    read_rank_slice,
    read_spec,
)

log = logging.getLogger(__name__)

Tensor = torch.Tensor
# One expert whole in fp32: gate [I, H], up [I, H], down [H, I], biases (gate [I], up [I], down [H]) or None.
ExpertWeights = tuple[Tensor, Tensor, Tensor, "tuple[Tensor, Tensor, Tensor] | None"]

# Rows of I drawn from one generator. 64 rows x H columns is large enough that the per-draw
# overhead vanishes, small enough that a rank's slice overshoots its range by at most 2 blocks.
SYNTH_ROW_BLOCK = 64

# Roles are also the synthetic matrix ids (0, 1, 2).
ROLES = ("gate", "up", "down")


@dataclass
class RankWeights:
    """The tensor-parallel slice of every expert that one rank holds."""

    w13: Tensor  # [E, H, 2*Ir] columns [:Ir] = gate rows r*Ir..(r+1)*Ir transposed, [Ir:] = up rows
    w2: Tensor  # [E, Ir, H]    down_proj[:, r*Ir:(r+1)*Ir] transposed
    b13: Tensor | None = None  # [E, 2*Ir] gate bias slice, then up bias slice (layouts with biases)
    b2: Tensor | None = None  # [E, H] down bias: rank 0 only (the ranks' partial sums add up to one copy)


# --------------------------------------------------------------------------- checkpoint reading


def inspect_checkpoint(path: str | os.PathLike, prefix: str = "") -> tuple[int, int, int]:
    """(E, H, I) of a checkpoint, read from its header only; raises WeightsError if malformed."""
    spec = inspect_layer(path, prefix)
    return spec.E, spec.H, spec.I


def checkpoint_layer(cfg: LayerConfig, path: str | os.PathLike, *, prefix: str = "", layer: int | None = None,
                     top_k: int | None = None, default_k: int | None = None) -> tuple[LayerConfig, LayerSpec]:
    """The layer config that serves the checkpoint's experts block: E, H, I, the activation and
    biases from the checkpoint; K from its config.json, else `top_k`, else `default_k`, else cfg's
    (the preset's).
    A `top_k` that contradicts config.json is an error naming both. Logs what stays with the client."""
    spec = inspect_layer(path, prefix, layer)
    if top_k is not None and spec.K is not None and top_k != spec.K:
        raise ConfigError(f"--top-k/MOE_TOP_K={top_k} contradicts num_experts_per_tok={spec.K} in the config.json "
                          f"of {spec.path!r}; leave --top-k unset for a model directory")
    K = spec.K or top_k or default_k or cfg.K
    if K > spec.E:
        raise ConfigError(f"K (top-k = {K}{'' if spec.K or top_k or default_k else ', the preset default'}) "
                          f"exceeds the checkpoint's {spec.E} experts; set --top-k")
    where = f"layer {spec.layer}" if spec.layer is not None else "the file"
    log.info("weights %s: %s experts at prefix %r (%s, %s, %s), K=%d%s", spec.path, where, spec.prefix, spec.layout,
             spec.dtype, spec.act.describe(), K, " from config.json" if spec.K else "")
    for note in spec.notes:
        log.warning("%s", note)
    if spec.I % cfg.R:  # R comes from --world-size or the preset, I from the checkpoint: say which is which
        fits = [r for r in range(1, min(spec.I, 8) + 1) if spec.I % r == 0]
        raise ConfigError(f"the checkpoint's expert intermediate size I={spec.I} ({where} of {spec.path!r}) does not "
                          f"split over R={cfg.R} ranks (--world-size; default the preset's, capped by the GPUs or "
                          f"CPU cores); each rank holds I/R columns: set --world-size to a divisor of {spec.I} "
                          f"({', '.join(map(str, fits))}, ...)")
    return cfg.replace(E=spec.E, H=spec.H, I=spec.I, K=K, act=spec.act, bias=spec.bias), spec


def _check_rank(cfg: LayerConfig, rank: int) -> None:
    if not 0 <= rank < cfg.R:
        raise ConfigError(f"rank must be in [0, R={cfg.R}), got {rank}")


def load_rank_weights(path: str | os.PathLike, cfg: LayerConfig, rank: int, prefix: str = "",
                      device: str | torch.device = "cpu") -> RankWeights:
    """Rank `rank`'s slice of every expert of the block at `prefix` (a file, an index or a model
    directory: service.moe.checkpoint), read slice by slice, cast to cfg.dtype on `device`."""
    _check_rank(cfg, rank)
    Ir, r0 = cfg.Ir, rank * cfg.Ir
    with Shards(path) as sh:
        spec = read_spec(sh, prefix)
        for field, have, want in (("E", spec.E, cfg.E), ("H", spec.H, cfg.H), ("I", spec.I, cfg.I),
                                  ("biases", spec.bias, cfg.bias), ("activation", spec.act, cfg.act)):
            if have != want:
                raise WeightsError(f"checkpoint {spec.path!r} (prefix={spec.prefix!r}) has {field}={have}, "
                                   f"but the layer config has {field}={want}")
        w13 = torch.empty(cfg.E, cfg.H, 2 * Ir, dtype=cfg.dtype, device=device)  # [E, H, 2*Ir]
        w2 = torch.empty(cfg.E, Ir, cfg.H, dtype=cfg.dtype, device=device)  # [E, Ir, H]
        b13 = torch.zeros(cfg.E, 2 * Ir, dtype=cfg.dtype, device=device) if cfg.bias else None  # [E, 2*Ir]
        b2 = torch.zeros(cfg.E, cfg.H, dtype=cfg.dtype, device=device) if cfg.bias and rank == 0 else None  # [E, H]
        for es, gate, up, down_t, bias13, bias2 in read_rank_slice(sh, spec, r0, Ir):
            # Slices arrive in the file's dtype on the CPU (FP8 already dequantized to fp32);
            # cast and transpose happen on `device`.
            w13[es, :, :Ir].copy_(gate.to(device).transpose(1, 2))  # [n, H, Ir]
            w13[es, :, Ir:].copy_(up.to(device).transpose(1, 2))
            w2[es].copy_(down_t.to(device))  # [n, Ir, H]
            if b13 is not None:
                b13[es].copy_(bias13.to(device))
            if b2 is not None:
                b2[es].copy_(bias2.to(device))
            parts = (("gate", w13[es, :, :Ir], gate), ("up", w13[es, :, Ir:], up), ("down", w2[es], down_t),
                     ("gate/up bias", b13[es] if b13 is not None else None, bias13),
                     ("down bias", b2[es] if b2 is not None else None, bias2))
            for role, held, read in parts:
                _check_finite(spec, cfg, rank, es.start, role, held, read)
    return RankWeights(w13=w13, w2=w2, b13=b13, b2=b2)


def _check_finite(spec: LayerSpec, cfg: LayerConfig, rank: int, e: int, role: str, held: Tensor | None,
                  read: Tensor | None) -> None:
    """A NaN or infinity in a weight, or a finite one that the cast to cfg.dtype turned into an infinity
    (fp32 / bf16 values past float16's 65504), would make every answer that uses the expert non-finite:
    refused at load, naming the expert."""
    if held is None or read is None or bool(torch.isfinite(held).all()):
        return
    where = f"expert {e}'s {role} in {spec.path!r} (prefix={spec.prefix!r}, rank {rank}'s slice)"
    read = read.float()
    if bool(torch.isfinite(read).all()):
        big = float(read.abs().max())
        raise WeightsError(f"{where} holds values up to {big:g}, beyond the range of {cfg.dtype} the layer "
                           f"computes in; serve it in bfloat16 or float32 (--dtype)")
    raise WeightsError(f"{where} holds NaN or infinity")


def load_expert(path: str | os.PathLike, cfg: LayerConfig, e: int, prefix: str = "") -> ExpertWeights:
    """Expert e whole, in fp32 with values rounded to cfg.dtype as the ranks hold them: (gate [I, H],
    up [I, H], down [H, I], biases (gate [I], up [I], down [H]) or None). The checkpoint's
    counterpart of `synthetic_expert` (the warm-up's independent reference)."""
    def rounded(t: Tensor) -> Tensor:
        return t.to(cfg.dtype).float()

    with Shards(path) as sh:
        spec = read_spec(sh, prefix)
        ((_, gate, up, down_t, b13, b2),) = read_rank_slice(sh, spec, 0, spec.I, experts=[e])
    biases = None
    if b13 is not None:
        biases = (rounded(b13[0, :spec.I]), rounded(b13[0, spec.I:]), rounded(b2[0]))
    return rounded(gate[0]), rounded(up[0]), rounded(down_t[0].T), biases


# --------------------------------------------------------------------------- synthetic weights


def _block_seed(seed: int, e: int, matrix: int, block: int) -> int:
    """A stable 63-bit generator seed for one row block (Python's hash() is not stable for str)."""
    digest = hashlib.blake2b(f"moe-synth/{seed}/{e}/{matrix}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _draw_rows(cfg: LayerConfig, seed: int, e: int, role: str, r0: int, r1: int,
               scratch: Tensor | None = None) -> Tensor:
    """Rows [r0, r1) of expert e's gate, up or down^T (all [I, H]) in fp32, not yet rounded.

    Draws the whole row blocks that cover the range into `scratch` (allocated if None, reused
    by the caller to avoid fresh pages per draw); the result is a view of it.
    """
    matrix = ROLES.index(role)
    scale = 1.0 / math.sqrt(cfg.I if role == "down" else cfg.H)  # 1/sqrt(fan_in): O(1) activations
    b0, b1 = r0 // SYNTH_ROW_BLOCK, cdiv(r1, SYNTH_ROW_BLOCK)
    first, last = b0 * SYNTH_ROW_BLOCK, min(b1 * SYNTH_ROW_BLOCK, cfg.I)  # rows drawn
    if scratch is None:
        scratch = torch.empty(last - first, cfg.H)  # [rows, H]
    assert scratch.shape[0] >= last - first and scratch.shape[1] == cfg.H and scratch.is_contiguous()
    g = torch.Generator()
    for b in range(b0, b1):
        lo, hi = b * SYNTH_ROW_BLOCK - first, min((b + 1) * SYNTH_ROW_BLOCK, cfg.I) - first
        g.manual_seed(_block_seed(seed, e, matrix, b))
        scratch[lo:hi].normal_(0.0, scale, generator=g)  # [hi-lo, H] one contiguous draw per block
    return scratch[r0 - first:r1 - first]  # [r1-r0, H]


def synthetic_expert(cfg: LayerConfig, seed: int, e: int) -> tuple[Tensor, Tensor, Tensor]:
    """Expert e's full (gate [I, H], up [I, H], down [H, I]) in fp32, values rounded to cfg.dtype."""
    gate = _draw_rows(cfg, seed, e, "gate", 0, cfg.I).to(cfg.dtype).float()  # [I, H]
    up = _draw_rows(cfg, seed, e, "up", 0, cfg.I).to(cfg.dtype).float()  # [I, H]
    down = _draw_rows(cfg, seed, e, "down", 0, cfg.I).to(cfg.dtype).float().T.contiguous()  # [H, I]
    return gate, up, down


def synthetic_rank_weights(cfg: LayerConfig, rank: int, seed: int,
                           device: str | torch.device = "cpu") -> RankWeights:
    """Rank `rank`'s slice of the synthetic experts: equal to slicing `synthetic_expert`, on any device.

    Draws only the row blocks that cover the slice, on the CPU (so values never depend on the
    device), one matrix at a time; the cast to cfg.dtype and the transpose happen on `device`.
    """
    _check_rank(cfg, rank)
    Ir, r0 = cfg.Ir, rank * cfg.Ir
    w13 = torch.empty(cfg.E, cfg.H, 2 * Ir, dtype=cfg.dtype, device=device)  # [E, H, 2*Ir]
    w2 = torch.empty(cfg.E, Ir, cfg.H, dtype=cfg.dtype, device=device)  # [E, Ir, H]
    scratch = torch.empty((cdiv(Ir, SYNTH_ROW_BLOCK) + 1) * SYNTH_ROW_BLOCK, cfg.H)  # [rows, H] fp32
    for e in range(cfg.E):
        # Casting fp32 straight to cfg.dtype rounds exactly as synthetic_expert's .to(cfg.dtype) does.
        gate = _draw_rows(cfg, seed, e, "gate", r0, r0 + Ir, scratch).to(device)  # [Ir, H]
        w13[e, :, :Ir].copy_(gate.T)
        up = _draw_rows(cfg, seed, e, "up", r0, r0 + Ir, scratch).to(device)  # [Ir, H]
        w13[e, :, Ir:].copy_(up.T)
        down_t = _draw_rows(cfg, seed, e, "down", r0, r0 + Ir, scratch).to(device)  # [Ir, H]
        w2[e].copy_(down_t)
    return RankWeights(w13=w13, w2=w2)


def write_synthetic_checkpoint(path: str | os.PathLike, cfg: LayerConfig, seed: int, prefix: str = "",
                               naming: Literal["hf", "mixtral"] = "hf") -> None:
    """Write all experts of `synthetic_expert` in cfg.dtype with the given naming and key prefix.

    Holds the whole checkpoint in memory (3 * E * I * H * itemsize bytes; 4.8 GB for the seed
    shape in bf16): `safetensors.torch.save_file` takes the full dict.
    """
    if naming not in NAMINGS:
        raise ConfigError(f"naming must be one of {sorted(NAMINGS)}, got {naming!r}")
    tensors = {}
    for e in range(cfg.E):
        for role, value in zip(ROLES, synthetic_expert(cfg, seed, e), strict=True):
            tensors[expert_key(prefix, e, role, naming)] = value.to(cfg.dtype)
    save_file(tensors, os.fspath(path), metadata={"format": "pt"})


__all__ = [
    "NAMINGS", "RankWeights", "SYNTH_ROW_BLOCK", "checkpoint_layer", "expert_key", "inspect_checkpoint",
    "load_rank_weights", "synthetic_expert", "synthetic_rank_weights", "write_synthetic_checkpoint",
]
