"""Expert weights: the tensor-parallel slice each rank holds, from a checkpoint or from a seed.

Dimension letters: E experts, H hidden, I total intermediate, R ranks, Ir = I / R.

Checkpoint layout (Hugging Face per-expert naming, `nn.Linear` convention `[out, in]`):

    {prefix}experts.{e}.gate_proj.weight  [I, H]     Mixtral alias: {prefix}experts.{e}.w1.weight
    {prefix}experts.{e}.up_proj.weight    [I, H]                    {prefix}experts.{e}.w3.weight
    {prefix}experts.{e}.down_proj.weight  [H, I]                    {prefix}experts.{e}.w2.weight

Rank r of R holds, for every expert e (gate columns first, then up columns):

    w13[e] = cat(gate[r*Ir:(r+1)*Ir, :].T, up[r*Ir:(r+1)*Ir, :].T, dim=1)   # [H, 2*Ir]
    w2[e]  = down[:, r*Ir:(r+1)*Ir].T                                      # [Ir, H]

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

import collections
import hashlib
import math
import os
import re
from dataclasses import dataclass
from typing import Literal

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from service.config import LayerConfig
from service.errors import ConfigError, WeightsError

Tensor = torch.Tensor

# Rows of I drawn from one generator. 64 rows x H columns is large enough that the per-draw
# overhead vanishes, small enough that a rank's slice overshoots its range by at most 2 blocks.
SYNTH_ROW_BLOCK = 64

# Role -> tensor name in each naming. Roles are also the synthetic matrix ids (0, 1, 2).
ROLES = ("gate", "up", "down")
NAMINGS: dict[str, dict[str, str]] = {
    "hf": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    "mixtral": {"gate": "w1", "up": "w3", "down": "w2"},
}
_NAME_TO_NAMING = {name: naming for naming, names in NAMINGS.items() for name in names.values()}

# safetensors dtype strings this loader accepts (cast to cfg.dtype on load). Quantized formats
# (F8_*, integers) need scales and are refused rather than silently cast.
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")

_EXPERT_KEY = re.compile(r"^(?P<prefix>.*?)experts\.(?P<e>\d+)\.(?P<name>[^.]+)\.weight$")
_EXAMPLES = 5  # keys quoted in an error message


@dataclass
class RankWeights:
    """The tensor-parallel slice of every expert that one rank holds."""

    w13: Tensor  # [E, H, 2*Ir] columns [:Ir] = gate rows r*Ir..(r+1)*Ir transposed, [Ir:] = up rows
    w2: Tensor  # [E, Ir, H]    down_proj[:, r*Ir:(r+1)*Ir] transposed


# --------------------------------------------------------------------------- checkpoint reading


def expert_key(prefix: str, e: int, role: str, naming: str = "hf") -> str:
    return f"{prefix}experts.{e}.{NAMINGS[naming][role]}.weight"


def _expected_shape(role: str, H: int, I: int) -> tuple[int, int]:  # noqa: E741
    return (H, I) if role == "down" else (I, H)


def _open(path: str | os.PathLike):
    """Open a safetensors file lazily (header only); every failure becomes a WeightsError."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise WeightsError(f"checkpoint {path!r} does not exist or is not a file")
    try:
        return safe_open(path, framework="pt", device="cpu")
    except (OSError, SafetensorError) as exc:
        raise WeightsError(f"checkpoint {path!r} is not a readable safetensors file: {exc}") from exc


def _suggest_prefixes(keys: list[str]) -> list[str]:
    # Sorted, so that among equally common prefixes (one per layer) the first layer comes first.
    found = collections.Counter(m["prefix"] for k in sorted(keys)
                                if (m := _EXPERT_KEY.match(k)) and m["name"] in _NAME_TO_NAMING)
    return [p for p, _ in found.most_common(3)]


def _detect_naming(path: str, keys: list[str], prefix: str) -> tuple[str, dict[int, dict[str, str]]]:
    """Naming of the expert keys under `prefix` and, per expert, role -> key."""
    under = [k for k in keys if k.startswith(prefix + "experts.")]
    experts: dict[int, dict[str, str]] = collections.defaultdict(dict)
    namings: dict[str, str] = {}  # naming -> one key that uses it
    unknown: list[str] = []
    for key in under:
        m = _EXPERT_KEY.match(key[len(prefix):])
        naming = _NAME_TO_NAMING.get(m["name"]) if m and not m["prefix"] else None
        if naming is None:
            unknown.append(key)
            continue
        namings.setdefault(naming, key)
        role = next(r for r, n in NAMINGS[naming].items() if n == m["name"])
        experts[int(m["e"])][role] = key
    if not namings:
        hint = ""
        suggestions = [p for p in _suggest_prefixes(keys) if p != prefix]
        if suggestions:
            hint = f"; did you mean prefix={suggestions[0]!r}?" + (
                f" (other candidates: {suggestions[1:]})" if len(suggestions) > 1 else "")
        # Quote expert-looking keys first: a whole-model file starts with embeddings and norms.
        examples = sorted(k for k in keys if _EXPERT_KEY.match(k)) or sorted(keys)
        what = (f"unknown expert tensor names under it (e.g. {unknown[:_EXAMPLES]})" if unknown
                else f"no '{prefix}experts.<e>.<name>.weight' keys")
        raise WeightsError(
            f"checkpoint {path!r} has {what} for prefix={prefix!r}; expected HF names "
            f"{sorted(NAMINGS['hf'].values())} or Mixtral names {sorted(NAMINGS['mixtral'].values())}. "
            f"Keys found: {examples[:_EXAMPLES]}{' ...' if len(examples) > _EXAMPLES else ''}{hint}")
    if len(namings) > 1:
        raise WeightsError(
            f"checkpoint {path!r} mixes expert namings under prefix={prefix!r}: "
            + ", ".join(f"{n} (e.g. {k!r})" for n, k in sorted(namings.items())))
    return next(iter(namings)), experts


