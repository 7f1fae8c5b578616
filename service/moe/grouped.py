"""Grouped GEMM over the gathered layout: rows grouped by expert, one weight matrix per expert.

    out[rows of e] = a[rows of e] @ b[e]      a [S, Kd], b [E, Kd, N], out [S, N]

Expert e owns rows [offsets[e], offsets[e+1]) (service.moe.tables). Rows past offsets[E] are
not computed and hold no defined value; nothing downstream reads them.

Two implementations:
- `torch._grouped_mm` (CUTLASS grouped GEMM) on CUDA devices of compute capability 9.x/10.x
  with bf16 operands: one launch, offsets stay on the device (no host sync).
- a per-expert `torch.mm` loop everywhere else (CPU, other GPUs, fp32/fp16). It reads the
  offsets on the host, which syncs on CUDA; on the CPU that costs nothing. The serial layer
  hands it the hits alone, packed (`pack_hits`, built from the routing instead of the padded
  layout), so it computes no padding row: a step's cost then follows its tokens. On the CPU,
  where this torch's `_grouped_mm` takes the shape (`host_grouped_mm_reason`), `grouped_mm_host`
  runs the same loop in one call of it: E matmuls without E trips through Python.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

log = logging.getLogger(__name__)


@functools.cache
def native_grouped_mm_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when `torch._grouped_mm` serves this device and dtype, else why not (logged once)."""
    if not hasattr(torch, "_grouped_mm"):
        reason = "this torch has no torch._grouped_mm"
    elif device.type != "cuda":
        reason = f"device {device.type} is not CUDA"
    elif dtype != torch.bfloat16:
        reason = f"dtype {dtype} is not bfloat16"
    elif torch.cuda.get_device_capability(device)[0] not in (9, 10):
        reason = f"compute capability {torch.cuda.get_device_capability(device)} is not 9.x/10.x"
    else:
        return None
    log.info("grouped GEMM: per-expert loop (%s)", reason)
    return reason


def prepare_weight(b: torch.Tensor) -> torch.Tensor:
    """Lay out per-expert weights `[E, Kd, N]` the way `grouped_mm` reads them fastest.

    CUTLASS wants the reduction dimension contiguous in `b` (column-major per expert), so on
    the native path the weight is stored as `[E, N, Kd]` and handed over transposed (a view).
    """
    if native_grouped_mm_reason(b.device, b.dtype) is None:
        return b.transpose(1, 2).contiguous().transpose(1, 2)  # [E, Kd, N], strides (N*Kd, 1, Kd)
    return b.contiguous()


@dataclasses.dataclass(frozen=True)
class PackedHits:
    """The per-expert loop's schedule: a step's real hits alone, sorted by expert (stable, so within
    an expert by (token, k)), no padding row. M real hits, N tokens (R*C), K top-k, E experts."""

    offsets: torch.Tensor  # [E+1] int64 on the host: expert e's packed rows [offsets[e], offsets[e+1])
    tokens: torch.Tensor   # [M] int64 global token of each packed row
    experts: torch.Tensor  # [M] int64 expert of each packed row
    slots: torch.Tensor    # [N, K] int64 packed row of hit (g, k); -1 for padding tokens


