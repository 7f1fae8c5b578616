"""The direct rows' device check in one launch: flag each row that is not all finite and zero it in place.

Dimension letters: r rows of the checked span, H hidden.

    bad[i] = not all(isfinite(x[i, :]))        x [r, H] bf16 / fp16 / fp32 (row-major view), in place
    x[i, :] = 0 where bad[i]                    bad [r] bool or uint8 (1 = not all finite, now zero)

A CUDA rank with `--shm-direct` DMAs rows from clients' shared-memory objects into the layer's input
and checks them on the device before the layer reads them (service.worker.rank._check_cuda). The
torch sequence this replaces (isfinite, all(dim=1), copy_ into the flags, logical_not_, masked_fill_)
is five launches of 10-50 us of host time each on the serving guest, on the critical path at
concurrency 1; this is one. A CUDA rank with Triton runs it as a node of a CUDA graph of each lane's
(service.worker.rank._SpanCheck, with the span's copy before it and the flags' copy after it): the graph
holds one launch over all C rows of the layer's input buffer, and the rows to check, which change from
step to step, come from a device word pair (`span`); a program outside it returns at once. The Python
launcher's host time (~30-85 us on the serving guests) becomes one replay's (~14 us).

Finite test: on the bits, not on the values. The launcher views x as int16 (bf16, fp16) or int32
(fp32) and a value is not finite iff all its exponent bits are set (IEEE 754: exactly +-inf and every
NaN, quiet or signalling, either sign, any payload): bf16 0x7F80, fp16 0x7C00, fp32 0x7F800000. That is
exact in every dtype by construction: no arithmetic, so no rounding, no overflow (a row of fp16 65504s,
whose sum is inf, is finite), no flush of subnormals (exponent 0: finite, and left as they are), no
upcast of bf16, and nothing a compiler could fold (`x - x == 0` is exact under IEEE arithmetic too,
but only while nothing rewrites x - x to 0). A bad row is overwritten with integer 0, i.e. +0.0; good
rows are never stored to, so they stay bit for bit what the DMA wrote.

One program per row: the verdict is a reduction over the row, so a program holding a row decides it
alone (no atomics, no second kernel). r is 1..C (512..2048), enough programs to fill the GPU at the
sizes where the device time is not already below the launch's. Each program reads its row in tiles of
BLOCK_H (H = 4096: one tile; 8192: two; an odd H masks the last tile's tail), ORs the tiles' hits into
one register vector, reduces it, stores its flag, and only if the row is bad (a branch on the
program's scalar) stores zeros over it tile by tile. Traffic (`bytes_moved`): r*H*element_size read
+ r flag bytes written (+ r_bad*H*element_size written for bad rows). At r=512, H=4096, bf16: 4 MB,
~1 us at 4.3 TB/s; the launch is the cost.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 4096   # columns per tile: H = 4096 (the default preset) is one tile, its loads all in flight at once
NUM_WARPS = 8    # 256 threads x 16 columns: two 16-byte loads per thread per tile (bf16 / fp16), four (fp32)

# The bits a dtype's values are read as, and its exponent field (all ones: +-inf or NaN).
_BITS = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
         torch.float32: (torch.int32, 0x7F800000)}


@triton.jit
def _check_row(x_ptr, bad_ptr, row, H, stride_x, EXP: tl.constexpr, BLOCK_H: tl.constexpr):
    """Row `row` of x: its flag, and zeros over it if it is bad."""
    base = x_ptr + row * stride_x
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    hits = tl.zeros([BLOCK_H], dtype=tl.int32)  # per column slot: 1 once any tile had a non-finite value there
    for start in range(0, H, BLOCK_H):
        c = start + cols
        # other=0: the masked tail of the last tile reads as +0.0, which is finite and adds no hit
        bits = tl.load(base + c, mask=c < H, other=0)
        hits |= ((bits & EXP) == EXP).to(tl.int32)  # exponent all ones: +-inf or NaN (module docstring)
    bad = tl.max(hits, axis=0)  # scalar: 1 iff some element of the row is not finite
    tl.store(bad_ptr + row, bad.to(tl.uint8))  # every checked row's flag is written: no clearing needed
    if bad != 0:  # rare: a good row is read once and never stored to (its bits stay the DMA's)
        zero = tl.zeros([BLOCK_H], dtype=x_ptr.dtype.element_ty)  # integer 0 = +0.0 in every float format
        for start in range(0, H, BLOCK_H):
            c = start + cols
            tl.store(base + c, zero, mask=c < H)  # mask: the row's own columns only, not the next row's


# bad_ptr is not specialized on its alignment: the rank passes flags[lo:], whose offset lo varies from step
# to step, and a new alignment would compile a second variant in the middle of serving (the one-byte
# flag stores gain nothing from it). x_ptr is: x[lo:] starts at lo * row bytes, 16-byte aligned for every
# lo whenever a row's bytes are a multiple of 16 (H = 4096, 4104, 8192 in 16 bits), and that alignment is
# what lets the loads be 16 bytes wide. span_ptr: None (every row of x), or int32 [2] on the device, the
# rows [lo, hi) to check (a launch fixed in a CUDA graph over a whole buffer, whose span changes per step).
@triton.jit(do_not_specialize_on_alignment=["bad_ptr"])
def _zero_bad_rows_kernel(x_ptr, bad_ptr, span_ptr, H, stride_x, EXP: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride_x passes 2**31 at r*H elements >= 2 G
    if span_ptr is None:
        _check_row(x_ptr, bad_ptr, row, H, stride_x, EXP, BLOCK_H)
    else:
        if (row >= tl.load(span_ptr)) & (row < tl.load(span_ptr + 1)):  # rows outside it: not read, not written
            _check_row(x_ptr, bad_ptr, row, H, stride_x, EXP, BLOCK_H)


def bytes_moved(r: int, H: int, element_size: int, bad_rows: int = 0) -> int:
    """DRAM bytes of one call: every row read once, the flags, the bad rows' zeros."""
    return r * H * element_size + r + bad_rows * H * element_size