def _inspect(f, path: str, prefix: str) -> tuple[str, int, int, int]:
    """(naming, E, H, I) of an open checkpoint; checks every expert key, shape and dtype."""
    naming, experts = _detect_naming(path, list(f.keys()), prefix)
    E = max(experts) + 1
    gate0 = expert_key(prefix, 0, "gate", naming)
    if "gate" not in experts.get(0, {}):
        raise WeightsError(f"checkpoint {path!r} is missing key {gate0!r} (shape [I, H]); "
                           f"E, H and I are read from it")
    shape0 = tuple(f.get_slice(gate0).get_shape())
    if len(shape0) != 2:
        raise WeightsError(f"key {gate0!r} in {path!r} has shape {list(shape0)}, expected a 2-D [I, H]")
    I, H = shape0  # noqa: E741
    for e in range(E):
        for role in ROLES:
            key = expert_key(prefix, e, role, naming)
            want = list(_expected_shape(role, H, I))
            if role not in experts.get(e, {}):
                raise WeightsError(f"checkpoint {path!r} is missing key {key!r} (expected shape {want}; "
                                   f"E={E} from the highest expert index, H={H}, I={I} from {gate0!r})")
            sl = f.get_slice(key)
            shape, dtype = list(sl.get_shape()), sl.get_dtype()
            if shape != want:
                raise WeightsError(f"key {key!r} in {path!r} has shape {shape}, expected {want} "
                                   f"(H={H}, I={I} from {gate0!r})")
            if dtype not in _FLOAT_DTYPES:
                raise WeightsError(f"key {key!r} in {path!r} has dtype {dtype}, expected a float dtype "
                                   f"({', '.join(_FLOAT_DTYPES)})")
    return naming, E, H, I


def inspect_checkpoint(path: str | os.PathLike, prefix: str = "") -> tuple[int, int, int]:
    """(E, H, I) of a checkpoint, read from its header only; raises WeightsError if malformed."""
    with _open(path) as f:
        _, E, H, I = _inspect(f, os.fspath(path), prefix)  # noqa: E741
    return E, H, I


def _check_rank(cfg: LayerConfig, rank: int) -> None:
    if not 0 <= rank < cfg.R:
        raise ConfigError(f"rank must be in [0, R={cfg.R}), got {rank}")


def load_rank_weights(path: str | os.PathLike, cfg: LayerConfig, rank: int, prefix: str = "",
                      device: str | torch.device = "cpu") -> RankWeights:
    """Rank `rank`'s slice of every expert, read slice by slice, cast to cfg.dtype on `device`."""
    _check_rank(cfg, rank)
    path = os.fspath(path)
    Ir, r0 = cfg.Ir, rank * cfg.Ir
    w13 = torch.empty(cfg.E, cfg.H, 2 * Ir, dtype=cfg.dtype, device=device)  # [E, H, 2*Ir]
    w2 = torch.empty(cfg.E, Ir, cfg.H, dtype=cfg.dtype, device=device)  # [E, Ir, H]
    with _open(path) as f:
        naming, E, H, I = _inspect(f, path, prefix)  # noqa: E741
        for field, have, want in (("E", E, cfg.E), ("H", H, cfg.H), ("I", I, cfg.I)):
            if have != want:
                raise WeightsError(f"checkpoint {path!r} (prefix={prefix!r}) has {field}={have}, "
                                   f"but the layer config has {field}={want}")
        for e in range(E):
            # Slices arrive in the file's dtype on the CPU; cast and transpose happen on `device`.
            gate = f.get_slice(expert_key(prefix, e, "gate", naming))[r0:r0 + Ir].to(device)  # [Ir, H]
            up = f.get_slice(expert_key(prefix, e, "up", naming))[r0:r0 + Ir].to(device)  # [Ir, H]
            down = f.get_slice(expert_key(prefix, e, "down", naming))[:, r0:r0 + Ir].to(device)  # [H, Ir]
            w13[e, :, :Ir].copy_(gate.T)
            w13[e, :, Ir:].copy_(up.T)
            w2[e].copy_(down.T)
    return RankWeights(w13=w13, w2=w2)


def load_expert(path: str | os.PathLike, cfg: LayerConfig, e: int, prefix: str = "") -> tuple[Tensor, Tensor, Tensor]:
    """Expert e's full (gate [I, H], up [I, H], down [H, I]) in fp32, values rounded to cfg.dtype as
    the ranks hold them: the checkpoint's counterpart of `synthetic_expert` (warm-up check)."""
    path = os.fspath(path)
    with _open(path) as f:
        naming, _, _, _ = _inspect(f, path, prefix)
        gate, up, down = (f.get_tensor(expert_key(prefix, e, role, naming)).to(cfg.dtype).float() for role in ROLES)
    return gate, up, down


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
    b0, b1 = r0 // SYNTH_ROW_BLOCK, -(-r1 // SYNTH_ROW_BLOCK)
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
    scratch = torch.empty((-(-Ir // SYNTH_ROW_BLOCK) + 1) * SYNTH_ROW_BLOCK, cfg.H)  # [rows, H] fp32
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
        for role, value in zip(ROLES, synthetic_expert(cfg, seed, e)):
            tensors[expert_key(prefix, e, role, naming)] = value.to(cfg.dtype)
    save_file(tensors, os.fspath(path), metadata={"format": "pt"})


__all__ = [
    "NAMINGS", "RankWeights", "SYNTH_ROW_BLOCK", "expert_key", "inspect_checkpoint",
    "load_rank_weights", "synthetic_expert", "synthetic_rank_weights", "write_synthetic_checkpoint",
]
