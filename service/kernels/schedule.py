"""Schedule tables on the GPU: the one-launch CUDA op `moe::build_tables` when it is built, the
vectorized torch builder (service.moe.tables.build_tables) otherwise.

The op (csrc/schedule/schedule_kernel.cu) produces every table of docs/CONTRACTS.md in one
launch of one 1024-thread CTA: three stable counting sorts (hits by expert, tokens by smallest and
largest expert) with per-warp 16-bit counters and warp-match ranks in shared memory, a fixed
number of barriers, no atomic deciding a position; so the result is deterministic and equal
element by element to `build_tables_golden`; no host sync, no allocation in the out-variant,
capturable in a CUDA graph. Limits (checked here and at the C++ entry, which raises a
RuntimeError before touching any data): E <= 1023, R*C*K <= 65536 hits, int32 ids/counts on one
CUDA device (others are cast).

Nothing is built or loaded at import: `python csrc/build.py` builds the library ahead of time
(CUDA torch and nvcc needed) into build/moe_csrc/, and the first call here loads it. Why the op
is off (CPU, not built, wrong torch) is logged once, and the torch builder runs instead.

Imports point kernels <- moe; this module reaches service.moe.tables only inside functions (the
fallback and the Tables record), never at import.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from service.config import BM

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
LIBRARY_NAME = "moe_csrc"
BUILD_DIR = ROOT / "build" / LIBRARY_NAME
LIBRARY_PATH = BUILD_DIR / f"{LIBRARY_NAME}.so"
MAX_EXPERTS = 1023  # csrc/schedule/schedule_kernel.h kMaxExperts
MAX_HITS = 65536    # csrc/schedule/schedule_kernel.h kMaxHits

_loaded: bool | None = None
_reason = ""


def _register_fake() -> None:
    """Shape functions so torch.compile / FakeTensor can trace through the op."""

    @torch.library.register_fake("moe::build_tables")
    def _(ids, counts, E, C, S):
        T, K = ids.shape
        new = lambda *shape: ids.new_empty(shape, dtype=torch.int32)  # noqa: E731
        return new(E + 1), new(S // BM), new(T, K), new(S), new(T), new(T), new(S // BM)


def load(path: Path = LIBRARY_PATH) -> tuple[bool, str]:
    """Load the built library once. Returns (available, reason when not)."""
    global _loaded, _reason
    if _loaded is not None:
        return _loaded, _reason
    if not torch.cuda.is_available():
        _loaded, _reason = False, "no CUDA device"
    elif not path.is_file():
        _loaded, _reason = False, f"{path} not built (run `python csrc/build.py` on a CUDA host)"
    else:
        try:
            torch.ops.load_library(str(path))
            _register_fake()
            _loaded, _reason = True, ""
        except (OSError, RuntimeError) as exc:  # built against another torch / CUDA
            _loaded, _reason = False, f"loading {path} failed: {exc}"
    if _loaded:
        log.info("schedule builder: CUDA op moe::build_tables from %s", path)
    else:
        log.warning("schedule builder: CUDA op off (%s); using the torch builder", _reason)
    return _loaded, _reason


def fits_cuda_op(num_tokens: int, K: int, E: int) -> bool:
    return E <= MAX_EXPERTS and num_tokens * K <= MAX_HITS


def use_cuda_op(ids: torch.Tensor, E: int) -> bool:
    """Whether build_tables would take the CUDA op for these inputs."""
    return ids.is_cuda and fits_cuda_op(ids.shape[0], ids.shape[1], E) and load()[0]


def build_tables_cuda(ids: torch.Tensor, counts: torch.Tensor, E: int, C: int, S: int, *, out=None):
    """The CUDA op. ids [R*C, K], counts [R] on one CUDA device. With `out` (a Tables of
    preallocated int32 buffers) nothing is allocated, which is what a captured graph wants."""
    from service.moe.tables import Tables

    available, reason = load()
    if not available:
        raise RuntimeError(f"moe::build_tables is not available: {reason}")
    # The op takes int32: casting is one extra launch, so callers keep ids/counts int32.
    ids = ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32).contiguous()
    counts = counts.to(ids.device, torch.int32).contiguous()
    if out is None:
        return Tables(*torch.ops.moe.build_tables(ids, counts, E, C, S))
    torch.ops.moe.build_tables_out(ids, counts, E, C, out.expert_offsets, out.block_expert, out.slots,
                                   out.row_token, out.pull_order, out.job_order, out.slack)
    return out


def build_tables(ids: torch.Tensor, counts: torch.Tensor, E: int, C: int, S: int, *, out=None):
    """The schedule tables: the CUDA op where it runs (CUDA ids, within its limits, built), the
    torch builder otherwise. Same values either way."""
    if use_cuda_op(ids, E):
        return build_tables_cuda(ids, counts, E, C, S, out=out)
    from service.moe import tables

    result = tables.build_tables(ids, counts, E, C, S)
    if out is None:
        return result
    for name in ("expert_offsets", "block_expert", "slots", "row_token", "pull_order", "job_order", "slack"):
        getattr(out, name).copy_(getattr(result, name))
    return out
