"""The fused layer's kernels: stage, exchange, AllGather (+) GEMM1 (+) SwiGLU, GEMM2 (+) top-k reduce
(+) push, final reduce. The algorithm, buffers and sequence numbers are described in service/moe/fused.py;
service/moe/simulate.py is its CPU dataflow model.

Dimension letters: R ranks, C capacity per rank, N = R*C global tokens, K top-k, H hidden,
Ir intermediate slice, E experts, S gathered rows, NB = S / BM row blocks, L = META + 2*C*K
int32 words of one routing block.

Peer memory: every rank owns one symmetric region. The kernels get this rank's region as a
pointer and `region_off [R] int64`, the distance of every rank's region (as mapped in this
process) from it in 16-byte units (`region_of`). Offsets into a region are passed in elements
of the type read there (tokens: the layer dtype, routing / flags: int32, staging: fp32):

    tokens   [2, C, H]      dtype  parity seq & 1 (double buffered, see fused.py)
    pulled   [N, H]         dtype  remote tokens copied here by kernel 1 (read only locally)
    routing  [2, L]         int32  META words (n, seq lo, seq hi, 0), ids [C, K], weights [C, K] (fp32 bits)
    staging  [R, C, H]      fp32   plane s = partial sums pushed by source rank s
    wm       [R]            int32  wm[s] = last batch whose pushes from source s are complete
    bar      [R]            int32  bar[s] = last batch source s entered

Roles by program id. Producers take the low ids: the interpreter runs programs in id order, so a
consumer never waits on a program it has not run yet, and on the GPU the whole grid is
co-resident anyway (grid <= #SMs, one CTA per SM at these tile sizes), so spinning consumers can
never keep a producer off the machine.
    kernel 1: pid < NUM_COMM pull remote tokens (producers), the rest run GEMM1 behind the gate
              (NUM_COMM = 0 when R = 1: every token is local);
    kernel 2: pid < NUM_COMPUTE run GEMM2 and mark tiles (producers), the rest take jobs; with
              JOIN the GEMM programs take jobs too once their tiles are done (all-hands tail).

Bounded waits record the first failure in error[0] (atomic CAS from 0, so the first one stays):
    ERR_BARRIER + peer, ERR_GATE + block, ERR_JOB + first token of the grab, ERR_WATERMARK
(the constants below: one definition for the kernels, the host's `describe_error` and the tests).
Every kernel but the stage copy does nothing when error[0] is set at its start: after a failure the step is void,
the host raises and the group restarts.

SYNC=False (benchmarks only: `bench/fused_layer.py`'s compute-only run) removes every wait: the
same programs move the same bytes, unsynchronised, and the output is garbage.

stats [4] int64 nanoseconds (GPU %globaltimer, 0 in the interpreter), rewritten every step:
    0 barrier wait (exchange), 1 sum over kernel-1 compute programs of their gate waits,
    2 sum over kernel-2 GEMM programs of their time in the dispenser, 3 final reduce's watermark wait.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from service.config import BM, Activation
from service.config import META as config_META
from service.kernels.grouped_gemm import (
    GemmConfig,
    epilogue_args,
    gemm_tile,
    half_tail,
    next_tile,
    tile_coords,
    weight_operand,
)
from service.kernels.sync import now_ns, signal_add, store_release, wait_all_geq

META = tl.constexpr(config_META)  # int32 words in front of a routing block (layout: service.moe.routing)

# Error codes: kind << 24, plus a detail in the low 24 bits. Compile-time constants the kernels
# add their detail to; the host reads them as ints (`.value`).
ERR_DETAIL_BITS = 24
ERR_BARRIER = tl.constexpr(1 << ERR_DETAIL_BITS)    # + peer rank whose barrier signal never came
ERR_GATE = tl.constexpr(2 << ERR_DETAIL_BITS)       # + row block whose remote tokens never all arrived (kernel 1)
ERR_JOB = tl.constexpr(3 << ERR_DETAIL_BITS)        # + first global token of a job whose rows never completed (k. 2)
ERR_WATERMARK = tl.constexpr(4 << ERR_DETAIL_BITS)  # final reduce: some source never published
ERR_NAMES = {ERR_BARRIER.value: "barrier", ERR_GATE.value: "kernel-1 gate", ERR_JOB.value: "kernel-2 job",
             ERR_WATERMARK.value: "final-reduce watermark"}


def error_kind(code: int) -> int:
    """The ERR_* constant of an error word (its detail masked off)."""
    return code >> ERR_DETAIL_BITS << ERR_DETAIL_BITS


def describe_error(code: int) -> str:
    detail = code & ((1 << ERR_DETAIL_BITS) - 1)
    return f"{ERR_NAMES.get(error_kind(code), 'unknown')} wait timed out (detail {detail})"


@triton.jit
def region_of(region_ptr, region_off, r, DT: tl.constexpr):
    """Base of rank r's region (r a scalar or a tensor of ranks) as a pointer to DT: our own
    region's base plus r's distance from it in 16-byte units. Built this way, not from an absolute
    int64 address (which the compiler cannot see is aligned), peer rows move in 16-byte vectors
    instead of one element per instruction."""
    return region_ptr.to(tl.pointer_type(DT)) + tl.load(region_off + r) * (16 // (DT.primitive_bitwidth // 8))


# ---------------------------------------------------------------------------------------------
# Stage: this step's inputs into the parity-(seq & 1) token and routing buffers.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _stage_kernel(x_in_ptr, ids_in_ptr, w_in_ptr, region_ptr, ctl_ptr,  # x [C, H], ids [C, K] int32, w [C, K] fp32
                  C, H, L, tok_off, rt_off,
                  K: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, BRK: tl.constexpr):
    """Rows [pid*BR, pid*BR + BR) of the first n = ctl[1] rows: tokens -> tokens[seq & 1], ids and
    weights (as int32 bits) -> routing[seq & 1]. Inside the step's CUDA graph, so the host issues
    no copies per step; the META words are the exchange's."""
    pid = tl.program_id(0)
    seq = tl.load(ctl_ptr)
    n = tl.load(ctl_ptr + 1)
    parity = (seq & 1).to(tl.int64)
    rows = (pid * BR + tl.arange(0, BR)).to(tl.int64)  # [BR]
    rm = rows < n
    src = x_in_ptr + rows[:, None] * H  # [BR, 1]
    dst = region_ptr.to(tl.pointer_type(x_in_ptr.dtype.element_ty)) + tok_off + (parity * C + rows[:, None]) * H
    hh = tl.arange(0, BH)
    for h0 in range(0, H, BH):
        cols = h0 + hh
        m = rm[:, None] & (cols < H)[None, :]  # [BR, BH]
        tl.store(dst + cols[None, :], tl.load(src + cols[None, :], mask=m), mask=m)
    q = tl.arange(0, BRK)  # [BRK] this program's ids / weights, flattened
    e = pid * BR * K + q
    em = (q < BR * K) & (e < n * K)
    rt = region_ptr.to(tl.pointer_type(tl.int32)) + rt_off + parity * L + META
    tl.store(rt + e, tl.load(ids_in_ptr + e, mask=em), mask=em)
    tl.store(rt + C * K + e, tl.load(w_in_ptr + e, mask=em).to(tl.int32, bitcast=True), mask=em)


