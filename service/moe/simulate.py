"""CPU dataflow simulation of the fused backend (ARCHITECTURE.md section 3, "fused"), tests only.

It moves the data the way the three launches do, with the real schedule tables, so that a table
or ordering mistake shows up as a wrong answer or a failed wait rather than in a GPU hang:

    kernel 1  pull each remote global token once, in pull_order, from its owner's token buffer
              into `pulled` [N, H] and mark it arrived. Compute walks row blocks in order, waits
              (here: pulls until) every remote token of the block arrived, then GEMM1 + SwiGLU
              -> act [S, Ir], reading row s as token row_token[s] in place (own tokens from the
              token buffer, remote ones from `pulled`).
    kernel 2  GEMM2 per row block -> D [S, H], marking the block done. Jobs are taken in
              job_order as soon as all K slot rows are done: fp32 sum over k of
              w[g, k] * D[slots[g, k]], pushed into the owner's staging plane for this source rank
              ([R, C, H] per owner). The last job for an owner publishes this rank's watermark.
              (The kernel hands out grabs of job_tokens tokens, so a ready token may wait for the
              unready ones of its grab: a matter of time only; results and watermarks are the same.
              The model takes one token at a time.)
    reduce    each owner waits for all R watermarks to reach seq, sums its R planes -> out_r.

Besides the numbers, it asserts the orders' purpose at row-block granularity: when block b's
tokens have arrived, no token pulled so far is needed only by later blocks; after GEMM2 of block b, no ready
job waits behind an unready one in the dispenser.

Watermarks are not zeroed between batches (ARCHITECTURE.md 5.4): they start where the previous
batch (seq - 1) left them, and every target is a function of seq. Buffers the kernels never
initialize (token buffer tails, pulled tokens, D, staging planes) are filled with NaN, so a read
of a row the schedule says is garbage poisons the result instead of passing silently.

Dimension letters: N = R*C global tokens, n_r tokens on rank r, NB = S / BM row blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from service.config import BM, Activation
from service.moe.tables import Tables, build_tables


def _global_routing(ids: list[Tensor], ws: list[Tensor], C: int, K: int) -> tuple[Tensor, Tensor, Tensor]:
    """The all-gather of routing: ids, weights [R*C, K] and counts [R]; padding rows hold garbage ids."""
    R = len(ids)
    ids_g = torch.full((R * C, K), -7, dtype=torch.int64)           # [R*C, K] garbage: must be ignored
    w_g = torch.full((R * C, K), float("nan"))                      # [R*C, K]
    counts = torch.tensor([i.shape[0] for i in ids], dtype=torch.int64)  # [R]
    for r in range(R):
        n = ids[r].shape[0]
        ids_g[r * C:r * C + n] = ids[r]
        w_g[r * C:r * C + n] = ws[r].float()
    return ids_g, w_g, counts


def _unused(tables: Tables) -> int:
    """block_expert's marker for the blocks past off[E]: E."""
    return tables.expert_offsets.shape[0] - 1


