"""GEMM1 + SwiGLU on the Hopper CUDA tile (csrc/gemm_sm90), opt-in through GemmConfig.cuda_tile.

Same arguments and result as service.kernels.grouped_gemm.gemm1_swiglu (which dispatches here when
its config says cuda_tile), on sm_90 only:

    act[s] = silu(A[row_token[s]] @ W13[e][:, :Ir]) * (A[row_token[s]] @ W13[e][:, Ir:])

for the rows s of used row blocks (e = block_expert[s // BM] < E) whose row_token[s] >= 0. Rows with
row_token < 0 (padding) and rows of unused blocks are never written (the Triton tile writes a used
block's padding rows with values nobody reads; GEMM2 and the combine read real rows only). Without
row_token, A is the gathered layout itself and every row of a used block is written.

The tile (bench/NOTES.md "Issue 12c" has the design, floor and prediction): one persistent
384-thread CTA per SM; a producer warp group copies the gathered A rows with cp.async into the
128B-swizzled layout wgmma reads and has the weights' [64 x 64] boxes fetched by TMA; two consumer
warp groups run wgmma m64n128k16 on 64 rows each (gate and up accumulators, 128 fp32 registers per
thread), 4 stages of 48 KB; tiles of 128 rows x 128 output columns come from the tile queue in tile
order (as GemmConfig.queue); a tail block whose row 64 is padding runs on one consumer warp group.

Limits, refused with a ValueError / TypeError / RuntimeError before anything launches: bf16 only,
silu only (no clamp), no bias, H % 64 == 0, Ir % 128 == 0, contiguous tensors, an sm_90 device and
a library built with the tile (`python csrc/build.py` on a target list with 9.0). Entries of
row_token must lie in [-1, N): not checked (that would cost a sync), as in the Triton GEMM.
"""

from __future__ import annotations

import torch

from service.config import BM, Activation
from service.kernels.grouped_gemm import check_queue

# csrc/gemm_sm90/gemm1_sm90.h (tests/kernels/test_cuda_tile.py checks that they agree).
TILE_ROWS = 128   # kTileRows
TILE_COLS = 128   # kTileCols: output columns; the tile reads 2 x 128 weight columns (gate, up)
TILE_DEPTH = 64   # kTileDepth: K per stage
STAGES = 4        # kStages
THREADS = 384     # kThreads
# enum Gemm1Variant, in its order: the mainloop of one launch (gemm1_swiglu's `variant`). "base": two
# wgmma m64n128k16 per k16 step (gate, up), rows signalled 2 stages late after cp.async.wait_group;
# "n256": one m64n256k16 over gate and up (A read once); "noinc": n256 with the rows signalled by
# cp.async.mbarrier.arrive.noinc as they land; "mcast": noinc in 2-CTA clusters on two row blocks of
# one column tile, the weight boxes multicast to both when the blocks share an expert (static
# schedule; the queue is not used; an even grid of at most num_programs, >= 2 CTAs). Same results
# (same products, same K order).
VARIANTS = ("base", "n256", "noinc", "mcast")
SMEM_BYTES = STAGES * (TILE_ROWS * TILE_DEPTH + TILE_DEPTH * 2 * TILE_COLS) * 2  # 196,608 B of stages
OP = "gemm1_swiglu_sm90"


def device_reason(device: torch.device) -> str | None:
    """None when the tile can run on this device (sm_90, library built with the tile), else why not."""
    if device.type != "cuda":
        return f"the CUDA tile needs a CUDA device, got {device}"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] != 9:
        name = torch.cuda.get_device_name(device)
        return f"the CUDA tile is sm_90a code (wgmma, setmaxnreg): {name} is sm_{cap[0]}{cap[1]}"
    from service.kernels.schedule import LIBRARY_PATH, load

    ok, reason = load()
    if not ok:
        return f"the csrc library is not loaded: {reason}"
    if not hasattr(torch.ops.moe, OP):
        return (f"{LIBRARY_PATH} was built without the sm_90a tile (csrc/build.py builds it when 9.0 is among "
                f"the targets: python csrc/build.py --arch 9.0)")
    return None


