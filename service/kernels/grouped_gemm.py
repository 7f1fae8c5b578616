"""Persistent grouped GEMM over the gathered layout (the serial layer's GEMMs; its tile is the fused kernels').

Dimension letters: S rows of the gathered layout, H hidden, Ir intermediate slice of this rank,
E experts, BM = 128 rows per block, N output columns, K reduction depth.

The gathered layout (service/moe/tables.py) sorts every (token, k) hit by expert and pads each
expert's run to a multiple of BM, so row block b belongs to exactly one expert,
`block_expert[b]` (E for blocks past `expert_offsets[E]`, which hold no rows). One launch then
computes, for every used row block b with expert e = block_expert[b]:

    GEMM1 (+SwiGLU):  act[rows_b] = silu(A[rows_b] @ W13[e][:, :Ir]) * (A[rows_b] @ W13[e][:, Ir:])
                      A [S, H], W13 [E, H, 2*Ir] -> act [S, Ir]
    GEMM2:            D[rows_b]   = act[rows_b] @ W2[e]
                      act [S, Ir], W2 [E, Ir, H] -> D [S, H]

with fp32 accumulation and the output in the input dtype. SwiGLU is fused: a GEMM1 tile of BN
output columns loads the BN gate columns and the BN matching up columns (they lie Ir apart in
W13[e]), keeps two fp32 accumulators and writes silu(g) * u; the pre-activation never reaches
memory.

Work and traffic per launch, with M = used rows = expert_offsets[E] (FLOP and byte formulas in
`flops()` / `bytes_moved()`):
    GEMM1: 2 * M * H * 2*Ir FLOP; reads A once per output-column tile and W13 of each used expert
           once per row block (L2 absorbs part of the re-reads: the tile order below), writes M * Ir.
    GEMM2: 2 * M * Ir * H FLOP; same pattern with N = H.
At the seed shape (16,384 hits, H=4096, Ir=768) GEMM1 is 206 GFLOP against 805 MB of W13 and
GEMM2 103 GFLOP against 403 MB of W2: close to the H200 ridge point, so tiles must be large.

Schedule: a persistent grid of min(ctas_per_sm * #SMs, tiles at capacity) programs walks the
tiles t = pid, pid + P, ... (the static walk), or, with GemmConfig.queue, takes them from an atomic
counter in order (`next_tile`), which the last program to finish rewinds to 0 (`queue_counter`).
Tile t is (row block t // n_tiles, column tile t % n_tiles), so
tiles come in row-block order, which is expert order; with GemmConfig.pn_major an expert's own
range is column-tile-major instead (`tile_coords`). Tiles whose block carries expert E are
skipped without loading anything: the grid is sized at capacity and needs no host sync.
Why the order matters (ncu on an H200, bench/RESULTS.md): GEMM1 at the seed share is DRAM-bound
on re-read weights; the blocks of one expert that share a weight column tile find it in L2 only
when they read it within microseconds of each other. The static walk lets the programs drift
apart (L2 hit rate 26-43 %); the queue starts sharers a few grabs apart (47 %).

Tail tiles (compile-time SPLIT, GemmConfig.split_tail): an expert's real rows lead its run, so
the padding of its last block is that block's tail. Given the layout's row_token, a block whose
row BM/2 is padding (row_token < 0) runs a BM/2-row tile and leaves its rows BM/2.. unwritten
(`half_tail`): an expert's padding then costs at most BM/2 - 1 computed rows instead of BM - 1
(seed share, balanced: 20,608 rows computed for 16,384 hits become 18,496; bench/NOTES.md).
GEMM2 given the same row_token skips the same rows, which GEMM1 did not write.

Pair tiles (compile-time PAIR, GemmConfig.pair): an expert's consecutive full row blocks b, b+1
run one tile of 2*BM rows x BN/2 output columns (GEMM1: gate + up, 2 x BN/2 weight columns),
so each weight K-slice is loaded once for 256 rows instead of once per block: the weight bytes per
FLOP halve while the accumulators (2 x 2*BM x BN/2 fp32) and the shared memory per stage
(GEMM1: 2*BM*BK + BK*BN elements, 48 KB at BN = 128, BK = 64, bf16; GEMM2 the same at its BN =
256) stay the BM-row tile's. `tile_coords` maps the unchanged tile numbering onto pairs (an
expert's odd last block and its half tail keep the BM-row tiles), so the grid and the queue need
nothing else (the fused kernel 2 counts a pair's tiles on both its blocks). At the seed
share GEMM1 is DRAM-bound on re-read weights (bench/NOTES.md, issue 12): this is the step that
reads W13 from DRAM once per pair instead of once per block, whatever the L2 keeps.

Row gather (compile-time GATHER): with `row_token [S]`, output row s reads row row_token[s] of A
(A is then the token matrix [N, H], not the gathered layout; -1 marks a padding row, whose output
nobody uses: it reads row s mod N, spread so that padding rows do not all hit one cache line).
GEMM1 then needs no scattered copy of the tokens: the K copies of a token are the same row of a
small matrix that stays in L2. Entries must lie in [-1, N): not checked (that would cost a sync).

No hooks: the fused kernels (service/kernels/fused_kernels.py) wait and signal in their own
loops (a row block's remote-token arrivals, kernel 2's per-tile marks of used and unused blocks),
so a gate and an epilogue hook here were exercised by tests alone and were removed.

The tile itself is `gemm_tile`, a jit function the fused kernels run too (Triton inlines it).

Limits: K tiles are masked (any H, Ir); N tiles are masked; the row count is a multiple of BM by
construction of the layout. bf16 / fp16 / fp32 inputs (fp32 dots run in IEEE fp32); the
interpreter (`TRITON_INTERPRET=1`) has no bf16: use fp16 / fp32 there.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from service.config import BM, Activation

# GEMM1 epilogue variants (the ACT constexpr; 0 = no activation, GEMM2), by Activation.kind.
ACT_SILU, ACT_GELU_TANH, ACT_GPT_OSS = tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
ACT_CODES = {"silu": 1, "gelu_tanh": 2, "gpt_oss": 3}
GELU_2C = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi)
GELU_A = tl.constexpr(0.044715)


def epilogue_args(act: Activation | None) -> dict:
    """The kernels' activation arguments for `act` (None: no activation, GEMM2): ACT, CLAMP
    (compile-time) and limit, alpha (runtime floats; unused values are 0)."""
    if act is None:
        return dict(ACT=0, CLAMP=False, limit=0.0, alpha=0.0)
    return dict(ACT=ACT_CODES[act.kind], CLAMP=act.limit is not None, limit=float(act.limit or 0.0),
                alpha=float(act.alpha) if act.kind == "gpt_oss" else 0.0)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One tile configuration. BM is fixed by the layout; BN counts output columns
    (for GEMM1 a tile loads 2*BN weight columns: BN gate + BN up)."""

    BN: int
    BK: int
    num_warps: int
    num_stages: int
    BM: int = BM
    # Weights read through a TMA tensor descriptor ([BK, BN] boxes of W viewed as [E*K, n_w]) instead
    # of per-thread pointer loads; needs K % BK == 0 and 16-byte aligned rows (`weight_operand`).
    w_desc: bool = False
    # Tail row blocks whose second half is padding run a BM // 2-row tile (`half_tail`), so the
    # padding of an expert's last block costs at most BM/2 - 1 rows instead of BM - 1. Needs the
    # layout's row_token (the launchers' `row_token`); without it every row counts as real.
    split_tail: bool = True
    # Programs per SM of the serial GEMMs' persistent grid (min(ctas_per_sm * #SMs, tiles)): 2 lets
    # one program's prologue and epilogue run under another's main loop, when two fit an SM's
    # shared memory (a tile's stages * (BM*BK + BK*BN*(2 if GEMM1 else 1)) * 2 B, <= 113 KB each
    # on sm_90). The fused kernels size their own grids (Plan.num_programs) and ignore it.
    ctas_per_sm: int = 1
    # Serial GEMMs: programs take tiles from an atomic counter in tile order (a dynamic persistent
    # schedule) instead of tiles pid, pid + P, ...: tiles that share weights or rows then start
    # close together, so that one DRAM read serves both from L2. The fused kernels honour it too (their
    # counters are the dispenser's disp[1] / disp[2], rewound by the final reduce).
    queue: bool = False
    # Within an expert's tiles, column-tile-major order (tile_coords): the blocks that share a weight
    # column tile are consecutive tiles. Needs the layout's expert_offsets (the launchers' argument).
    pn_major: bool = False
    # Two consecutive full row blocks of one expert run one pair tile of 2*BM rows x BN/2 columns
    # (GEMM1: gate + up each), which loads each weight K-slice once for both blocks (the weight
    # stream per FLOP halves; the accumulators keep the BM x BN tile's size). An expert's odd last
    # block and its half tail (split_tail) keep the BM-row tiles (tile_coords). Needs expert_offsets.
    pair: bool = False
    # GEMM1 of the serial backend (gemm1_swiglu) runs the Hopper CUDA tile of csrc/gemm_sm90
    # (service.kernels.cuda_tile: wgmma, TMA weights, a producer warp group for the gathered rows)
    # instead of the Triton kernel; an error where it cannot run (not sm_90, library built without
    # it, another activation, a bias), never a fallback. The tile is 128 x (128 gate + 128 up) x 64
    # with 4 stages, takes tiles from the queue and skips the padding half of tail blocks: the
    # config must say so (BN 128, BK 64, queue, split_tail; no pair, w_desc, pn_major). GEMM2 and the
    # fused kernels have no CUDA tile and refuse it.
    cuda_tile: bool = False
    # The CUDA tile's mainloop, one of service.kernels.cuda_tile.VARIANTS ("base", "n256", "noinc",
    # "mcast"; bench/NOTES.md "Issue 12t"): a tuned config can pick the one a GPU run found fastest.
    # Only with cuda_tile; the launch refuses a name it does not know.
    cuda_variant: str = "base"

    def __post_init__(self) -> None:
        assert self.BM == BM, f"the gathered layout fixes BM = {BM}, got {self.BM}"
        assert self.ctas_per_sm >= 1, f"ctas_per_sm must be >= 1, got {self.ctas_per_sm}"
        assert not self.pair or self.BN >= 32, f"a pair tile is BN/2 columns wide: BN must be >= 32, got {self.BN}"
        assert not (self.pair and self.w_desc), "pair tiles read the weights by pointer loads: w_desc's [BK, BN] " \
            "boxes are a BM-row tile's"
        assert not self.cuda_tile or (self.BN, self.BK, self.queue, self.split_tail, self.ctas_per_sm) == \
            (128, 64, True, True, 1) and not (self.pair or self.w_desc or self.pn_major), \
            f"the CUDA tile is BN=128, BK=64 with queue and split_tail, one CTA per SM, no pair, w_desc or " \
            f"pn_major: got {self}"
        assert self.cuda_tile or self.cuda_variant == "base", \
            f"cuda_variant {self.cuda_variant!r} is the CUDA tile's mainloop: it needs cuda_tile"
        for name in ("BN", "BK"):
            value = getattr(self, name)
            assert value >= 16 and value & (value - 1) == 0, f"{name} must be a power of two >= 16, got {value}"


