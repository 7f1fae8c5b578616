"""Keeping freed memory for reuse (glibc malloc), in the front ends and the ranks alike.

A front end allocates every request's buffers afresh (grpc's message bytes, the gRPC answer's
bytes, a body, an answer tensor) and a CPU rank its layer's intermediates every step. With glibc's
defaults each of those of more than a few hundred KiB was mapped, page-faulted in 4 KiB at a time,
and unmapped again: a gRPC T=512 bf16 request cost the CPU stand-in's front end 2,354 page faults,
its copy of the answer 1.2-1.9 ms instead of 0.2-0.5; the CPU default's four ranks ~1,480 faults a
full 512-token step (bench/NOTES.md, "Issue 11: page faults").
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt() parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2)


def keep_freed_memory(mib: int) -> bool:
    """Let glibc's malloc keep up to `mib` MiB of freed memory in this process for reuse (Settings.
    malloc_keep_mib; 0: glibc's defaults): allocations up to 32 MiB come from its heaps, which are
    trimmed only past that much free. True when glibc took both settings; False (logged) where it is
    not glibc's malloc or it refused."""
    if mib <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.info("malloc_keep_mib: no mallopt here (not glibc): the allocator's defaults stay")
        return False
    keep = min(mib << 20, 2**31 - 1)  # (an int in C)
    taken = mallopt(M_MMAP_THRESHOLD, min(keep, MMAP_THRESHOLD_MAX)) == 1 and mallopt(M_TRIM_THRESHOLD, keep) == 1
    if not taken:
        log.warning("malloc_keep_mib=%d: glibc refused mallopt; the allocator's defaults stay", mib)
    return taken