# ---------------------------------------------------------------------------------------------
# Exchange: barrier on the batch number, then every rank's routing block.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _exchange_kernel(region_ptr, region_off, routing_g_ptr, ctl_ptr, error_ptr, stats_ptr,
                     rank, R, L, rt_off, bar_off, max_spins,
                     RP: tl.constexpr, BL: tl.constexpr, USE_PTX: tl.constexpr, SYNC: tl.constexpr):
    """One program. bar[rank] := seq on every peer (release), wait until bar[s] >= seq for all s,
    then copy the R routing blocks of parity seq & 1 into routing_g [R, L] (local). First it
    writes this rank's META words (ctl[1:4] = n, seq low, seq high) into its own routing block.

    The barrier says "every rank has finished its previous step and has written this step's
    tokens and routing": peers may read them now, and nobody is still reading the buffers of
    parity seq & 1 from two steps ago (fused.py explains the double buffering).
    """
    seq = tl.load(ctl_ptr)
    rr = tl.arange(0, RP)  # [RP]
    rmask = rr < R
    for i in tl.static_range(1, 4):
        tl.store(stats_ptr + i, tl.zeros((), dtype=tl.int64))
    if tl.load(error_ptr) == 0:
        mine = region_ptr.to(tl.pointer_type(tl.int32))
        parity = (seq & 1).to(tl.int64)
        meta = mine + rt_off + parity * L
        for i in tl.static_range(1, 4):
            tl.store(meta + i - 1, tl.load(ctl_ptr + i))
        tl.store(meta + 3, 0)
        # Lanes past R address our own slot: a duplicate store.
        peer_slots = region_of(region_ptr, region_off, tl.where(rmask, rr, rank), tl.int32) + bar_off + rank  # [RP]
        store_release(peer_slots, tl.zeros((RP,), dtype=tl.int32) + seq, USE_PTX)
        t0 = now_ns(USE_PTX)
        my_slots = mine + bar_off + tl.where(rmask, rr, 0)  # [RP]
        ok = 1
        if SYNC:
            ok = wait_all_geq(my_slots, rmask, seq, max_spins, USE_PTX)
        tl.store(stats_ptr, now_ns(USE_PTX) - t0)
        if ok == 0:
            # Name the first missing peer (a plain read: the verdict is already made).
            seen = tl.load(my_slots, mask=rmask, other=0)
            missing = tl.min(tl.where(rmask & ((seen - seq) < 0), rr, RP), axis=0)
            tl.atomic_cas(error_ptr, 0, ERR_BARRIER + missing)
        # Routing blocks (after the acquire above; stale but well-formed when it timed out).
        offs = tl.arange(0, BL)
        for r in range(0, R):
            src = region_of(region_ptr, region_off, r, tl.int32) + rt_off + parity * L
            for o in range(0, L, BL):
                m = (o + offs) < L
                tl.store(routing_g_ptr + r * L + o + offs, tl.load(src + o + offs, mask=m), mask=m)