# ---------------------------------------------------------------------------------------------
# The tile (also run by the fused kernels, service/kernels/fused_kernels.py).
# ---------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, w, acc, IEEE: tl.constexpr):
    if IEEE:
        acc = tl.dot(a, w, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _load_dot(a, w_ptrs, w_ok, acc, EVEN: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ W[w_ptrs]: one K step of one accumulator (masked loads unless EVEN)."""
    if EVEN:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=w_ok, other=0.0)
    return _dot(a, w, acc, IEEE)


@triton.jit
def gated_act(g, u, limit, alpha, ACT: tl.constexpr, CLAMP: tl.constexpr):
    """GEMM1's epilogue on fp32 gate / up accumulators (service.config.Activation has the maths):
    CLAMP first clamps g <= limit and -limit <= u <= limit; ACT 1 silu(g) * u, 2 gelu_tanh(g) * u,
    3 gpt-oss (u + 1) * g * sigmoid(alpha * g). Compile-time: one variant per kernel, no branch."""
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    if ACT == ACT_SILU:
        out = g * tl.sigmoid(g) * u
    elif ACT == ACT_GELU_TANH:
        # 0.5 * (1 + tanh(z)) == sigmoid(2z): gelu_tanh(g) = g * sigmoid(2 * sqrt(2/pi) * (g + 0.044715 g^3)),
        # one sigmoid instead of a tanh (which the interpreter lacks).
        out = g * tl.sigmoid(GELU_2C * (g + GELU_A * g * g * g)) * u
    else:
        out = (u + 1.0) * g * tl.sigmoid(alpha * g)
    return out


@triton.jit
def gemm_tile(a_ptr, a_rows, w_ptr, out_ptr, bias_ptr, block, expert, pn, ready, N, K, up_col, limit, alpha,
              stride_ak, stride_we, stride_wk, stride_wn, stride_om, stride_on, stride_be,
              ACT: tl.constexpr, CLAMP: tl.constexpr, BIAS: tl.constexpr, W_DESC: tl.constexpr,
              IEEE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
              BM: tl.constexpr, TM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out[the first TM rows of row block `block` (BM rows), column tile `pn`] = A @ W[expert] (ACT > 0:
    gated_act(gate, up), two accumulators); one TM x BN output tile, the K loop inside. TM is BM,
    BM // 2 for a tail block whose second half is padding (`half_tail`), or 2 * BM for a pair tile
    (`block` and the next block of the same expert, contiguous in the layout; its caller passes
    the config's BN // 2 as BN, and EVEN_N of the config's BN, which implies it for BN // 2). The TM input rows start at
    `a_ptr + a_rows` ([TM] int64 element offsets: `rows * stride_am` for a contiguous A, or any
    gather of rows, e.g. a token per row); output rows are the block's. BIAS adds
    bias[expert, cols] (and bias[expert, up_col + cols] to the up half) before the activation.
    W_DESC: `w_ptr` is a tensor descriptor of W as [E*K, n_w] with [BK, BN] boxes (`weight_operand`),
    so the weight tiles come through the TMA copy engine; box columns past n_w read zeros, and gate
    columns past N (which read up columns) only feed output columns the store masks.
    `ready` is the caller's gate verdict, 1 when it calls (a data dependency, see below). Triton
    inlines it into the caller."""
    tl.static_assert(EVEN_K or not W_DESC, "weight descriptors need K % BK == 0 (a box must not cross experts)")
    k_steps = tl.cdiv(K, BK)
    # (ready - 1) == 0: a data dependency of the row offsets on the gate's result, insurance
    # against a compiler hoisting the A loads above the wait (times 16, so the offsets keep their
    # proven alignment and the loads stay 16-byte vectors).
    a_rows = a_rows + (ready - 1) * 16  # [TM]
    rows = block.to(tl.int64) * BM + tl.arange(0, TM)  # [TM] output rows
    cols = pn * BN + tl.arange(0, BN)  # [BN] output columns
    cols = tl.max_contiguous(tl.multiple_of(cols, BN), BN)
    ks = tl.arange(0, BK)  # [BK]
    a_ptrs = a_ptr + a_rows[:, None] + ks[None, :] * stride_ak  # [TM, BK]
    acc = tl.zeros((TM, BN), dtype=tl.float32)  # gate (GEMM1) or output (GEMM2)
    acc_up = tl.zeros((TM, BN), dtype=tl.float32)  # up half, GEMM1 only
    col_ok = cols[None, :] < N  # [1, BN] masks the last column tile when N % BN != 0
    if W_DESC:
        w_row = expert * K  # first row of W[expert] in the [E*K, n_w] view
        for kk in range(0, k_steps):
            a = tl.load(a_ptrs)  # EVEN_K (asserted above)
            acc = _dot(a, w_ptr.load([w_row + kk * BK, pn * BN]), acc, IEEE)
            if ACT != 0:
                acc_up = _dot(a, w_ptr.load([w_row + kk * BK, up_col + pn * BN]), acc_up, IEEE)
            a_ptrs += BK * stride_ak
    else:
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        g_ptrs = w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn  # [BK, BN]
        for kk in range(0, k_steps):
            k_left = K - kk * BK  # masks the last K step when K % BK != 0
            if EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
            w_ok = (ks[:, None] < k_left) & col_ok  # [BK, BN], used unless EVEN_K and EVEN_N
            acc = _load_dot(a, g_ptrs, w_ok, acc, EVEN_K and EVEN_N, IEEE)
            if ACT != 0:
                u_ptrs = g_ptrs + up_col * stride_wn  # the matching up columns, Ir to the right
                acc_up = _load_dot(a, u_ptrs, w_ok, acc_up, EVEN_K and EVEN_N, IEEE)
            a_ptrs += BK * stride_ak
            g_ptrs += BK * stride_wk
    if BIAS:
        b_ptrs = bias_ptr + expert.to(tl.int64) * stride_be + cols  # [BN]
        acc += tl.load(b_ptrs, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:
            acc_up += tl.load(b_ptrs + up_col, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if ACT != 0:
        acc = gated_act(acc, acc_up, limit, alpha, ACT, CLAMP)  # in fp32
    o_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on  # [TM, BN]
    if EVEN_N:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty))
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


# ---------------------------------------------------------------------------------------------
# The kernel.
# ---------------------------------------------------------------------------------------------


@triton.jit
def half_tail(row_token_ptr, block, SPLIT: tl.constexpr, BM: tl.constexpr):
    """Whether row block `block` runs a BM // 2-row tile: with SPLIT, when its rows BM/2.. are
    padding (row_token < 0 at row BM/2; an expert's real rows lead its run, so the rest of the
    block is padding too). Without SPLIT never, a compile-time False: the half tile is not built."""
    if SPLIT:
        return tl.load(row_token_ptr + block.to(tl.int64) * BM + BM // 2) < 0
    else:
        return tl.constexpr(False)


@triton.jit
def tile_coords(tile, n_tiles, n_pair, block_expert_ptr, offsets_ptr, row_token_ptr, num_experts,
                PN_MAJOR: tl.constexpr, PAIR: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr):
    """(row block, column tile, expert, pair) of tile number `tile`. Tiles are numbered block by block,
    n_tiles per block (an expert's tiles are one contiguous range of nb * n_tiles, experts in order);
    within an expert's range the order is block-major (column tile minor) or, with PN_MAJOR,
    column-tile-major: the expert's blocks that share a weight column tile come one after another.
    expert == num_experts: nothing to compute (a block past the last expert, or an empty pair slot).
    PAIR: the expert's range starts with its pairs of full blocks (blocks b0 + 2p, b0 + 2p + 1 for
    p < n_pairs = full // 2; `full` counts the blocks that run a BM-row tile, all but a SPLIT half
    tail): pair p owns 2 * n_tiles of the range's numbers, of which the first n_pair =
    cdiv(N, BN/2) are its column tiles of BN/2 columns (2 * cdiv(N, BN) >= n_pair; the rest are
    empty); pair == 1 and `block` is the pair's first block. The unpaired blocks (an odd last one,
    the half tail) follow with today's tiles. The numbering, grid and queue stay as without PAIR."""
    block = tile // n_tiles
    pn = tile % n_tiles
    expert = tl.load(block_expert_ptr + block)
    pair = tile * 0
    if PN_MAJOR or PAIR:
        if expert < num_experts:
            b0 = tl.load(offsets_ptr + expert) // BM  # the expert's first block, and its block count
            nb = tl.load(offsets_ptr + expert + 1) // BM - b0
            local = tile - b0 * n_tiles  # [0, nb * n_tiles): the tile's place in the expert's range
            n_pairs = 0
            if PAIR:
                full = nb
                if half_tail(row_token_ptr, b0 + nb - 1, SPLIT, BM):
                    full = nb - 1
                n_pairs = full // 2
            pair_slots = 2 * n_tiles * n_pairs
            pair = (local < pair_slots).to(tl.int32)
            rest = local - pair_slots  # the place among the unpaired blocks' tiles (when pair == 0)
            n_rest = tl.maximum(nb - 2 * n_pairs, 1)  # (1 when there are none: no division by 0)
            if PN_MAJOR:
                q = local // tl.maximum(n_pairs, 1)  # pair column tile, and the pair
                p = local % tl.maximum(n_pairs, 1)
                r_block = rest % n_rest
                r_pn = rest // n_rest
            else:
                p = local // (2 * n_tiles)
                q = local % (2 * n_tiles)
                r_block = rest // n_tiles
                r_pn = rest % n_tiles
            block = tl.where(pair != 0, b0 + 2 * p, b0 + 2 * n_pairs + r_block)
            pn = tl.where(pair != 0, q, r_pn)
            expert = tl.where((pair != 0) & (q >= n_pair), num_experts, expert)  # an empty pair slot
    return block, pn, expert, pair


@triton.jit
def next_tile(queue_ptr, tile, step, QUEUE: tl.constexpr):
    """A persistent program's next tile: from the tile queue (an atomic counter, 0 at launch, in
    tile order to whichever program asks) with QUEUE, else `tile + step` (the static walk; the
    first tile is the program's id). Call with tile = -1 for the first tile under QUEUE."""
    if QUEUE:
        return tl.atomic_add(queue_ptr, 1, sem="relaxed")
    else:
        return tile + step


@triton.jit
def _grouped_tile(a_ptr, w_ptr, out_ptr, bias_ptr, row_token_ptr, block, expert, pn, N, K, num_a_rows, up_col,
                  limit, alpha, stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_om, stride_on, stride_be,
                  ACT: tl.constexpr, CLAMP: tl.constexpr, BIAS: tl.constexpr, W_DESC: tl.constexpr,
                  GATHER: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                  BM: tl.constexpr, TM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One tile of the serial GEMMs: the first TM rows of `block`, gathered through row_token or not."""
    rows = block.to(tl.int64) * BM + tl.arange(0, TM)  # [TM]
    if GATHER:
        # Padding rows read row s mod M: any valid row, but spread. All on one row,
        # a quarter of the layout would hammer one L2 slice (measured: GEMM1 1.4x slower).
        rt = tl.load(row_token_ptr + rows)
        rows = tl.where(rt >= 0, rt, rows % num_a_rows).to(tl.int64)  # [TM] rows of A
    gemm_tile(a_ptr, rows * stride_am, w_ptr, out_ptr, bias_ptr, block, expert, pn, 1, N, K, up_col,
              limit, alpha, stride_ak, stride_we, stride_wk, stride_wn, stride_om, stride_on, stride_be,
              ACT, CLAMP, BIAS, W_DESC, IEEE, EVEN_K, EVEN_N, BM, TM, BN, BK)


@triton.jit
def _grouped_block(a_ptr, w_ptr, out_ptr, bias_ptr, row_token_ptr, block, expert, pn, N, K, num_a_rows, up_col,
                   limit, alpha, stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_om, stride_on, stride_be,
                   ACT: tl.constexpr, CLAMP: tl.constexpr, BIAS: tl.constexpr, W_DESC: tl.constexpr,
                   GATHER: tl.constexpr, SPLIT: tl.constexpr, PAIR_TILE: tl.constexpr, IEEE: tl.constexpr,
                   EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The serial GEMMs' tile for one tile number: PAIR_TILE, blocks `block` and `block + 1` in one
    2*BM x BN/2 tile (one weight stream for 2*BM rows); else a BM/2-row tile for a half tail, a
    BM-row tile otherwise."""
    if PAIR_TILE:
        _grouped_tile(a_ptr, w_ptr, out_ptr, bias_ptr, row_token_ptr, block, expert, pn, N, K, num_a_rows,
                      up_col, limit, alpha, stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_om,
                      stride_on, stride_be, ACT, CLAMP, BIAS, W_DESC, GATHER, IEEE, EVEN_K, EVEN_N,
                      BM, 2 * BM, BN // 2, BK)
    elif half_tail(row_token_ptr, block, SPLIT, BM):
        _grouped_tile(a_ptr, w_ptr, out_ptr, bias_ptr, row_token_ptr, block, expert, pn, N, K, num_a_rows,
                      up_col, limit, alpha, stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_om,
                      stride_on, stride_be, ACT, CLAMP, BIAS, W_DESC, GATHER, IEEE, EVEN_K, EVEN_N,
                      BM, BM // 2, BN, BK)
    else:
        _grouped_tile(a_ptr, w_ptr, out_ptr, bias_ptr, row_token_ptr, block, expert, pn, N, K, num_a_rows,
                      up_col, limit, alpha, stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_om,
                      stride_on, stride_be, ACT, CLAMP, BIAS, W_DESC, GATHER, IEEE, EVEN_K, EVEN_N,
                      BM, BM, BN, BK)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr,            # A [S, K], W [E, K, n_w] (W_DESC: its descriptor), out [S, N]
    bias_ptr,                         # BIAS: [E, n_w] added before the activation (GEMM1) or to out (GEMM2)
    block_expert_ptr,                 # [S/BM] int32, E = unused block
    offsets_ptr,                      # PN_MAJOR or PAIR: [E+1] int32 expert_offsets (padded; multiples of BM)
    row_token_ptr,                    # GATHER or SPLIT: [S] int32 row of A for output row s (-1: padding)
    queue_ptr,                        # QUEUE: [2] int32, 0 at launch: the next tile to take, programs done
    num_blocks, N, K, num_experts, num_a_rows,
    up_col,                           # ACT > 0: column of W where the up half starts (Ir)
    limit, alpha,                     # fp32: the activation's clamp bound and gpt-oss's alpha
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_om, stride_on, stride_be,
    ACT: tl.constexpr, CLAMP: tl.constexpr, BIAS: tl.constexpr, W_DESC: tl.constexpr, GATHER: tl.constexpr,
    SPLIT: tl.constexpr, QUEUE: tl.constexpr, PN_MAJOR: tl.constexpr, PAIR: tl.constexpr,
    IEEE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    n_pair = tl.cdiv(N, BN // 2)  # PAIR: column tiles of a pair tile
    num_tiles = num_blocks * n_tiles
    # QUEUE: tiles in tile order to whichever program is free, so that tiles sharing an expert's
    # weight columns or a block's rows start close together and the second reader finds them in
    # L2; else the static walk pid, pid + P, ...
    tile = next_tile(queue_ptr, pid - NUM_PROGRAMS, NUM_PROGRAMS, QUEUE)
    while tile < num_tiles:
        block, pn, expert, pair = tile_coords(tile, n_tiles, n_pair, block_expert_ptr, offsets_ptr, row_token_ptr,
                                              num_experts, PN_MAJOR, PAIR, SPLIT, BM)
        if expert < num_experts:  # expert == E: block past the last expert (no rows) or an empty pair slot
            # The tile kind is a compile-time flag per call: `PAIR and pair != 0` is a constexpr False
            # without PAIR, so those kernels build no pair tile (which a weight descriptor's BN-wide
            # boxes could not even compile); a runtime flag would build it into every kernel.
            if PAIR and pair != 0:
                _grouped_block(a_ptr, w_ptr, out_ptr, bias_ptr, row_token_ptr, block, expert, pn, N, K,
                               num_a_rows, up_col, limit, alpha, stride_am, stride_ak, stride_we, stride_wk,
                               stride_wn, stride_om, stride_on, stride_be, ACT, CLAMP, BIAS, W_DESC, GATHER,
                               SPLIT, True, IEEE, EVEN_K, EVEN_N, BM, BN, BK)
            else:
                _grouped_block(a_ptr, w_ptr, out_ptr, bias_ptr, row_token_ptr, block, expert, pn, N, K,
                               num_a_rows, up_col, limit, alpha, stride_am, stride_ak, stride_we, stride_wk,
                               stride_wn, stride_om, stride_on, stride_be, ACT, CLAMP, BIAS, W_DESC, GATHER,
                               SPLIT, False, IEEE, EVEN_K, EVEN_N, BM, BN, BK)
        tile = next_tile(queue_ptr, tile, NUM_PROGRAMS, QUEUE)
    if QUEUE:  # the last program out rewinds the counter for the next launch (`queue_counter`)
        done = tl.atomic_add(queue_ptr + 1, 1, sem="acq_rel")  # after this program's last grab
        if done == NUM_PROGRAMS - 1:  # every program has taken its last tile number: nobody reads it again
            tl.atomic_xchg(queue_ptr, 0, sem="relaxed")
            tl.atomic_xchg(queue_ptr + 1, 0, sem="relaxed")


# ---------------------------------------------------------------------------------------------
# Launchers.
# ---------------------------------------------------------------------------------------------

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _interpreting() -> bool:
    return triton.knobs.runtime.interpret


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter runs programs one after another; a few show the persistent walk


def grid_size(num_blocks: int, n: int, config: GemmConfig, device: torch.device,
              num_programs: int | None = None) -> int:
    """min(ctas_per_sm * #SMs, tiles at capacity): every program resident, no idle programs."""
    tiles = num_blocks * triton.cdiv(n, config.BN)
    return max(1, min(num_programs or config.ctas_per_sm * num_sms(device), tiles))


def weight_operand(w: torch.Tensor, config: GemmConfig):
    """What a kernel's `w_ptr` gets for W [E, K, n_w]: W itself, or with `config.w_desc` a TMA
    tensor descriptor of W as [E*K, n_w] with [BK, BN] boxes (ValueError when W cannot have one:
    the switch is never dropped silently)."""
    if not config.w_desc:
        return w
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, K, n_w = w.shape
    if K % config.BK or w.stride(2) != 1 or w.stride(0) != K * w.stride(1):
        raise ValueError(f"a weight descriptor needs K % BK == 0 and rows of W [E, K, n_w] one after another, got "
                         f"K={K}, BK={config.BK}, strides {w.stride()}")
    if (w.stride(1) * w.element_size()) % 16 or w.data_ptr() % 16:
        raise ValueError(f"a weight descriptor needs 16-byte aligned rows, got n_w={n_w} {w.dtype}")
    return TensorDescriptor(w, [E * K, n_w], [w.stride(1), 1], [config.BK, config.BN])


def queue_counter(device: torch.device) -> torch.Tensor:
    """A tile queue's counter, [2] int32 zeros: the next tile number and the programs done. A launch
    with GemmConfig.queue (or the CUDA tile) leaves it zero again (its last program rewinds it), so
    a caller that launches one GEMM after another on one stream allocates it once and passes it as
    `queue` (the serial layer does), instead of a fresh zeroed tensor per launch."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def check_queue(queue: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The counter a launch uses: `queue` (checked) or a fresh one."""
    if queue is None:
        return queue_counter(device)
    if queue.dtype != torch.int32 or queue.shape != (2,) or queue.device != device:
        raise ValueError(f"queue must be int32 [2] on {device} (queue_counter), got {queue.dtype} "
                         f"{list(queue.shape)} on {queue.device}")
    return queue


def _launch(a, w, out, block_expert, *, n, up_col, act, bias, config, num_programs, row_token=None,
            gather=False, expert_offsets=None, queue=None):
    K = a.shape[1]
    S = row_token.shape[0] if gather else a.shape[0]
    E = w.shape[0]
    if a.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"input dtype must be one of {_SUPPORTED_DTYPES}, got {a.dtype}")
    if w.dtype != a.dtype or out.dtype != a.dtype:
        raise TypeError(f"a, w and out must share one dtype, got {a.dtype}, {w.dtype}, {out.dtype}")
    if S % BM:
        raise ValueError(f"rows of the gathered layout must be a multiple of BM={BM}, got S={S}")
    if w.shape[1] != K:
        raise ValueError(f"w has K={w.shape[1]} rows per expert, a has K={K} columns")
    if out.shape != (S, n):
        raise ValueError(f"out must be [{S}, {n}], got {list(out.shape)}")
    if block_expert.shape != (S // BM,) or block_expert.dtype != torch.int32:
        raise ValueError(f"block_expert must be int32 [{S // BM}], got {block_expert.dtype} {list(block_expert.shape)}")
    tensors = [a, w, out, block_expert]
    if bias is not None:
        if bias.shape != (E, w.shape[2]) or bias.dtype != a.dtype or bias.stride(1) != 1:
            raise ValueError(f"bias must be [{E}, {w.shape[2]}] {a.dtype} with unit column stride, got "
                             f"{bias.dtype} {list(bias.shape)}")
        tensors.append(bias)
    if row_token is not None:
        if row_token.dtype != torch.int32 or row_token.shape != (S,):
            raise ValueError(f"row_token must be int32 [{S}], got {row_token.dtype} {list(row_token.shape)}")
        if gather and a.shape[0] == 0:
            raise ValueError("a gathered launch needs at least one row of A (padding rows read one)")
        tensors.append(row_token)
    if config.pn_major or config.pair:
        if expert_offsets is None:
            raise ValueError("GemmConfig.pn_major and pair order tiles by the layout's expert_offsets: pass "
                             "expert_offsets")
        if expert_offsets.shape != (E + 1,) or expert_offsets.dtype != torch.int32:
            raise ValueError(f"expert_offsets must be int32 [{E + 1}], got {expert_offsets.dtype} "
                             f"{list(expert_offsets.shape)}")
        tensors.append(expert_offsets)
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    if a.device.type != "cuda" and not _interpreting():
        raise RuntimeError("the Triton grouped GEMM needs a CUDA device or TRITON_INTERPRET=1")

    P = grid_size(S // BM, n, config, a.device, num_programs)
    epi = epilogue_args(act)
    _grouped_gemm_kernel[(P,)](
        a, weight_operand(w, config), out, bias if bias is not None else out, block_expert,
        expert_offsets if config.pn_major or config.pair else block_expert,  # a dummy pointer without them
        row_token if row_token is not None else block_expert,  # a dummy pointer when GATHER and SPLIT are off
        check_queue(queue, a.device) if config.queue else block_expert,  # QUEUE's counter
        S // BM, n, K, E, a.shape[0], up_col, epi["limit"], epi["alpha"],
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        bias.stride(0) if bias is not None else 0,
        ACT=epi["ACT"], CLAMP=epi["CLAMP"], BIAS=bias is not None, W_DESC=config.w_desc, GATHER=gather,
        SPLIT=config.split_tail and row_token is not None, QUEUE=config.queue, PN_MAJOR=config.pn_major,
        PAIR=config.pair, IEEE=a.dtype == torch.float32, EVEN_K=K % config.BK == 0, EVEN_N=n % config.BN == 0,
        BM=BM, BN=config.BN, BK=config.BK, NUM_PROGRAMS=P,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def gemm1_swiglu(a, w13, block_expert, *, config: GemmConfig, out=None, num_programs=None, row_token=None,
                 act: Activation = Activation(), bias=None, expert_offsets=None, queue=None):
    """act [S, Ir] = act(A @ W13[e][:, :Ir] (+ b13[e, :Ir]), A @ W13[e][:, Ir:] (+ b13[e, Ir:])) per row
    block (e = block_expert[b]); `act` defaults to silu(g) * u.

    a [S, H], w13 [E, H, 2*Ir], block_expert [S/BM] int32, bias b13 [E, 2*Ir] or None. Rows of unused
    blocks are not written. With row_token [S] int32, a is [N, H] and row s of A is a[row_token[s]]
    (padding rows: -1), and with config.split_tail rows BM/2.. of a block whose row BM/2 is padding
    are not written either. expert_offsets [E+1] int32 (the layout's) is needed by config.pn_major and
    config.pair. queue: a `queue_counter` to reuse (config.queue and the CUDA tile), else a fresh one.
    """
    if config.cuda_tile:  # the Hopper tile (GemmConfig.cuda_tile); it raises where it cannot run
        from service.kernels import cuda_tile

        return cuda_tile.gemm1_swiglu(a, w13, block_expert, out=out, num_programs=num_programs,
                                      row_token=row_token, act=act, bias=bias, queue=queue,
                                      variant=config.cuda_variant)
    if w13.dim() != 3 or w13.shape[2] % 2:
        raise ValueError(f"w13 must be [E, H, 2*Ir], got {list(w13.shape)}")
    Ir = w13.shape[2] // 2
    if out is None:
        S = a.shape[0] if row_token is None else row_token.shape[0]
        out = torch.empty((S, Ir), dtype=a.dtype, device=a.device)
    return _launch(a, w13, out, block_expert, n=Ir, up_col=Ir, act=act, bias=bias, config=config,
                   num_programs=num_programs, row_token=row_token, gather=row_token is not None,
                   expert_offsets=expert_offsets, queue=queue)


def gemm2(act, w2, block_expert, *, config: GemmConfig, out=None, num_programs=None, bias=None, row_token=None,
          expert_offsets=None, queue=None):
    """D [S, H] = act @ W2[e] (+ b2[e]) per row block (e = block_expert[b]).

    act [S, Ir], w2 [E, Ir, H], block_expert [S/BM] int32, bias b2 [E, H] or None. Rows of unused
    blocks are not written. row_token [S] int32 (the layout's; only its signs are read) lets
    config.split_tail skip the padding half of tail blocks, as GEMM1 does (and config.pair pair the
    same blocks GEMM1 pairs); expert_offsets and queue as GEMM1's.
    """
    if config.cuda_tile:
        raise ValueError("GemmConfig.cuda_tile is GEMM1's: GEMM2 has no CUDA tile")
    if w2.dim() != 3:
        raise ValueError(f"w2 must be [E, Ir, H], got {list(w2.shape)}")
    H = w2.shape[2]
    if out is None:
        out = torch.empty((act.shape[0], H), dtype=act.dtype, device=act.device)
    return _launch(act, w2, out, block_expert, n=H, up_col=0, act=None, bias=bias, config=config,
                   num_programs=num_programs, row_token=row_token, expert_offsets=expert_offsets, queue=queue)


# ---------------------------------------------------------------------------------------------
# References (fp32, plain) and cost formulas.
# ---------------------------------------------------------------------------------------------


def _row_experts(block_expert: torch.Tensor) -> torch.Tensor:
    return block_expert.long().repeat_interleave(BM)  # [S]


def gemm1_swiglu_ref(a, w13, block_expert, act: Activation = Activation(), bias=None) -> torch.Tensor:
    """fp32 reference of gemm1_swiglu; rows of unused blocks are 0."""

    E, _, two_ir = w13.shape
    Ir = two_ir // 2
    experts = _row_experts(block_expert)
    a32, w32 = a.float(), w13.float()
    out = torch.zeros(a.shape[0], Ir, dtype=torch.float32, device=a.device)
    for e in experts.unique().tolist():
        if e >= E:
            continue
        rows = experts == e
        h = a32[rows] @ w32[e]  # [rows, 2*Ir]
        if bias is not None:
            h = h + bias[e].float()
        out[rows] = act.apply(h[:, :Ir], h[:, Ir:])
    return out


def gemm2_ref(act, w2, block_expert, bias=None) -> torch.Tensor:
    """fp32 reference of gemm2; rows of unused blocks are 0."""
    E, _, H = w2.shape
    experts = _row_experts(block_expert)
    a32, w32 = act.float(), w2.float()
    out = torch.zeros(act.shape[0], H, dtype=torch.float32, device=act.device)
    for e in experts.unique().tolist():
        if e >= E:
            continue
        rows = experts == e
        out[rows] = a32[rows] @ w32[e] + (bias[e].float() if bias is not None else 0.0)
    return out


def flops(rows: int, k: int, n: int, swiglu: bool) -> int:
    """Useful FLOP of one launch over `rows` used rows (padding rows included if counted)."""
    return 2 * rows * k * n * (2 if swiglu else 1)


def bytes_moved(rows: int, k: int, n: int, experts_used: int, swiglu: bool, itemsize: int = 2) -> int:
    """Compulsory traffic: A and out once, the weights of the used experts once."""
    w_cols = 2 * n if swiglu else n
    return itemsize * (rows * k + rows * n + experts_used * k * w_cols)