def zero_bad_rows(x: torch.Tensor, bad: torch.Tensor, span: torch.Tensor | None = None) -> None:
    """In place, one launch on x's device in the current stream: bad[i] = row i of x [r, H] is not all
    finite, and such rows zeroed (see the module docstring). bad [r]: bool or uint8, contiguous.
    span: int32 [2] on x's device, or None (every row): the rows [span[0], span[1]) alone are checked,
    their flags written, the others' rows and flags left as they are; read by the kernel, so a CUDA
    graph that holds this launch checks whatever span the buffer holds when it is replayed."""
    if x.dim() != 2 or bad.shape != (x.shape[0],):
        raise ValueError(f"want x [r, H] and bad [r]; got x {tuple(x.shape)}, bad {tuple(bad.shape)}")
    if x.dtype not in _BITS:
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if bad.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"bad must be bool or uint8, got {bad.dtype}")
    if x.device != bad.device:
        raise ValueError(f"x and bad must share a device, got {x.device} and {bad.device}")
    r, H = x.shape
    if x.stride(1) != 1 and H > 1:  # in place: a contiguous copy would be checked and zeroed instead of x
        raise ValueError(f"x must be a row-major view (stride 1 along H), got strides {x.stride()}")
    if bad.stride(0) != 1 and r > 1:
        raise ValueError(f"bad must be contiguous, got stride {bad.stride(0)}")
    if span is not None and (span.dtype != torch.int32 or span.shape != (2,) or span.device != x.device):
        raise ValueError(f"span must be int32 [2] on {x.device}, got {span.dtype} {tuple(span.shape)} on {span.device}")
    if r == 0:
        return
    if H == 0 and span is None:  # no values: every row is (vacuously) all finite (with a span: the kernel's)
        bad.zero_()
        return
    bits, exp = _BITS[x.dtype]
    # uint8 view of a bool buffer: the kernel stores 0 / 1, which are torch's two bool bytes
    _zero_bad_rows_kernel[(r,)](x.view(bits), bad.view(torch.uint8), span, H, x.stride(0),
                                EXP=exp, BLOCK_H=BLOCK_H, num_warps=NUM_WARPS)


def zero_bad_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in plain torch, not in place: (x with its bad rows zeroed, bad [r] bool). Tests only."""
    bad = ~torch.isfinite(x.float()).all(dim=1)
    out = x.clone()
    out[bad] = 0
    return out, bad
