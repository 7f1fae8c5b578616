"""Schedule tables on the GPU: the launcher of the one-launch CUDA op `moe::build_tables`.

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
is off (CPU, not built, wrong torch) is logged once.

Imports point kernels <- moe: the tables come back as plain tensors in FIELDS order (the order
of docs/CONTRACTS.md); service.moe.serial.build_tables wraps them into `Tables` and falls back
to the torch builder where the op does not run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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
# The op's outputs, in the order of its schema and of the contract's Tables record.
FIELDS = ("expert_offsets", "block_expert", "slots", "row_token", "pull_order", "job_order")

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
    """Whether the CUDA op serves these inputs (CUDA ids, within its limits, library loaded)."""
    return ids.is_cuda and fits_cuda_op(ids.shape[0], ids.shape[1], E) and load()[0]


def build_tables_cuda(ids: torch.Tensor, counts: torch.Tensor, E: int, C: int, S: int, *,
                      out: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """The CUDA op. ids [R*C, K], counts [R] on one CUDA device -> the six int32 tables in FIELDS
    order. With `out` (six preallocated int32 tensors in FIELDS order, written in place and
    returned) nothing is allocated, which is what a captured graph wants."""
    available, reason = load()
    if not available:
        raise RuntimeError(f"moe::build_tables is not available: {reason}")
    # The op takes int32: casting is one extra launch, so callers keep ids/counts int32.
    ids = ids if ids.dtype == torch.int32 and ids.is_contiguous() else ids.to(torch.int32).contiguous()
    counts = counts.to(ids.device, torch.int32).contiguous()
    if out is None:
        return tuple(torch.ops.moe.build_tables(ids, counts, E, C, S))
    out = tuple(out)
    assert len(out) == len(FIELDS), f"out must hold the {len(FIELDS)} tables {FIELDS}, got {len(out)}"
    torch.ops.moe.build_tables_out(ids, counts, E, C, *out)
    return out
