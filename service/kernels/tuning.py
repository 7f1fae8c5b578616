"""Tile configurations as data: one JSON file per device name, GEMM mode and layer shape.

    service/kernels/configs/<device>__<mode>__E<E>_H<H>_N<Ir>.json

`device` is `torch.cuda.get_device_name()` with spaces as underscores (vLLM's convention),
`mode` is `gemm1` (A [S,H] x W13 [E,H,2*Ir] + SwiGLU) or `gemm2` (act [S,Ir] x W2 [E,Ir,H]);
both modes of one layer share the key (E, H, Ir). A file holds configs keyed by M, the hit
count (rows before padding) the entry was tuned for; lookup takes the nearest key, as vLLM does.

    {"device": "NVIDIA_H200", "mode": "gemm1", "E": 64, "H": 4096, "N": 768,
     "triton_version": "3.6.0", "tuned": false, "source": "...",
     "configs": {"16384": {"BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4}}}

An entry may add `"w_desc": true`: the weights are then read through TMA tensor descriptors
(GemmConfig.w_desc); and `"split_tail": false`: every used row block runs a full BM-row tile
(GemmConfig.split_tail, on by default: tail blocks whose second half is padding run BM/2 rows);
`"ctas_per_sm": 2`: the serial GEMMs' persistent grid holds two programs per SM; `"queue": true`:
the programs take tiles from an atomic counter (GemmConfig.queue); `"pn_major": true`: an expert's
tiles in column-tile-major order (GemmConfig.pn_major); `"pair": true`: two full blocks of one expert
run one 2*BM x BN/2 tile (GemmConfig.pair); `"cuda_tile": true` (gemm1 files only): the serial GEMM1
runs the Hopper CUDA tile (GemmConfig.cuda_tile, service.kernels.cuda_tile), with `"cuda_variant":
"n256"` (or another of cuda_tile.VARIANTS) its mainloop variant (default "base").

`bench/tune_gemm.py` writes these files on a GPU. The request path only reads them (cached);
when no file matches, a default chosen by the device's shared memory is used and logged once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path

from service.kernels.grouped_gemm import GemmConfig

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs"
MODES = ("gemm1", "gemm2")

# Shared memory per block: sm_90 (H100/H200) allows 232448 B, sm_120 (consumer Blackwell)
# 101376 B. Defaults are the tiles that fit; sizes measured by tests/kernels/test_compile.py.
SMEM_LARGE = 232448
SMEM_SMALL = 101376
_DEFAULTS = {
    # 128 x (2 x 128) x 64, 4 stages: 196608 B on sm_90.
    ("large", "gemm1"): GemmConfig(BN=128, BK=64, num_warps=8, num_stages=4),
    # 128 x 256 x 64, 4 stages: 196608 B on sm_90 (the vLLM H100/H200 M>=1024 tile).
    ("large", "gemm2"): GemmConfig(BN=256, BK=64, num_warps=8, num_stages=4),
    # 128 x (2 x 64) x 64, 4 stages and 128 x 128 x 64, 4 stages: 87 KB, below 101376 B.
    ("small", "gemm1"): GemmConfig(BN=64, BK=64, num_warps=8, num_stages=4),
    ("small", "gemm2"): GemmConfig(BN=128, BK=64, num_warps=8, num_stages=4),
}


def tile_smem_bytes(config: GemmConfig, smem_per_block: int, *, swiglu: bool, itemsize: int = 2) -> int:
    """Shared memory of a grouped-GEMM kernel with this config: its pipelined buffers of the largest
    tile, A [TM, BK] + W [BK, TN] (GEMM1, swiglu: [BK, 2 * TN], gate + up), with TM x TN = BM x BN,
    or 2*BM x BN/2 for pair tiles. Triton 3.6 keeps num_stages buffers on sm_90 (wgmma: 196,608 B =
    4 x 48 KB at 128 x (2 x 128) x 64) and num_stages - 1 below it (sm_120: 98,304 B = 3 x 32 KB at
    128 x (2 x 64) x 64), as the compile-only check (tests/kernels/test_compile.py) measures."""
    w_cols = 2 if swiglu else 1
    per_stage = config.BM * config.BK + config.BK * w_cols * config.BN
    if config.pair:
        per_stage = max(per_stage, 2 * config.BM * config.BK + config.BK * w_cols * config.BN // 2)
    buffers = config.num_stages if smem_per_block >= SMEM_LARGE else config.num_stages - 1
    return buffers * per_stage * itemsize


def pair_config(config: GemmConfig, smem_per_block: int, *, swiglu: bool) -> GemmConfig:
    """The config with pair tiles on (GemmConfig.pair), with as many of its stages as still fit the
    device's shared memory: at sm_90's tiles a pair stage is the BM-row tile's 48 KB (all 4 stages
    stay); at sm_120's (GEMM1 BN = 64, GEMM2 BN = 128) a pair stage is 40 KB against 32 KB, so 4
    stages become 3."""
    out = dataclasses.replace(config, pair=True)  # (GemmConfig refuses pair with w_desc)
    while out.num_stages > 2 and tile_smem_bytes(out, smem_per_block, swiglu=swiglu) > smem_per_block:
        out = dataclasses.replace(out, num_stages=out.num_stages - 1)
    return out


def device_key(name: str) -> str:
    return name.replace(" ", "_")


def config_path(device: str, mode: str, E: int, H: int, N: int, directory: Path = CONFIG_DIR) -> Path:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return directory / f"{device_key(device)}__{mode}__E{E}_H{H}_N{N}.json"


def config_from_dict(entry: dict) -> GemmConfig:
    return GemmConfig(BN=int(entry["BN"]), BK=int(entry["BK"]),
                      num_warps=int(entry["num_warps"]), num_stages=int(entry["num_stages"]),
                      w_desc=bool(entry.get("w_desc", False)), split_tail=bool(entry.get("split_tail", True)),
                      ctas_per_sm=int(entry.get("ctas_per_sm", 1)), queue=bool(entry.get("queue", False)),
                      pn_major=bool(entry.get("pn_major", False)), pair=bool(entry.get("pair", False)),
                      cuda_tile=bool(entry.get("cuda_tile", False)),
                      cuda_variant=_variant(entry.get("cuda_variant", "base")))


def _variant(name) -> str:
    from service.kernels.cuda_tile import VARIANTS

    if name not in VARIANTS:
        raise ValueError(f"cuda_variant must be one of {VARIANTS}, got {name!r}")
    return name


def config_to_dict(config: GemmConfig) -> dict:
    out = {"BN": config.BN, "BK": config.BK, "num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.w_desc:
        out["w_desc"] = True
    if not config.split_tail:
        out["split_tail"] = False
    if config.ctas_per_sm != 1:
        out["ctas_per_sm"] = config.ctas_per_sm
    if config.queue:
        out["queue"] = True
    if config.pn_major:
        out["pn_major"] = True
    if config.pair:
        out["pair"] = True
    if config.cuda_tile:
        out["cuda_tile"] = True
    if config.cuda_variant != "base":
        out["cuda_variant"] = config.cuda_variant
    return out


@functools.cache
def _read(path: Path) -> dict[int, GemmConfig] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    configs = {int(m): config_from_dict(entry) for m, entry in data["configs"].items()}
    if not data.get("tuned", False):
        log.info("tile config %s is marked untuned (starting point, not measured on this device)", path.name)
    return configs


def default_config(mode: str, smem_per_block: int) -> GemmConfig:
    """The heuristic used when no file matches: the largest tile the shared memory allows."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return _DEFAULTS[("large" if smem_per_block >= SMEM_LARGE else "small", mode)]