def pack_hits(ids: torch.Tensor, counts: torch.Tensor, E: int, C: int) -> PackedHits:
    """ids [N, K] (N = R*C: R blocks of C tokens, the first counts[r] of block r real) -> PackedHits.
    A dozen ops over the real hits (the padded layout of service.moe.tables costs ~25 over every
    row of the capacity; each op costs the CPU ranks 3-10 us however few its rows): one block (the
    CPU ranks' step, counts [T]) takes its first T rows as they are, the offsets come from the
    sorted experts by one searchsorted. Reads the id range on the host. Real ids outside [0, E)
    raise (the front end refuses them first)."""
    N, K = ids.shape
    dev = ids.device
    if counts.numel() == 1:  # one block: its real tokens are the first counts[0]
        real = None
        expert = ids[:int(counts[0])].reshape(-1).to(torch.int64)                   # [n*K]
    else:
        g = torch.arange(N, device=dev)                                              # [N]
        real = torch.nonzero((g % C) < counts.to(dev, torch.int64)[g // C]).squeeze(1)  # [n] real tokens
        expert = ids[real].to(torch.int64).reshape(-1)                               # [n*K]
    experts, hit = torch.sort(expert, stable=True)                                   # [n*K] by expert
    if experts.numel():  # before the offsets, which assume ids in [0, E)
        lo, hi = int(experts[0]), int(experts[-1])
        if lo < 0 or hi >= E:
            raise ValueError(f"expert ids must lie in [0, {E}), got {lo if lo < 0 else hi}")
    offsets = torch.searchsorted(experts, torch.arange(E + 1, device=dev)).cpu()    # [E+1] first row >= e
    packed = torch.empty_like(hit).scatter_(0, hit, torch.arange(hit.numel(), device=dev))  # [n*K] row of hit
    slots = torch.full((N, K), -1, dtype=torch.int64, device=dev)                    # [N, K]
    tokens = hit // K                                                                # [n*K] real token index
    if real is None:
        slots[:tokens.numel() // K] = packed.view(-1, K)
    else:
        slots[real] = packed.view(-1, K)
        tokens = real[tokens]
    return PackedHits(offsets=offsets, tokens=tokens, experts=experts, slots=slots)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`a [S, Kd]` times `b [E, Kd, N]` per expert row range; `offsets [E+1]` int -> `[S, N]`."""
    assert a.dim() == 2 and b.dim() == 3 and a.shape[1] == b.shape[1], (a.shape, b.shape)
    assert offsets.numel() == b.shape[0] + 1, (offsets.shape, b.shape)
    if native_grouped_mm_reason(a.device, a.dtype) is None:
        # offs are the cumulative row ends of the E groups; rows past offs[-1] are left alone.
        return torch._grouped_mm(a, b, offs=offsets[1:].to(torch.int32))
    return grouped_mm_loop(a, b, offsets)


@functools.cache
def host_grouped_mm_reason(dtype: torch.dtype, Kd: int, N: int) -> str | None:
    """None when `torch._grouped_mm` computes `[M, Kd] @ [E, Kd, N]` per expert on the CPU in this
    dtype, else why not (logged once). Torch 2.9+ has a CPU implementation; it wants every row
    stride a multiple of 16 bytes. Tried once on a tiny input against `torch.mm` (an empty expert
    between two with rows), so a torch whose version refuses or differs is found at start."""
    size = torch.empty((), dtype=dtype).element_size()
    if not hasattr(torch, "_grouped_mm"):
        reason = "this torch has no torch._grouped_mm"
    elif (Kd * size) % 16 or (N * size) % 16:
        reason = f"rows of {Kd} and {N} {dtype} elements are not multiples of 16 bytes"
    else:
        reason = None
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(3, Kd, generator=gen).to(dtype)     # rows: 2 of expert 0, 1 of expert 2
        b = torch.randn(3, Kd, N, generator=gen).to(dtype)  # [E=3, Kd, N]
        try:
            got = torch._grouped_mm(a, b, offs=torch.tensor([2, 2, 3], dtype=torch.int32))
        except (RuntimeError, NotImplementedError) as exc:
            reason = f"torch._grouped_mm refused the CPU ({exc})"
        else:
            want = torch.cat([a[:2] @ b[0], a[2:] @ b[2]])
            if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
                reason = "torch._grouped_mm on the CPU did not match torch.mm"
    if reason:
        log.info("CPU grouped GEMM: per-expert loop (%s)", reason)
    return reason


HOST_NATIVE_MAX_BYTES = 256 << 10  # grouped_mm_host's native call: results up to this size


def grouped_mm_host(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """`grouped_mm_loop`'s product, from one call of `torch._grouped_mm` on the CPU where it takes
    the shape and its result is small (it allocates that result; `out` is for the loop). The loop's
    E trips through Python are a fair share of a small step (the CPU default's rank shapes, both
    GEMMs, one thread: T=8 0.51 -> 0.41 ms, T=64 0.85x) and nothing of a large one (T=512: 0.99x),
    where the loop writes into the step's kept buffers instead of a fresh block of megabytes a step.
    Offsets must end at a.shape[0] (the packed hits do): the native call does not check them."""
    small = a.shape[0] * b.shape[2] * a.element_size() <= HOST_NATIVE_MAX_BYTES
    if (a.device.type == "cpu" and small and a.is_contiguous()  # (the reason's 16-byte rows are a's too)
            and host_grouped_mm_reason(a.dtype, b.shape[1], b.shape[2]) is None):
        assert int(offsets[-1]) == a.shape[0] and b.is_contiguous(), (offsets[-1], a.shape, b.stride())
        return torch._grouped_mm(a, b, offs=offsets[1:].to(torch.int32))
    return grouped_mm_loop(a, b, offsets, out)


def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The portable fallback: one `mm` per expert with rows (rows past offsets[E] are left
    undefined), into `out` [S, N] when given (a buffer reused across steps)."""
    if out is None:
        out = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)  # [S, N]
    assert out.shape == (a.shape[0], b.shape[2]) and out.is_contiguous(), (out.shape, a.shape, b.shape)
    bounds = offsets.tolist()
    for e in range(b.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            torch.mm(a[lo:hi], b[e], out=out[lo:hi])
    return out