def _kernel1(r: int, tables: Tables, bufs: list[Tensor], w13: Tensor, C: int, act_fn: Activation,
             b13: Tensor | None) -> Tensor:
    """AllGather (+) GEMM1 (+) the gated activation (gate / up biases b13 [E, 2*Ir] first) on rank r -> act [S, Ir]."""
    H = bufs[0].shape[1]
    Ir = w13.shape[2] // 2
    slots = tables.slots.tolist()                                    # [N][K]
    pull = tables.pull_order.tolist()
    row_token = tables.row_token.tolist()                            # [S]
    pulled = torch.full((len(slots), H), float("nan"))               # [N, H] remote tokens, once each
    arrived = [False] * len(slots)
    act = torch.full((tables.S, Ir), float("nan"))                   # [S, Ir]
    next_pull = 0

    def remote(g: int) -> bool:
        return g // C != r

    for b in range(tables.num_blocks):
        e = int(tables.block_expert[b])
        if e == _unused(tables):
            continue
        rows = range(b * BM, (b + 1) * BM)
        need = {row_token[s] for s in rows if row_token[s] >= 0 and remote(row_token[s])}
        # Gate: comm programs keep pulling (in pull_order) until this block's remote tokens arrived.
        while not all(arrived[g] for g in need):
            assert next_pull < len(pull), f"rank {r}: pull_order ran out before block {b}'s tokens arrived"
            g = pull[next_pull]
            next_pull += 1
            if slots[g][0] < 0 or not remote(g):
                continue  # padding token or one of ours: nothing to pull
            pulled[g] = bufs[g // C][g % C]                          # one read from the owner
            arrived[g] = True
        # Data arrives in the order the GEMM consumes it: nothing pulled yet belongs only to later blocks.
        end = (b + 1) * BM
        late = [g for g in pull[:next_pull] if slots[g][0] >= 0 and remote(g) and min(slots[g]) >= end]
        assert not late, f"rank {r}: tokens {late[:4]} pulled before block {b} was complete but needed only later"
        # Row s reads its token in place: ours from the token buffer, remote ones from `pulled`;
        # a padding row reads our row s mod C (its output is never used).
        A = torch.stack([bufs[r][s % C] if row_token[s] < 0 else
                         (pulled[row_token[s]] if remote(row_token[s]) else bufs[r][row_token[s] % C])
                         for s in rows])                             # [BM, H]
        h = A @ w13[e].float()                                       # [BM, 2*Ir]
        if b13 is not None:
            h = h + b13[e].float()
        act[b * BM:end] = act_fn.apply(h[:, :Ir], h[:, Ir:])
    # Whatever is left of pull_order must be tokens nobody waits for: no remote real token is among them.
    for g in pull[next_pull:]:
        assert slots[g][0] < 0 or not remote(g), f"rank {r}: remote token {g} was never pulled"
    return act


def _kernel2(r: int, tables: Tables, act: Tensor, w2: Tensor, w_g: Tensor, counts: list[int],
             staging: list[Tensor], watermarks: list[list[int]], C: int, seq: int, b2: Tensor | None) -> None:
    """GEMM2 (+ down bias b2 [E, H], rank 0's) (+) top-k reduce (+) push on rank r: fills
    staging[owner][r] and watermarks[owner][r]."""
    S = tables.S
    H = w2.shape[2]
    slots = tables.slots.tolist()                                    # [N][K]
    jobs = tables.job_order.tolist()
    R = len(counts)
    D = torch.full((S, H), float("nan"))                             # [S, H]
    done = [False] * tables.num_blocks
    pushed = [0] * R                                                 # local per-owner job counts
    # Owners with no tokens get no job, so no last writer: publish for them up front.
    for o in range(R):
        if counts[o] == 0:
            watermarks[o][r] = seq
    next_job = 0

    def ready(g: int) -> bool:
        return all(done[s // BM] for s in slots[g])

    def run_job(g: int) -> None:
        o, i = divmod(g, C)
        rows = torch.tensor(slots[g])                                # [K]
        partial = (w_g[g, :, None] * D[rows]).sum(0)                 # [H] fp32 pre-reduce over k
        staging[o][r, i] = partial
        pushed[o] += 1
        if pushed[o] == counts[o]:
            watermarks[o][r] = seq                                   # last writer for owner o publishes

    E = _unused(tables)
    for b in range(tables.num_blocks):
        e = int(tables.block_expert[b])
        if e == E:
            continue
        rows = slice(b * BM, (b + 1) * BM)
        D[rows] = act[rows] @ w2[e].float() + (b2[e].float() if b2 is not None else 0.0)  # [BM, H]
        done[b] = True
        # Job programs drain the dispenser while the next job's rows are all done.
        while next_job < len(jobs) and (slots[jobs[next_job]][0] < 0 or ready(jobs[next_job])):
            g = jobs[next_job]
            next_job += 1
            if slots[g][0] >= 0:
                run_job(g)
        # Jobs are taken in the order they become ready: no ready job waits behind an unready one.
        end = (b + 1) * BM
        ready_now = sum(1 for row in slots if row[0] >= 0 and max(row) < end)
        taken = sum(1 for g in jobs[:next_job] if slots[g][0] >= 0)
        assert taken >= ready_now, (f"rank {r}: after block {b}, {ready_now - taken} ready jobs wait behind "
                                    f"an unready one")
    for g in jobs[next_job:]:
        assert slots[g][0] < 0, f"rank {r}: job for real token {g} never became ready"


def simulate_fused(xs: list[Tensor], ids: list[Tensor], ws: list[Tensor], rank_weights: list, cfg,
                   *, seq: int = 1) -> list[Tensor]:
    """Run the fused algorithm's dataflow on the CPU; returns out_r [n_r, H] fp32 for every rank.

    xs[r] [n_r, H], ids[r] [n_r, K], ws[r] [n_r, K] (n_r <= C, 0 allowed); rank_weights[r] is
    (w13 [E, H, 2*Ir], w2 [E, Ir, H]) or a RankWeights (with its biases, if any); cfg a LayerConfig
    (its activation is the one computed).
    """
    R, C, K, S = cfg.R, cfg.C, cfg.K, cfg.S
    assert len(xs) == len(ids) == len(ws) == len(rank_weights) == R, "one x, ids, w and weight slice per rank"
    assert all(x.shape[0] <= C for x in xs), f"a rank holds more than C = {C} tokens"
    H = xs[0].shape[1]
    weights = [(rw.w13, rw.w2, rw.b13, rw.b2) if hasattr(rw, "w13") else (*rw, None, None) for rw in rank_weights]

    ids_g, w_g, counts = _global_routing(ids, ws, C, K)
    tables = build_tables(ids_g, counts, cfg.E, C, S)
    counts_l = counts.tolist()

    # Symmetric token buffers: rows past n_r hold whatever the last batch left (NaN here).
    bufs = []
    for x in xs:
        buf = torch.full((C, H), float("nan"))                       # [C, H]
        buf[:x.shape[0]] = x.float()
        bufs.append(buf)
    staging = [torch.full((R, C, H), float("nan")) for _ in range(R)]  # per owner: [R, C, H]
    watermarks = [[seq - 1] * R for _ in range(R)]                   # watermarks[owner][source]

    for r in range(R):
        w13, w2, b13, b2 = weights[r]
        act = _kernel1(r, tables, bufs, w13, C, cfg.act, b13)
        _kernel2(r, tables, act, w2, w_g, counts_l, staging, watermarks, C, seq, b2)

    outs = []
    for o in range(R):
        assert all(m == seq for m in watermarks[o]), f"owner {o}: watermarks {watermarks[o]} never reached seq {seq}"
        n = counts_l[o]
        out = torch.zeros(n, H)                                      # [n_o, H]
        for src in range(R):
            out += staging[o][src, :n]
        outs.append(out)
    return outs
