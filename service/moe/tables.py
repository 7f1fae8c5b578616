"""Schedule tables: where every (token, k) hit lives in the gathered layout, and in what order
tokens are pulled (layer 1) and combined (layer 2).

Dimension letters: N = R*C global tokens, K top-k, E experts, S rows of the gathered layout,
NB = S / BM row blocks.

Global token g = r*C + i (rank r, local row i) is real iff i < counts[r]; a padding token's ids
are ignored (they may be garbage) and it has no hits. The real hits (g, k), N_real * K of them,
are sorted by expert and, within an expert, by (g, k). With

    n[e]   = #{real (g, k) : ids[g, k] = e}                     hits of expert e
    p[e]   = ceil(n[e] / BM) * BM                               padded run of expert e
    off[e] = p[0] + ... + p[e-1]                                expert e owns rows [off[e], off[e+1])
    j      = rank of hit (g, k) among the hits of its expert     0 <= j < n[e]

the tables are

    slots[g, k]    = off[e] + j                  (-1 for padding tokens)
    row_token[s]   = g for the hit on row s      (-1 for the p[e] - n[e] padding rows, the tail of each run)
    block_expert[b]= e with off[e] <= b*BM < off[e+1], E past off[E]
    pull_order     = real tokens by min_k slots[g, k], then padding tokens by g
    job_order      = real tokens by max_k slots[g, k], then padding tokens by g

Slots are distinct, so both orders are total (no ties among real tokens). Pulling tokens in
pull_order completes row blocks in block order: every token with a row in block b has its smallest
slot below (b+1)*BM, hence comes before any token whose smallest slot is past block b. Taking jobs
in job_order makes job m wait only on blocks up to the block of its largest slot, i.e. jobs become
ready in the order GEMM2 finishes blocks.

ids and counts may be int32 or int64; every table is int32 on ids' device.
S must hold the worst case (LayerConfig.S: N*K hits plus E*(BM-1) padding rows, rounded to BM);
the vectorized builder cannot check that without a host sync, the golden one asserts it.

Why sorts: a sort-free variant (one-hot [E, N*K] prefix scan for the rank within an expert, a
mark-and-scan over S for the orders) was measured on an H200 at the seed shape: 200 us per CUDA
graph replay against 245 us for this one, but 3.5x slower on the CPU, where this builder also
runs. Neither is the GPU fast path (csrc/ is), so the simpler one stays.

Three builders share these semantics: `build_tables_golden` (plain Python loops, tests only),
`build_tables` (vectorized torch: static shapes, no host sync, CUDA-graph capturable) and the
one-launch CUDA kernel in csrc/ (GPU fast path).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from service.config import BM, round_up


@dataclasses.dataclass
class Tables:
    expert_offsets: Tensor  # [E+1] int32  padded prefix sums; expert e owns rows [off[e], off[e+1])
    block_expert: Tensor    # [S/BM] int32 expert of each row block; E for blocks past off[E]
    slots: Tensor           # [R*C, K] int32 row holding hit (g, k); -1 for padding tokens
    row_token: Tensor       # [S] int32 global token whose hit sits on the row; -1 for padding rows
    pull_order: Tensor      # [R*C] int32 tokens by smallest slot; padding tokens last, by index
    job_order: Tensor       # [R*C] int32 tokens by largest slot; padding tokens last, by index

    @property
    def num_blocks(self) -> int:
        """Row blocks of the layout, S / BM (static: used or not)."""
        return self.block_expert.shape[0]

    @property
    def S(self) -> int:
        return self.row_token.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Tables:
        return Tables(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                         for f in dataclasses.fields(self)})


def _check_shapes(ids: Tensor, counts: Tensor, E: int, C: int, S: int) -> None:
    if ids.dim() != 2 or counts.dim() != 1 or ids.shape[0] != counts.shape[0] * C:
        raise ValueError(f"ids must be [R*C, K] and counts [R]; got ids {tuple(ids.shape)}, "
                         f"counts {tuple(counts.shape)}, C={C}")
    if ids.dtype.is_floating_point or counts.dtype.is_floating_point:
        raise ValueError(f"ids and counts must be integer tensors, got {ids.dtype} and {counts.dtype}")
    if S % BM or S <= 0:
        raise ValueError(f"S ({S}) must be a positive multiple of BM ({BM})")
    if E < 1:
        raise ValueError(f"E must be positive, got {E}")


def build_tables(ids: Tensor, counts: Tensor, E: int, C: int, S: int) -> Tables:
    """The schedule tables, vectorized: one stable sort of the hits by expert, prefix sums, scatters.

    Every output and temporary has a shape fixed by (R, C, K, E, S), nothing reads a value back to
    the host, so this runs on any device and inside a CUDA graph. Real ids must lie in [0, E) (the
    front end validates them); padding tokens' ids are never read as indices.
    """
    _check_shapes(ids, counts, E, C, S)
    N, K = ids.shape
    NB = S // BM
    dev = ids.device
    i64 = torch.int64

    g = torch.arange(N, device=dev)                                     # [N]
    real = (g % C) < counts.to(dev, i64)[g // C]                        # [N] bool
    # Padding hits get the sentinel expert E: they sort after every real hit.
    expert = torch.where(real[:, None], ids.to(i64), E).reshape(-1)     # [N*K]

    # Stable sort keeps hits of one expert in flattened (g, k) order, as the contract asks.
    sorted_expert, hit = torch.sort(expert, stable=True)                # [N*K], [N*K]

    n = torch.zeros(E + 1, dtype=i64, device=dev)                       # [E+1] hits per expert (+ sentinel)
    n.scatter_add_(0, expert, torch.ones_like(expert))
    n = n[:E]                                                           # [E]
    padded = (n + BM - 1) // BM * BM                                    # [E]
    zero = torch.zeros(1, dtype=i64, device=dev)
    off = torch.cat([zero, padded.cumsum(0)])                           # [E+1] padded prefix sums
    start = torch.cat([zero, n.cumsum(0)])                              # [E+1] unpadded prefix sums

    # Hit at sorted position q of expert e is hit number q - start[e] of that expert.
    q = torch.arange(N * K, device=dev)                                 # [N*K]
    is_real_hit = sorted_expert < E                                     # [N*K]
    e_c = sorted_expert.clamp(max=E - 1)                                # [N*K] safe index for padding hits
    row = torch.where(is_real_hit, off[e_c] + q - start[e_c], -1)       # [N*K] slot of sorted hit q

    slots = torch.empty(N * K, dtype=i64, device=dev)                   # [N*K]
    slots.scatter_(0, hit, row)
    slots = slots.view(N, K)                                            # [N, K]

    # Padding hits write into a dump row S, cut off afterwards.
    row_token = torch.full((S + 1,), -1, dtype=i64, device=dev)         # [S+1]
    row_token.scatter_(0, torch.where(is_real_hit, row, S), torch.where(is_real_hit, hit // K, -1))
    row_token = row_token[:S]                                           # [S]

    block_start = torch.arange(NB, device=dev) * BM                     # [NB]
    # Experts whose run ends at or before the block's first row precede it: their count is the
    # block's expert (empty runs end where they start, so they are skipped); E past off[E].
    block_expert = torch.searchsorted(off[1:], block_start, right=True)  # [NB]

    # Order keys: real tokens by their smallest / largest slot (< S, distinct), padding by S + g.
    pad_key = S + g                                                     # [N]
    pull_key = torch.where(real, slots.amin(1), pad_key)                # [N]
    job_key = torch.where(real, slots.amax(1), pad_key)                 # [N]
    pull_order = torch.argsort(pull_key)                                # [N]
    job_order = torch.argsort(job_key)                                  # [N]

    i32 = torch.int32
    return Tables(expert_offsets=off.to(i32), block_expert=block_expert.to(i32), slots=slots.to(i32),
                  row_token=row_token.to(i32), pull_order=pull_order.to(i32),
                  job_order=job_order.to(i32))


def build_tables_golden(ids: Tensor, counts: Tensor, E: int, C: int, S: int) -> Tables:
    """The schedule tables with plain Python loops, straight from the definitions. Tests only."""
    _check_shapes(ids, counts, E, C, S)
    N, K = ids.shape
    ids_l = ids.tolist()
    counts_l = counts.tolist()
    real = [g % C < counts_l[g // C] for g in range(N)]

    hits: list[list[tuple[int, int]]] = [[] for _ in range(E)]
    for g in range(N):
        if real[g]:
            for k in range(K):
                e = ids_l[g][k]
                assert 0 <= e < E, f"token {g} k={k} routes to expert {e}, outside [0, {E})"
                hits[e].append((g, k))  # g, then k increase: within an expert, ordered by (g, k)

    off = [0]
    for e in range(E):
        off.append(off[-1] + round_up(len(hits[e]), BM))
    assert off[E] <= S, f"layout needs {off[E]} rows but S = {S}"

    slots = [[-1] * K for _ in range(N)]
    row_token = [-1] * S
    for e in range(E):
        for j, (g, k) in enumerate(hits[e]):
            slots[g][k] = off[e] + j
            row_token[off[e] + j] = g

    block_expert = []
    for b in range(S // BM):
        first = b * BM
        owner = E
        for e in range(E):
            if off[e] <= first < off[e + 1]:
                owner = e
        block_expert.append(owner)

    real_tokens = [g for g in range(N) if real[g]]
    padding_tokens = [g for g in range(N) if not real[g]]
    pull_order = sorted(real_tokens, key=lambda g: min(slots[g])) + padding_tokens
    job_order = sorted(real_tokens, key=lambda g: max(slots[g])) + padding_tokens

    def t(values):
        return torch.tensor(values, dtype=torch.int32).reshape(-1)

    return Tables(expert_offsets=t(off), block_expert=t(block_expert), slots=t(slots).view(N, K),
                  row_token=t(row_token), pull_order=t(pull_order), job_order=t(job_order))


def check_invariants(tables: Tables, ids: Tensor, counts: Tensor, E: int, C: int) -> None:
    """Assert every property the kernels rely on; the AssertionError names the broken one."""
    t = tables.to("cpu")
    N, K = ids.shape
    S = t.row_token.shape[0]
    NB = S // BM
    ids_l = ids.cpu().tolist()
    counts_l = counts.cpu().tolist()
    assert N == len(counts_l) * C, f"ids has {N} rows, expected R*C = {len(counts_l) * C}"
    for f in dataclasses.fields(t):
        assert getattr(t, f.name).dtype == torch.int32, f"{f.name} must be int32"
    assert S % BM == 0, f"S = {S} is not a multiple of BM"
    shapes = dict(expert_offsets=(E + 1,), block_expert=(NB,), slots=(N, K), row_token=(S,),
                  pull_order=(N,), job_order=(N,))
    for name, shape in shapes.items():
        assert tuple(getattr(t, name).shape) == shape, f"{name} has shape {tuple(getattr(t, name).shape)}, want {shape}"

    off = t.expert_offsets.tolist()
    slots = t.slots.tolist()
    row_token = t.row_token.tolist()
    real = [g % C < counts_l[g // C] for g in range(N)]

    # Offsets: start at 0, each run the hit count padded to the next multiple of BM, inside S.
    n = [0] * E
    for g in range(N):
        if real[g]:
            for k in range(K):
                n[ids_l[g][k]] += 1
    assert off[0] == 0, "expert_offsets[0] must be 0"
    for e in range(E):
        run = off[e + 1] - off[e]
        assert run % BM == 0, f"padded count of expert {e} ({run}) is not a multiple of BM"
        assert run == round_up(n[e], BM), f"expert {e} has {n[e]} hits but a run of {run} rows"
    assert off[E] <= S, f"layout uses {off[E]} rows, more than S = {S}"

    # Slots: a bijection from the real hits onto the real rows, inside the expert's range,
    # hits of one expert in (g, k) order; row_token its inverse.
    seen: dict[int, tuple[int, int]] = {}
    for g in range(N):
        for k in range(K):
            s = slots[g][k]
            if not real[g]:
                assert s == -1, f"padding token {g} has slot {s} at k={k}, want -1"
                continue
            e = ids_l[g][k]
            assert off[e] <= s < off[e + 1], (f"slot {s} of hit ({g}, {k}) outside expert {e}'s rows "
                                              f"[{off[e]}, {off[e + 1]})")
            assert s not in seen, f"slot {s} holds both hit {seen[s]} and hit ({g}, {k}): not injective"
            seen[s] = (g, k)
            assert row_token[s] == g, f"row_token[{s}] = {row_token[s]}, want token {g}: not the inverse of slots"
    real_rows = [s for s in range(S) if row_token[s] >= 0]
    assert len(real_rows) == len(seen), f"{len(real_rows)} rows name a token but {len(seen)} hits exist: not surjective"
    for e in range(E):
        rows = [s for s in range(off[e], off[e + 1]) if row_token[s] >= 0]
        assert rows == list(range(off[e], off[e] + n[e])), f"expert {e}'s real rows are not the head of its run"
        order = [seen[s] for s in rows]
        assert order == sorted(order), f"hits of expert {e} are not ordered by (token, k)"

    # Blocks: expert consistent with the offsets.
    for b in range(NB):
        first = b * BM
        want = next((e for e in range(E) if off[e] <= first < off[e + 1]), E)
        assert t.block_expert[b] == want, f"block_expert[{b}] = {int(t.block_expert[b])}, want {want}"

    # Orders: permutations, real tokens by min / max slot, padding tokens last by index.
    padding = [g for g in range(N) if not real[g]]
    n_real = N - len(padding)
    for name, reduce in (("pull_order", min), ("job_order", max)):
        order = getattr(t, name).tolist()
        assert sorted(order) == list(range(N)), f"{name} is not a permutation of the {N} tokens"
        head, tail = order[:n_real], order[n_real:]
        assert all(real[g] for g in head), f"{name} puts a padding token before a real one"
        assert tail == padding, f"{name} does not end with the padding tokens in index order"
        keys = [reduce(slots[g]) for g in head]
        assert keys == sorted(keys), f"{name} is not sorted by the {reduce.__name__} slot"
