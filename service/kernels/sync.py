"""Cross-program and cross-GPU synchronisation primitives (Triton jit helpers) for the fused kernels
(service/kernels/fused_kernels.py).

Every helper takes `USE_PTX: tl.constexpr`:
    True   inline PTX (GPU builds): per-thread `ld.global.acquire.sys` polls with no CTA barrier per
           poll, `st.release.sys` / `red.release.sys` issued by thread 0 after a CTA barrier,
           `%globaltimer` for wait times.
    False  `tl.atomic_*` with sem and scope: the path the interpreter (TRITON_INTERPRET=1) runs; it
           has no inline asm. Timers read 0 there.

Flags are int32 and monotonic (never reset, ARCHITECTURE.md 5.4); targets are functions of the
batch sequence number (`seq * n_tiles`, `seq`). Comparisons are wrap-safe: a flag has reached a
target when `(flag - target)` as int32 is >= 0, so flags may wrap past 2**31 as long as a flag
never lags its target by 2**31. Every flag therefore moves every step: counters gain a fixed
amount per step, and flags that only some steps would set (the fused kernel 1's per-token
arrivals) are refreshed to seq at the end of every step.

Memory-ordering recipe (ARCHITECTURE.md 5.3): signal = all threads' stores, CTA barrier, one
release at system scope; wait = acquire at system scope in a loop, then a CTA barrier (inside the
reduction or the scalar atomic that makes the verdict uniform) before other threads read the data.
Every wait is bounded by `max_spins` polls and returns 0 on expiry: the caller records an error
and stops instead of hanging (5.5).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ld_acquire_ptx(ptr):
    # One acquire load per thread (and per element of a pointer tensor): no barrier per poll (a
    # scalar tl.atomic_* costs two bar.sync per poll). Not usable in the interpreter (no inline asm).
    return tl.inline_asm_elementwise(
        "ld.global.acquire.sys.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def reached(flag, target):
    """flag >= target, wrap-safe over int32."""
    return (flag - target) >= 0


@triton.jit
def wait_all_geq(ptrs, mask, target, max_spins, USE_PTX: tl.constexpr):
    """Wait until every int32 at `ptrs` (where `mask`) reaches `target`. Returns int32 1, or 0 on timeout.

    One poll = one acquire load per element (spread over the threads) and a min-reduction, which
    makes the verdict uniform; a CTA barrier at the end orders every thread's later loads after the
    acquires of all elements. Masked lanes must still hold valid addresses (they are loaded).
    """
    if USE_PTX:
        seen = _ld_acquire_ptx(ptrs)
    else:
        seen = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys")
    ok = tl.min((reached(seen, target) | (mask == 0)).to(tl.int32), axis=0)
    spins = 0
    while (ok == 0) & (spins < max_spins):
        if USE_PTX:
            seen = _ld_acquire_ptx(ptrs)
        else:
            seen = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys")
        ok = tl.min((reached(seen, target) | (mask == 0)).to(tl.int32), axis=0)
        spins += 1
    # The reduction may stay inside each warp (shuffles are no memory ordering): a CTA barrier
    # orders every thread's later loads after every element's acquire.
    tl.debug_barrier()
    return ok


@triton.jit
def signal_add(ptr, value, USE_PTX: tl.constexpr):
    """Add `value` to the int32 at `ptr` with a release at system scope, after all threads' stores."""
    # Triton 3.6 puts no barrier before a release atomic: without it, other threads' stores are
    # not ordered before the signal.
    tl.debug_barrier()
    if USE_PTX:
        # Thread 0 only (blockDim = (32 * num_warps, 1, 1)); the barrier makes the release
        # cumulative over every thread's stores.
        tl.inline_asm_elementwise(
            """{
            .reg .pred p;
            .reg .b32 t;
            mov.u32 t, %tid.x;
            setp.eq.u32 p, t, 0;
            @p red.release.sys.global.add.s32 [$1], $2;
            mov.u32 $0, 0;
            }""",
            "=r,l,r", [ptr, value], dtype=tl.int32, is_pure=False, pack=1,
        )
    else:
        # A scalar atomic is issued by one thread.
        tl.atomic_add(ptr, value, sem="release", scope="sys")


@triton.jit
def store_release(ptr, value, USE_PTX: tl.constexpr):
    """Store `value` at `ptr` (local or a peer's) with a release at system scope, after all
    threads' stores. A plain store, not a read-modify-write: the way completion is published
    to a peer (ARCHITECTURE.md 5.3). `ptr` may be a tensor of pointers (one store per element)."""
    tl.debug_barrier()
    if USE_PTX:
        # Replicated elements are stored by several threads: the same value, harmless.
        tl.inline_asm_elementwise(
            """{
            fence.acq_rel.sys;
            st.release.sys.global.b32 [$1], $2;
            mov.u32 $0, 0;
            }""",
            "=r,l,r", [ptr, value], dtype=tl.int32, is_pure=False, pack=1,
        )
    else:
        tl.atomic_xchg(ptr, value, sem="release", scope="sys")


@triton.jit
def now_ns(USE_PTX: tl.constexpr):
    """The GPU's global nanosecond timer (int64); 0 in the interpreter."""
    if USE_PTX:
        # The dummy operand gives the asm a shape (a scalar); it is not used.
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.zeros((), dtype=tl.int32)],
                                      dtype=tl.int64, is_pure=False, pack=1)
    else:
        t = tl.zeros((), dtype=tl.int64)
    return t