# ---------------------------------------------------------------------------------------------
# Kernel 1: AllGather (+) GEMM1 (+) gated activation (compile-time ACT / CLAMP / BIAS, as the grouped GEMM).
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gemm1_tile(mine, w_ptr, act_ptr, bias_ptr, row_token_ptr, block, expert, pn, ready, rank, C, H, Ir,
                tok_off, pull_off, parity, limit, alpha, stride_we, stride_wk, stride_om, stride_be,
                ACT: tl.constexpr, CLAMP: tl.constexpr, BIAS: tl.constexpr, W_DESC: tl.constexpr,
                IEEE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                BM: tl.constexpr, TM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Kernel 1's tile: the first TM rows of `block`, each row read where its token lies (in place
    when it is ours, else from `pulled`). A padding row reads our row s mod C: valid, and spread
    (one shared row would hammer one L2 slice with a quarter of GEMM1's loads)."""
    rows = block.to(tl.int64) * BM + tl.arange(0, TM)  # [TM]
    rt = tl.load(row_token_ptr + rows)  # [TM]
    g = tl.maximum(rt, 0)
    owner = g // C
    local = (owner == rank) | (rt < 0)  # [TM] rows read in place
    own_row = tl.where(rt < 0, rows % C, g - owner * C).to(tl.int64)
    a_rows = tl.where(local, tok_off + (parity * C + own_row) * H,
                      pull_off + g.to(tl.int64) * H)  # [TM] element offsets in our region
    gemm_tile(mine, a_rows, w_ptr, act_ptr, bias_ptr, block, expert, pn, ready, Ir, H, Ir,
              limit, alpha, 1, stride_we, stride_wk, 1, stride_om, 1, stride_be,
              ACT, CLAMP, BIAS, W_DESC, IEEE, EVEN_K, EVEN_N, BM, TM, BN, BK)


@triton.jit
def _arrivals(row_token_ptr, arrived_ptr, block, rank, N, C, seq, max_spins,
              USE_PTX: tl.constexpr, SYNC: tl.constexpr, BM: tl.constexpr, GR: tl.constexpr):
    """Kernel 1's gate: 1 once every remote token of the GR rows from row block `block` on (BM for
    one block, 2 * BM for a pair tile) has arrived[g] >= seq, 0 when the bounded wait timed out.
    Our own tokens and padding rows wait for nothing (they poll the dummy flag arrived[N], masked)."""
    rows = block.to(tl.int64) * BM + tl.arange(0, GR)  # [GR]
    rt = tl.load(row_token_ptr + rows)  # [GR]
    g = tl.maximum(rt, 0)
    local = (g // C == rank) | (rt < 0)  # [GR] rows read in place
    ready = block * 0 + 1
    if SYNC:
        ready = wait_all_geq(arrived_ptr + tl.where(local, N, g), local == 0, seq, max_spins, USE_PTX)
    return ready


@triton.jit
def _gemm1_gated(mine, w_ptr, act_ptr, bias_ptr, row_token_ptr, arrived_ptr, error_ptr, block, expert, pn, rank, N,
                 C, H, Ir, tok_off, pull_off, parity, seq, max_spins, limit, alpha, stride_we, stride_wk, stride_om,
                 stride_be, ACT: tl.constexpr, CLAMP: tl.constexpr, BIAS: tl.constexpr, W_DESC: tl.constexpr,
                 USE_PTX: tl.constexpr, SYNC: tl.constexpr, SPLIT: tl.constexpr, PAIR_TILE: tl.constexpr,
                 IEEE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Kernel 1's work for one tile number: the gate (every remote token of the tile's rows arrived),
    then the tile: PAIR_TILE, blocks `block` and `block + 1` in one 2*BM x BN/2 tile; else a BM/2-row
    tile for a half tail, a BM-row tile otherwise. A timed-out gate records ERR_GATE + block (a
    pair's first block) and computes nothing. Returns (gate verdict, ns spent in the gate)."""
    t0 = now_ns(USE_PTX)
    if PAIR_TILE:
        ready = _arrivals(row_token_ptr, arrived_ptr, block, rank, N, C, seq, max_spins, USE_PTX, SYNC, BM, 2 * BM)
    else:
        ready = _arrivals(row_token_ptr, arrived_ptr, block, rank, N, C, seq, max_spins, USE_PTX, SYNC, BM, BM)
    dt = now_ns(USE_PTX) - t0
    if ready == 0:
        tl.atomic_cas(error_ptr, 0, ERR_GATE + block)
    elif PAIR_TILE:
        _gemm1_tile(mine, w_ptr, act_ptr, bias_ptr, row_token_ptr, block, expert, pn, ready, rank, C, H, Ir,
                    tok_off, pull_off, parity, limit, alpha, stride_we, stride_wk, stride_om, stride_be,
                    ACT, CLAMP, BIAS, W_DESC, IEEE, EVEN_K, EVEN_N, BM, 2 * BM, BN // 2, BK)
    elif half_tail(row_token_ptr, block, SPLIT, BM):
        _gemm1_tile(mine, w_ptr, act_ptr, bias_ptr, row_token_ptr, block, expert, pn, ready, rank, C, H, Ir,
                    tok_off, pull_off, parity, limit, alpha, stride_we, stride_wk, stride_om, stride_be,
                    ACT, CLAMP, BIAS, W_DESC, IEEE, EVEN_K, EVEN_N, BM, BM // 2, BN, BK)
    else:
        _gemm1_tile(mine, w_ptr, act_ptr, bias_ptr, row_token_ptr, block, expert, pn, ready, rank, C, H, Ir,
                    tok_off, pull_off, parity, limit, alpha, stride_we, stride_wk, stride_om, stride_be,
                    ACT, CLAMP, BIAS, W_DESC, IEEE, EVEN_K, EVEN_N, BM, BM, BN, BK)
    return ready, dt


@triton.jit
def _ag_gemm1_kernel(
    region_ptr, region_off, w_ptr, act_ptr,  # our region, [R] int64 (16 B units), W13 [E, H, 2*Ir] or its
                                          # descriptor, act [S, Ir]
    bias_ptr,                             # BIAS: b13 [E, 2*Ir] gate, then up bias
    slots_ptr, pull_ptr, row_token_ptr, block_expert_ptr,  # [N, K], [N], [S], [NB] int32
    offsets_ptr,                          # PN_MAJOR: [E+1] int32 expert_offsets
    queue_ptr,                            # QUEUE: [1] int32 kernel 1's tile queue, zeroed by the final reduce
    arrived_ptr,                          # [N + 1] int32 per pulled token, monotonic; [N] is a dummy
    ctl_ptr, error_ptr, stats_ptr,        # [1] int32 seq, [1] int32, [4] int64
    rank, N, C, H, NB, Ir, E, tok_off, pull_off, max_spins, limit, alpha,
    stride_we, stride_wk, stride_om, stride_be,
    ACT: tl.constexpr, CLAMP: tl.constexpr, BIAS: tl.constexpr, W_DESC: tl.constexpr,
    TB: tl.constexpr, BH: tl.constexpr, K: tl.constexpr,
    NUM_COMM: tl.constexpr, NUM_PROGRAMS: tl.constexpr, USE_PTX: tl.constexpr, SYNC: tl.constexpr,
    SPLIT: tl.constexpr, QUEUE: tl.constexpr, PN_MAJOR: tl.constexpr, PAIR: tl.constexpr,
    IEEE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Row s of GEMM1's input is token row_token[s]: read in place from this rank's own token
    buffer when the token is ours (or s is a padding row: our row s mod C, output unused), else from
    `pulled` [N, H] in our region, where the comm programs copy each remote token once (one
    read from its owner, one local write: the K copies are the GEMM's re-reads of one row).
    A tile waits until every remote token of its row block (a pair tile: of its two blocks) has
    arrived[g] >= seq."""
    pid = tl.program_id(0)
    seq = tl.load(ctl_ptr)
    parity = (seq & 1).to(tl.int64)
    mine = region_ptr.to(tl.pointer_type(act_ptr.dtype.element_ty))
    if tl.load(error_ptr) == 0:
        if pid < NUM_COMM:
            # -- comm: pull the remote real tokens in pull_order, TB per iteration -------------
            tt = tl.arange(0, TB)  # [TB] tokens per iteration: TB times fewer round trips per pull
            hh = tl.arange(0, BH)  # [BH]
            # Program p takes chunks p, p + NUM_COMM, ... of TB consecutive tokens of pull_order.
            for i0 in range(pid * TB, N, NUM_COMM * TB):
                idx = i0 + tt
                g = tl.load(pull_ptr + idx, mask=idx < N, other=0)  # [TB]
                owner = g // C
                # Padding tokens (slot -1, last in pull_order) and our own tokens move nothing.
                move = (idx < N) & (owner != rank) & (tl.load(slots_ptr + g * K) >= 0)  # [TB]
                src = (region_of(region_ptr, region_off, owner, act_ptr.dtype.element_ty)
                       + tok_off + (parity * C + (g - owner * C)) * H)  # [TB] the tokens in their owners' buffers
                dst = mine + pull_off + g.to(tl.int64) * H  # [TB]
                for h0 in range(0, H, BH):
                    cols = h0 + hh
                    m = move[:, None] & (cols < H)[None, :]  # [TB, BH]
                    x = tl.load(src[:, None] + cols[None, :], mask=m)  # one peer read per token
                    tl.store(dst[:, None] + cols[None, :], x, mask=m)
                # All threads' stores, CTA barrier, one release per moved token (the rest hit the dummy).
                store_release(arrived_ptr + tl.where(move, g, N), seq, USE_PTX)
        else:
            # -- compute: persistent grouped GEMM1 over (block, column tile), gated -------------
            cp = pid - NUM_COMM
            n_tiles = tl.cdiv(Ir, BN)
            n_pair = tl.cdiv(Ir, BN // 2)  # PAIR: column tiles of a pair tile
            alive = pid * 0 + 1
            waited = tl.zeros((), dtype=tl.int64)
            # No flattened loop: a tile's wait stays ahead of that tile's loads. Tiles in block
            # order (= the order pull_order completes them), from the static walk or the queue.
            step = NUM_PROGRAMS - NUM_COMM
            tile = next_tile(queue_ptr, cp - step, step, QUEUE)
            while tile < NB * n_tiles:
                block, pn, expert, pair = tile_coords(tile, n_tiles, n_pair, block_expert_ptr, offsets_ptr,
                                                      row_token_ptr, E, PN_MAJOR, PAIR, SPLIT, BM)
                if (expert < E) & (alive != 0):  # expert == E: a block past the last expert, an empty pair slot
                    # The tile kind is a compile-time flag per call (grouped_gemm._grouped_gemm_kernel: why).
                    if PAIR and pair != 0:
                        ready, dt = _gemm1_gated(
                            mine, w_ptr, act_ptr, bias_ptr, row_token_ptr, arrived_ptr, error_ptr, block, expert,
                            pn, rank, N, C, H, Ir, tok_off, pull_off, parity, seq, max_spins, limit, alpha,
                            stride_we, stride_wk, stride_om, stride_be, ACT, CLAMP, BIAS, W_DESC, USE_PTX, SYNC,
                            SPLIT, True, IEEE, EVEN_K, EVEN_N, BM, BN, BK)
                    else:
                        ready, dt = _gemm1_gated(
                            mine, w_ptr, act_ptr, bias_ptr, row_token_ptr, arrived_ptr, error_ptr, block, expert,
                            pn, rank, N, C, H, Ir, tok_off, pull_off, parity, seq, max_spins, limit, alpha,
                            stride_we, stride_wk, stride_om, stride_be, ACT, CLAMP, BIAS, W_DESC, USE_PTX, SYNC,
                            SPLIT, False, IEEE, EVEN_K, EVEN_N, BM, BN, BK)
                    waited += dt
                    alive = ready  # 0 after a timed-out gate: this program computes nothing more
                tile = next_tile(queue_ptr, tile, step, QUEUE)
            tl.atomic_add(stats_ptr + 1, waited, sem="relaxed")


# ---------------------------------------------------------------------------------------------
# Kernel 2: GEMM2 (+) top-k reduce (+) push.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gemm2_tile(act_ptr, w_ptr, d_ptr, bias_ptr, block, expert, pn, H, Ir, stride_am, stride_we, stride_wk,
                stride_om, stride_be, BIAS: tl.constexpr, W_DESC: tl.constexpr, IEEE: tl.constexpr,
                EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                BM: tl.constexpr, TM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Kernel 2's tile: D = act @ W2[expert] on the first TM rows of `block`."""
    rows = block.to(tl.int64) * BM + tl.arange(0, TM)  # [TM]
    gemm_tile(act_ptr, rows * stride_am, w_ptr, d_ptr, bias_ptr, block, expert, pn, 1, H, Ir, 0,
              0.0, 0.0, 1, stride_we, stride_wk, 1, stride_om, 1, stride_be,
              0, False, BIAS, W_DESC, IEEE, EVEN_K, EVEN_N, BM, TM, BN, BK)


@triton.jit
def _gemm2_block(act_ptr, w_ptr, d_ptr, bias_ptr, row_token_ptr, tiles_ptr, block, expert, pn, E, H, Ir, stride_am,
                 stride_we, stride_wk, stride_om, stride_be, BIAS: tl.constexpr, W_DESC: tl.constexpr,
                 USE_PTX: tl.constexpr, SPLIT: tl.constexpr, PAIR_TILE: tl.constexpr, MARKS: tl.constexpr,
                 IEEE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Kernel 2's work for one tile number: the tile when expert < E (PAIR_TILE: blocks `block` and
    `block + 1` in one 2*BM x BN/2 tile; else BM/2 rows for a half tail, BM otherwise), then its
    marks: +1 on both blocks of a pair, +MARKS on a block of its own (so every block gains MARKS
    per own tile number per step, used or not)."""
    if expert < E:
        if PAIR_TILE:
            _gemm2_tile(act_ptr, w_ptr, d_ptr, bias_ptr, block, expert, pn, H, Ir, stride_am, stride_we,
                        stride_wk, stride_om, stride_be, BIAS, W_DESC, IEEE, EVEN_K, EVEN_N, BM, 2 * BM, BN // 2, BK)
        elif half_tail(row_token_ptr, block, SPLIT, BM):  # the rows GEMM1 wrote, no more
            _gemm2_tile(act_ptr, w_ptr, d_ptr, bias_ptr, block, expert, pn, H, Ir, stride_am, stride_we,
                        stride_wk, stride_om, stride_be, BIAS, W_DESC, IEEE, EVEN_K, EVEN_N, BM, BM // 2, BN, BK)
        else:
            _gemm2_tile(act_ptr, w_ptr, d_ptr, bias_ptr, block, expert, pn, H, Ir, stride_am, stride_we,
                        stride_wk, stride_om, stride_be, BIAS, W_DESC, IEEE, EVEN_K, EVEN_N, BM, BM, BN, BK)
    if PAIR_TILE:
        signal_add(tiles_ptr + block, 1, USE_PTX)  # CTA barrier, release (local flag)
        signal_add(tiles_ptr + block + 1, 1, USE_PTX)
    else:
        signal_add(tiles_ptr + block, MARKS, USE_PTX)


@triton.jit
def _gemm2_push_kernel(
    region_ptr, region_off, act_ptr, w_ptr, d_ptr,  # our region, [R] int64, act [S, Ir], W2 [E, Ir, H] or its
                                                    # descriptor, D [S, H]
    bias_ptr,                             # BIAS: b2 [E, H] (rank 0 only: the planes add up to one copy)
    block_expert_ptr, slots_ptr, job_ptr, routing_g_ptr,  # [NB], [N, K], [N], [R, L] int32
    row_token_ptr,                        # SPLIT: [S] int32, read at row BM/2 of each block (half_tail)
    offsets_ptr,                          # PN_MAJOR or PAIR: [E+1] int32 expert_offsets
    queue_ptr,                            # QUEUE: [1] int32 kernel 2's tile queue, zeroed by the final reduce
    tiles_ptr,                            # [NB] int32 finished column tiles per block (MARKS each), monotonic
    disp_ptr, pushed_ptr,                 # [1] (disp[0]), [R] int32 local scratch, zeroed by the final reduce
    ctl_ptr, error_ptr, stats_ptr,
    rank, R, C, H, NB, Ir, E, L, stage_off, wm_off, max_spins,
    stride_am, stride_we, stride_wk, stride_om, stride_be,
    BIAS: tl.constexpr, W_DESC: tl.constexpr,
    K: tl.constexpr, KP: tl.constexpr, BH: tl.constexpr, JT: tl.constexpr,
    NUM_COMPUTE: tl.constexpr, NUM_PROGRAMS: tl.constexpr, JOIN: tl.constexpr, USE_PTX: tl.constexpr,
    SYNC: tl.constexpr, SPLIT: tl.constexpr, QUEUE: tl.constexpr, PN_MAJOR: tl.constexpr, PAIR: tl.constexpr,
    IEEE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid = tl.program_id(0)
    seq = tl.load(ctl_ptr)
    n_tiles = tl.cdiv(H, BN)
    n_pair = tl.cdiv(H, BN // 2)  # PAIR: column tiles of a pair tile
    # A block's tile counter gains MARKS per step: 1 per tile number of its own (n_tiles), or with PAIR
    # 2 per own number and 1 per number of its pair (2 * n_tiles numbers, each marks both blocks).
    MARKS: tl.constexpr = 2 if PAIR else 1
    if tl.load(error_ptr) == 0:
        if pid == 0:
            # Owners with no tokens get no job, so no last writer: publish for them now.
            for o in range(0, R):
                if tl.load(routing_g_ptr + o * L) == 0:
                    wm = region_of(region_ptr, region_off, o, tl.int32) + wm_off + rank
                    store_release(wm, seq, USE_PTX)
        t_join = now_ns(USE_PTX)
        if pid < NUM_COMPUTE:
            # -- compute: persistent grouped GEMM2; every tile number of every block is marked, used
            # or not (an empty pair slot too), so a block gains exactly MARKS * n_tiles per batch and
            # its target is seq * MARKS * n_tiles.
            tile = next_tile(queue_ptr, pid - NUM_COMPUTE, NUM_COMPUTE, QUEUE)
            while tile < NB * n_tiles:
                block, pn, expert, pair = tile_coords(tile, n_tiles, n_pair, block_expert_ptr, offsets_ptr,
                                                      row_token_ptr, E, PN_MAJOR, PAIR, SPLIT, BM)
                # The tile kind is a compile-time flag per call (grouped_gemm._grouped_gemm_kernel: why).
                if PAIR and pair != 0:  # an empty pair slot (expert == E) marks both blocks too
                    _gemm2_block(act_ptr, w_ptr, d_ptr, bias_ptr, row_token_ptr, tiles_ptr, block, expert, pn, E,
                                 H, Ir, stride_am, stride_we, stride_wk, stride_om, stride_be, BIAS, W_DESC,
                                 USE_PTX, SPLIT, True, MARKS, IEEE, EVEN_K, EVEN_N, BM, BN, BK)
                else:
                    _gemm2_block(act_ptr, w_ptr, d_ptr, bias_ptr, row_token_ptr, tiles_ptr, block, expert, pn, E,
                                 H, Ir, stride_am, stride_we, stride_wk, stride_om, stride_be, BIAS, W_DESC,
                                 USE_PTX, SPLIT, False, MARKS, IEEE, EVEN_K, EVEN_N, BM, BN, BK)
                tile = next_tile(queue_ptr, tile, NUM_COMPUTE, QUEUE)
            t_join = now_ns(USE_PTX)
        if (pid >= NUM_COMPUTE) | JOIN:
            # -- jobs: JT tokens per grab from the dispenser, in job_order ---------------------
            # A grab pays the fixed costs once (dispenser atomic, table loads, the wait, the CTA
            # barrier, the push counts) for JT tokens, and their K rows load in one go.
            tt = tl.arange(0, JT)  # [JT] tokens of the grab
            qq = tl.arange(0, JT * KP)  # [JT*KP] (token, k) lanes
            q_t, q_k = qq // KP, qq % KP
            hh = tl.arange(0, BH)  # [BH]
            n_real = tl.load(routing_g_ptr)  # real tokens: they come first in job_order
            for o in range(1, R):
                n_real += tl.load(routing_g_ptr + o * L)
            target = seq * (MARKS * n_tiles)
            j0 = tl.atomic_add(disp_ptr, JT, sem="relaxed", scope="gpu")
            go = j0 < n_real
            while go:
                live = (j0 + tt) < n_real  # [JT]
                g = tl.load(job_ptr + j0 + tt, mask=live, other=0)  # [JT]
                lq = ((j0 + q_t) < n_real) & (q_k < K)  # [JT*KP]
                gq = tl.load(job_ptr + j0 + q_t, mask=lq, other=0)  # [JT*KP] the token of each lane
                srow = tl.load(slots_ptr + gq * K + q_k, mask=lq, other=0)  # [JT*KP] its rows of D
                ok = j0 * 0 + 1
                if SYNC:
                    ok = wait_all_geq(tiles_ptr + srow // BM, lq, target, max_spins, USE_PTX)
                if ok == 0:
                    tl.atomic_cas(error_ptr, 0, ERR_JOB + tl.load(job_ptr + j0))
                    go = ok != 0
                else:
                    oq = gq // C
                    wbits = tl.load(routing_g_ptr + oq * L + META + C * K + (gq - oq * C) * K + q_k, mask=lq, other=0)
                    wq = wbits.to(tl.float32, bitcast=True)  # [JT*KP] routing weights (0 on dead lanes)
                    owner = g // C  # [JT]
                    # [JT] owners' planes for this source
                    dst = (region_of(region_ptr, region_off, owner, tl.float32)
                           + stage_off + (rank * C + g - owner * C).to(tl.int64) * H)
                    rows = d_ptr + srow.to(tl.int64)[:, None] * stride_om  # [JT*KP, 1]
                    for h0 in range(0, H, BH):
                        cols = h0 + hh
                        cm = cols < H
                        dv = tl.load(rows + cols[None, :], mask=lq[:, None] & cm[None, :], other=0.0)  # [JT*KP, BH]
                        prod = tl.reshape(dv.to(tl.float32) * wq[:, None], (JT, KP, BH))
                        part = tl.sum(prod, axis=1)  # [JT, BH] fp32 pre-reduce over k
                        tl.store(dst[:, None] + cols[None, :], part, mask=live[:, None] & cm[None, :])  # peer stores
                    # Count locally and elect the last writer per owner: all threads' stores,
                    # barrier, acq_rel counts (they chain every job's pushes), then one release
                    # store to each owner whose last token this was (no remote read-modify-write).
                    tl.debug_barrier()
                    old = tl.atomic_add(pushed_ptr + owner, 1, mask=live, sem="acq_rel", scope="sys")  # [JT]
                    last = live & (old + 1 == tl.load(routing_g_ptr + owner * L, mask=live, other=-1))
                    for t in tl.static_range(JT):
                        if tl.max(tl.where((tt == t) & last, 1, 0), axis=0) > 0:
                            o_t = tl.max(tl.where(tt == t, owner, 0), axis=0)
                            wm_slot = region_of(region_ptr, region_off, o_t, tl.int32) + wm_off + rank
                            store_release(wm_slot, seq, USE_PTX)
                    j0 = tl.atomic_add(disp_ptr, JT, sem="relaxed", scope="gpu")
                    go = j0 < n_real
            if pid < NUM_COMPUTE:
                tl.atomic_add(stats_ptr + 2, now_ns(USE_PTX) - t_join, sem="relaxed")


# ---------------------------------------------------------------------------------------------
# Final reduce.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _final_reduce_kernel(stage_ptr, wm_ptr, out_ptr, routing_g_ptr, disp_ptr, pushed_ptr, arrived_ptr,
                         ctl_ptr, error_ptr, stats_ptr,
                         rank, R, C, H, L, max_spins,
                         RP: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr, USE_PTX: tl.constexpr,
                         SYNC: tl.constexpr):
    """out[i] = sum_s staging[s, i] for this rank's rows i < n, once wm[s] >= seq for every s.
    stage_ptr [R, C, H] fp32 and wm_ptr [R] int32 are this rank's own (peers pushed into them)."""
    pid = tl.program_id(0)
    seq = tl.load(ctl_ptr)
    if pid == 0:
        # Kernels 1 and 2 are over (stream order): reset their local scratch for the next step
        # (the job dispenser and the two tile queues).
        tl.store(disp_ptr + tl.arange(0, 4), tl.zeros((4,), dtype=tl.int32), mask=tl.arange(0, 4) < 3)
        rr0 = tl.arange(0, RP)
        tl.store(pushed_ptr + rr0, tl.zeros((RP,), dtype=tl.int32), mask=rr0 < R)
    # Kernel 1 is over too: every token's arrival flag := seq, pulled or not, so no flag ever lags
    # its next target by more than one step (a token left unpulled for 2**31 steps would otherwise
    # read as arrived: the comparisons are wrap-safe only for lags below 2**31).
    tok = pid * (BR * R) + tl.arange(0, BR * RP)
    tl.store(arrived_ptr + tok, tl.zeros((BR * RP,), dtype=tl.int32) + seq,
             mask=(tl.arange(0, BR * RP) < BR * R) & (tok < R * C))
    n = tl.load(routing_g_ptr + rank * L)
    row0 = pid * BR
    if (tl.load(error_ptr) == 0) & ((row0 < n) | (pid == 0)):  # program 0 always checks the peers
        rr = tl.arange(0, RP)
        rmask = rr < R
        t0 = now_ns(USE_PTX)
        ok = 1
        if SYNC:
            ok = wait_all_geq(wm_ptr + tl.where(rmask, rr, 0), rmask, seq, max_spins, USE_PTX)
        if pid == 0:
            tl.store(stats_ptr + 3, now_ns(USE_PTX) - t0)
        if ok == 0:
            tl.atomic_cas(error_ptr, 0, ERR_WATERMARK)
        else:
            rows = row0 + tl.arange(0, BR)  # [BR]
            rm = rows < n
            hh = tl.arange(0, BH)
            for h0 in range(0, H, BH):
                cols = h0 + hh
                m = rm[:, None] & (cols < H)[None, :]  # [BR, BH]
                acc = tl.zeros((BR, BH), dtype=tl.float32)
                for s in range(0, R):
                    plane_rows = (s * C + rows.to(tl.int64))[:, None] * H
                    acc += tl.load(stage_ptr + plane_rows + cols[None, :], mask=m, other=0.0)
                tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], acc, mask=m)


# ---------------------------------------------------------------------------------------------
# Launchers: one argument structure (ThunderKittens' `globals`), one launch plan.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepArgs:
    """Everything one rank's step touches, as the kernels see it: sizes, this rank's symmetric
    region with its peers' distances and the element offsets of its parts, the local buffers and
    the weights. Built once per rank (service.moe.fused_buffers.RankBuffers.args); a captured
    graph replays on exactly these tensors."""

    rank: int
    R: int
    C: int
    H: int
    K: int
    E: int
    Ir: int
    L: int                     # int32 words of one routing block: META + 2*C*K
    region: torch.Tensor       # uint8 [nbytes] this rank's symmetric region
    region_off: torch.Tensor   # [R] int64 every region's distance from ours, in 16-byte units
    tok_off: int               # element offsets in any rank's region: tokens, pulled (layer dtype),
    pull_off: int
    rt_off: int                # routing, staging, watermarks, barrier slots (int32 / fp32 words)
    stage_off: int
    wm_off: int
    bar_off: int
    x_in: torch.Tensor         # [C, H] this step's inputs, written by the caller
    ids_in: torch.Tensor       # [C, K] int32
    w_in: torch.Tensor         # [C, K] fp32
    pulled: torch.Tensor       # [N, H] view of our region: remote tokens pulled by kernel 1
    staging: torch.Tensor      # [R, C, H] fp32 view of our region: plane s = pushes from rank s
    wm: torch.Tensor           # [R] int32 view of our region
    routing_g: torch.Tensor    # [R, L] int32 every rank's routing block
    act: torch.Tensor          # [S, Ir]
    D: torch.Tensor            # [S, H]
    out: torch.Tensor          # [C, H] fp32
    arrived: torch.Tensor      # [N + 1] int32 pulled-token arrivals; [N] a dummy
    tiles: torch.Tensor        # [NB] int32 finished GEMM2 column tiles per block
    disp: torch.Tensor         # [3] int32 kernel 2's job dispenser, kernel 1's and kernel 2's tile queues
    pushed: torch.Tensor       # [R] int32 jobs pushed per owner this step
    ctl: torch.Tensor          # [4] int32 seq, n, batch seq low, batch seq high
    error: torch.Tensor        # [1] int32
    stats: torch.Tensor        # [4] int64 ns (module docstring)
    w13: torch.Tensor          # [E, H, 2*Ir]
    w2: torch.Tensor           # [E, Ir, H]
    b13: torch.Tensor | None = None  # [E, 2*Ir]
    b2: torch.Tensor | None = None   # [E, H] (rank 0 only)
    activation: Activation = Activation()

    def __post_init__(self) -> None:
        """The layouts the kernels assume (checked once here, not per launch)."""
        R, C, H, K, E, Ir, N = self.R, self.C, self.H, self.K, self.E, self.Ir, self.R * self.C
        S = self.act.shape[0]
        assert S % BM == 0 and self.act.shape == (S, Ir) and self.D.shape == (S, H), "act [S, Ir] and D [S, H]"
        assert self.w13.shape == (E, H, 2 * Ir) and self.w2.shape == (E, Ir, H), "w13 [E, H, 2*Ir] and w2 [E, Ir, H]"
        for t in (self.act, self.D, self.w13, self.w2, self.pulled):
            assert t.stride(-1) == 1, "unit inner strides"
        assert self.pulled.shape == (N, H) and self.staging.shape == (R, C, H) and self.staging.is_contiguous()
        assert self.staging.dtype == torch.float32 and self.out.shape == (C, H) and self.out.is_contiguous()
        assert self.x_in.shape == (C, H) and self.x_in.is_contiguous()
        assert self.ids_in.shape == (C, K) and self.ids_in.dtype == torch.int32 and self.ids_in.is_contiguous()
        assert self.w_in.shape == (C, K) and self.w_in.dtype == torch.float32 and self.w_in.is_contiguous()
        assert self.routing_g.shape == (R, self.L) and self.routing_g.dtype == torch.int32
        assert self.arrived.shape == (N + 1,) and self.arrived.dtype == torch.int32
        assert self.b13 is None or (self.b13.shape == (E, 2 * Ir) and self.b13.dtype == self.w13.dtype
                                    and self.b13.stride(1) == 1)
        assert self.b2 is None or (self.b2.shape == (E, H) and self.b2.dtype == self.w2.dtype
                                   and self.b2.stride(1) == 1)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the kernels are launched: grid sizes, roles, tiles, bounds (service.moe.fused_plan
    chooses them for a device)."""

    num_programs: int
    num_comm1: int      # kernel 1 programs that pull (0 when R = 1: nothing is remote)
    num_compute2: int   # kernel 2 programs that run GEMM2 (the rest take jobs from the start)
    join: bool          # GEMM2 programs take jobs after their tiles
    config1: GemmConfig
    config2: GemmConfig
    max_spins: int = 1 << 22  # ~1 s at ~0.2 us per system-scope poll: far beyond an honest wait
    use_ptx: bool = True
    sync: bool = True   # False: every wait removed (benchmarks' compute-only run; garbage output)
    # Columns a kernel-2 job loads per step (K rows of them at once). Swept on an H200 at the seed
    # share, R=1 (bench/RESULTS.md): 512 -> job tail 360 us, 1024 -> 134, 2048 -> 66, 4096 -> 61.
    job_cols: int = 2048
    # Tokens a kernel-2 job takes per dispenser grab (their K rows load together; the fixed
    # costs of a job are paid once per grab). H200, seed share, R=1, job_cols 2048
    # (bench/RESULTS.md): 1 -> job tail 72 us, 2 -> 52, 4 -> 39 (fused 978 -> 919 us); narrower
    # columns lose (4 x 1024: 102, 8 x 512: 316).
    job_tokens: int = 4
    # Tokens a kernel-1 puller moves per iteration. H200, seed share, R=1, when kernel 1 still
    # wrote K rows per token (bench/RESULTS.md): 4 -> 1.17x serial, 8 -> 1.13x, 16 -> 1.21x.
    pull_tokens: int = 8

    def __post_init__(self) -> None:
        assert 0 < self.num_compute2 <= self.num_programs and (self.join or self.num_compute2 < self.num_programs), \
            "kernel 2: nobody takes jobs"
        assert self.job_tokens >= 1 and self.job_tokens & (self.job_tokens - 1) == 0, \
            f"job_tokens must be a power of two, got {self.job_tokens}"
        assert not (self.config1.cuda_tile or self.config2.cuda_tile), \
            "GemmConfig.cuda_tile is the serial GEMM1's: the fused kernels run the Triton tile"


def _p2(x: int) -> int:
    return triton.next_power_of_2(max(1, x))


STAGE_ROWS = 4  # rows per stage program
REDUCE_ROWS = 4  # rows per final-reduce program


def stage(a: StepArgs) -> None:
    """tokens[seq & 1][:n] <- x_in[:n], routing[seq & 1] ids / weights <- ids_in[:n], w_in[:n] (n = ctl[1])."""
    _stage_kernel[(triton.cdiv(a.C, STAGE_ROWS),)](
        a.x_in, a.ids_in, a.w_in, a.region, a.ctl, a.C, a.H, a.L, a.tok_off, a.rt_off,
        K=a.K, BR=STAGE_ROWS, BH=min(_p2(a.H), 1024), BRK=_p2(STAGE_ROWS * a.K), num_warps=4)


def exchange(a: StepArgs, plan: Plan) -> None:
    """routing_g [R, L] int32 <- every rank's routing block of this step, after the barrier."""
    _exchange_kernel[(1,)](a.region, a.region_off, a.routing_g, a.ctl, a.error, a.stats, a.rank, a.R, a.L, a.rt_off,
                           a.bar_off, plan.max_spins, RP=_p2(a.R), BL=1024, USE_PTX=plan.use_ptx, SYNC=plan.sync,
                           num_warps=4)


def ag_gemm1(a: StepArgs, plan: Plan, tables) -> None:
    """Kernel 1: act [S, Ir] = activation(A @ W13 (+ b13)) with A's rows read from the owners' token
    buffers (remote tokens pulled once into `pulled` [R*C, H], a view of this rank's region)."""
    N = a.R * a.C
    NB = tables.row_token.shape[0] // BM
    config = plan.config1
    assert tables.slots.shape[1] == a.K and tables.row_token.shape[0] == a.act.shape[0]
    assert 0 <= plan.num_comm1 < plan.num_programs and (plan.num_comm1 > 0 or a.R == 1), \
        "kernel 1 needs compute programs, and pullers when R > 1"
    epi = epilogue_args(a.activation)
    b13 = a.b13
    _ag_gemm1_kernel[(plan.num_programs,)](
        a.region, a.region_off, weight_operand(a.w13, config), a.act, b13 if b13 is not None else a.act,
        tables.slots, tables.pull_order, tables.row_token, tables.block_expert, tables.expert_offsets, a.disp[1:],
        a.arrived, a.ctl, a.error, a.stats,
        a.rank, N, a.C, a.H, NB, a.Ir, a.E, a.tok_off, a.pull_off, plan.max_spins, epi["limit"], epi["alpha"],
        a.w13.stride(0), a.w13.stride(1), a.act.stride(0), b13.stride(0) if b13 is not None else 0,
        ACT=epi["ACT"], CLAMP=epi["CLAMP"], BIAS=b13 is not None, W_DESC=config.w_desc,
        TB=plan.pull_tokens, BH=min(_p2(a.H), 1024), K=a.K, NUM_COMM=plan.num_comm1, NUM_PROGRAMS=plan.num_programs,
        USE_PTX=plan.use_ptx, SYNC=plan.sync, SPLIT=config.split_tail, QUEUE=config.queue, PN_MAJOR=config.pn_major,
        PAIR=config.pair, IEEE=a.w13.dtype == torch.float32, EVEN_K=a.H % config.BK == 0, EVEN_N=a.Ir % config.BN == 0,
        BM=BM, BN=config.BN, BK=config.BK, num_warps=config.num_warps, num_stages=config.num_stages,
    )


def gemm2_push(a: StepArgs, plan: Plan, tables) -> None:
    """Kernel 2: D [S, H] = act @ W2 (+ b2), then every global token's top-k sum pushed to its owner."""
    NB = a.act.shape[0] // BM
    config = plan.config2
    b2 = a.b2
    _gemm2_push_kernel[(plan.num_programs,)](
        a.region, a.region_off, a.act, weight_operand(a.w2, config), a.D, b2 if b2 is not None else a.D,
        tables.block_expert, tables.slots, tables.job_order, a.routing_g, tables.row_token, tables.expert_offsets,
        a.disp[2:], a.tiles, a.disp, a.pushed, a.ctl, a.error, a.stats,
        a.rank, a.R, a.C, a.H, NB, a.Ir, a.E, a.L, a.stage_off, a.wm_off, plan.max_spins,
        a.act.stride(0), a.w2.stride(0), a.w2.stride(1), a.D.stride(0), b2.stride(0) if b2 is not None else 0,
        BIAS=b2 is not None, W_DESC=config.w_desc, K=a.K, KP=_p2(a.K), BH=min(_p2(a.H), plan.job_cols),
        JT=plan.job_tokens, NUM_COMPUTE=plan.num_compute2, NUM_PROGRAMS=plan.num_programs,
        JOIN=plan.join, USE_PTX=plan.use_ptx, SYNC=plan.sync, SPLIT=config.split_tail, QUEUE=config.queue,
        PN_MAJOR=config.pn_major, PAIR=config.pair, IEEE=a.act.dtype == torch.float32, EVEN_K=a.Ir % config.BK == 0,
        EVEN_N=a.H % config.BN == 0,
        BM=BM, BN=config.BN, BK=config.BK, num_warps=config.num_warps, num_stages=config.num_stages,
    )


def final_reduce(a: StepArgs, plan: Plan) -> None:
    """out [C, H] fp32 (rows < n) = sum of this rank's R staging planes, after the watermarks."""
    _final_reduce_kernel[(triton.cdiv(a.C, REDUCE_ROWS),)](
        a.staging, a.wm, a.out, a.routing_g, a.disp, a.pushed, a.arrived, a.ctl, a.error, a.stats,
        a.rank, a.R, a.C, a.H, a.L, plan.max_spins,
        RP=_p2(a.R), BR=REDUCE_ROWS, BH=min(_p2(a.H), 1024), USE_PTX=plan.use_ptx, SYNC=plan.sync, num_warps=4,
    )
