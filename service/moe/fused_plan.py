"""The fused backend's launch plan for a device (grids, roles, tiles) and whether the backend can run
there at all (the capability probe).

R ranks, E experts, H hidden, Ir = I / R; the Plan fields are documented in
service/kernels/fused_kernels.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from service.config import LayerConfig

if TYPE_CHECKING:  # the kernels import triton, which the probe must not need
    from service.kernels.fused_kernels import Plan


def default_plan(cfg: LayerConfig, device: torch.device, *, w_desc: bool | None = None, gemm: dict | None = None,
                 **overrides) -> Plan:
    """The plan for this layer on this device; `overrides` replace fields (benchmarks' sweeps).
    w_desc True / False reads both GEMMs' weights through TMA descriptors or not (None: as the
    tile configs say, GemmConfig.w_desc); `gemm` replaces GemmConfig fields in both GEMMs' tile
    configs (A/B runs: {"queue": True}, {"split_tail": False}, ...)."""
    import dataclasses

    from service.kernels.fused_kernels import Plan
    from service.kernels.grouped_gemm import num_sms
    from service.kernels.tuning import lookup_for_device

    sms = num_sms(device)
    # Pullers in kernel 1: none at R = 1 (every token is read in place); an eighth of the SMs
    # otherwise, for (R-1)/R * N * H * itemsize bytes (12 MB at the seed shape, R = 4). When
    # kernel 1 still copied every token to its K rows (8x the bytes), a sweep at R = 1 on an H200
    # found a quarter of the SMs best (bench/RESULTS.md); R > 1 awaits the 4-GPU run.
    comm = 0 if cfg.R == 1 else max(1, sms // 8)
    # Kernel 2: three quarters of the SMs run GEMM2, the rest take jobs from the start, and the
    # GEMM programs join them after their tiles (the split measured with the sweep above).
    plan = dict(num_programs=sms, num_comm1=comm, num_compute2=sms - max(1, sms // 4), join=True,
                config1=lookup_for_device(device, "gemm1", cfg.E, cfg.H, cfg.Ir),
                config2=lookup_for_device(device, "gemm2", cfg.E, cfg.H, cfg.Ir))
    plan.update(overrides)
    fields = dict(gemm or {}, **({} if w_desc is None else {"w_desc": w_desc}))
    if fields:
        plan.update(config1=dataclasses.replace(plan["config1"], **fields),
                    config2=dataclasses.replace(plan["config2"], **fields))
    return Plan(**plan)


def local_unavailable_reason(cfg: LayerConfig, device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"device {device.type} is not CUDA"
    if cfg.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {cfg.dtype} is not bf16/fp16"
    if cfg.H % 8 or cfg.Ir % 8:
        return f"H ({cfg.H}) and Ir ({cfg.Ir}) must be multiples of 8 (16-byte rows)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"compute capability {torch.cuda.get_device_capability(device)} < 8.0"
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"triton is not importable ({err})"
    if cfg.R > 1:
        try:
            import importlib

            importlib.import_module("torch.distributed._symmetric_memory")
        except ImportError as err:
            return f"no symmetric memory in this torch ({err})"
    return None


def fused_unavailable_reason(cfg: LayerConfig, device: torch.device, group=None) -> str | None:
    """None when the fused backend can run here, else why not. With R > 1 this is a collective over
    `group` (every rank must call it) and every rank gets the same verdict."""
    device = torch.device(device)
    reason = local_unavailable_reason(cfg, device)
    if cfg.R == 1:
        return reason
    if not dist.is_initialized():
        return reason or "no process group: peers cannot rendezvous"
    index = device.index if device.type == "cuda" and device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else -1)
    gathered: list = [None] * cfg.R
    dist.all_gather_object(gathered, (reason, index), group=group)
    for r, (why, _) in enumerate(gathered):
        if why:
            return f"rank {r}: {why}"
    indices = sorted({i for _, i in gathered})
    for a in indices:
        for b in indices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"GPU {a} has no peer access to GPU {b}"
    return None