def layer_reason(dtype: torch.dtype, act: Activation, bias: torch.Tensor | None, H: int, Ir: int) -> str | None:
    """None when the tile computes this layer's GEMM1, else why not (what it lacks)."""
    if dtype != torch.bfloat16:
        return f"the CUDA tile is bf16 only, got {dtype}"
    if act != Activation():
        return f"the CUDA tile's epilogue is silu(g) * u without a clamp, got {act}"
    if bias is not None:
        return "the CUDA tile has no bias"
    if H % TILE_DEPTH or Ir % TILE_COLS:
        return f"the CUDA tile needs H % {TILE_DEPTH} == 0 and Ir % {TILE_COLS} == 0, got H={H}, Ir={Ir}"
    return None


def check_args(a, w13, block_expert, out, row_token) -> tuple[int, int]:
    """Shapes, dtypes and layout of one call (metadata only). Returns (S, Ir); raises ValueError or
    TypeError with the reason."""
    if a.dim() != 2 or w13.dim() != 3 or w13.shape[2] % 2:
        raise ValueError(f"a must be [N, H] and w13 [E, H, 2*Ir], got {list(a.shape)} and {list(w13.shape)}")
    H, Ir = a.shape[1], w13.shape[2] // 2
    S = a.shape[0] if row_token is None else row_token.shape[0]
    if w13.shape[1] != H:
        raise ValueError(f"w13 has H={w13.shape[1]} rows per expert, a has H={H} columns")
    if S % BM:
        raise ValueError(f"rows of the gathered layout must be a multiple of BM={BM}, got S={S}")
    if out.shape != (S, Ir):
        raise ValueError(f"out must be [{S}, {Ir}], got {list(out.shape)}")
    for name, t in (("a", a), ("w13", w13), ("out", out)):
        if t.dtype != torch.bfloat16:
            raise TypeError(f"the CUDA tile is bf16 only: {name} is {t.dtype}")
    if block_expert.dtype != torch.int32 or block_expert.shape != (S // BM,):
        raise ValueError(f"block_expert must be int32 [{S // BM}], got {block_expert.dtype} {list(block_expert.shape)}")
    if row_token is not None and (row_token.dtype != torch.int32 or row_token.dim() != 1):
        raise ValueError(f"row_token must be int32 [S], got {row_token.dtype} {list(row_token.shape)}")
    if row_token is not None and a.shape[0] == 0:
        raise ValueError("a gathered launch needs at least one row of A")
    tensors = [a, w13, out, block_expert] + ([row_token] if row_token is not None else [])
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("the CUDA tile needs contiguous a, w13, out, block_expert and row_token")
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    return S, Ir


def grid_size(S: int, Ir: int, sms: int) -> int:
    """Persistent CTAs: one per SM, at most one per tile."""
    return max(1, min(sms, (S // TILE_ROWS) * (Ir // TILE_COLS)))


def gemm1_swiglu(a, w13, block_expert, *, out=None, num_programs=None, row_token=None,
                 act: Activation = Activation(), bias=None, queue=None, variant: str = "base") -> torch.Tensor:
    """act [S, Ir] (module docstring); a [N, H] (with row_token [S]) or [S, H], w13 [E, H, 2*Ir], all
    bf16 and contiguous on one sm_90 device, block_expert [S/BM] int32; queue a reused
    grouped_gemm.queue_counter (zero at launch, zero again after), else a fresh one; variant one of
    VARIANTS (the mainloop)."""
    if variant not in VARIANTS:
        raise ValueError(f"the CUDA tile's variant must be one of {VARIANTS}, got {variant!r}")
    if out is None:
        S = a.shape[0] if row_token is None else row_token.shape[0]
        out = torch.empty((S, w13.shape[2] // 2), dtype=a.dtype, device=a.device)
    S, Ir = check_args(a, w13, block_expert, out, row_token)
    reason = layer_reason(a.dtype, act, bias, a.shape[1], Ir) or device_reason(a.device)
    if reason:
        raise RuntimeError(f"GemmConfig.cuda_tile: {reason}")
    P = num_programs or grid_size(S, Ir, torch.cuda.get_device_properties(a.device).multi_processor_count)
    getattr(torch.ops.moe, OP)(a, w13, block_expert, row_token, check_queue(queue, a.device), out, P,
                              VARIANTS.index(variant))
    return out