@functools.cache
def _log_default(device: str, mode: str, E: int, H: int, N: int, config: GemmConfig) -> None:
    log.warning("no tile config for %s %s E=%d H=%d N=%d (looked for %s); using the default %s",
                device, mode, E, H, N, config_path(device, mode, E, H, N).name, config)


def lookup(device: str, mode: str, E: int, H: int, N: int, *, M: int | None = None,
           smem_per_block: int = SMEM_SMALL, directory: Path = CONFIG_DIR) -> GemmConfig:
    """The config for this device and shape: the file entry nearest to M (the largest key when M
    is None), else the default for the device's shared memory (logged once per key)."""
    configs = _read(config_path(device, mode, E, H, N, directory))
    if configs:
        key = max(configs) if M is None else min(configs, key=lambda m: (abs(m - M), m))
        return configs[key]
    config = default_config(mode, smem_per_block)
    _log_default(device_key(device), mode, E, H, N, config)
    return config


def smem_per_block(device) -> int:
    """Shared memory one block of a torch CUDA device may opt into (SMEM_SMALL if torch cannot say)."""
    import torch

    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", SMEM_SMALL)


def lookup_for_device(device, mode: str, E: int, H: int, N: int, *, M: int | None = None) -> GemmConfig:
    """lookup() with the name and shared memory of a torch CUDA device."""
    import torch

    return lookup(torch.cuda.get_device_properties(device).name, mode, E, H, N, M=M,
                  smem_per_block=smem_per_block(device))
