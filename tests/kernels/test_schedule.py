"""Schedule builder: the CUDA op (GPU) and its algorithm (CPU) against the golden builder.

CPU: `emulate_kernel` is a line-by-line Python port of csrc/schedule/schedule_kernel.cu
(histograms, scans, per-block binary search, the chunked warp-match stable placement), checked
element by element against build_tables_golden, so the algorithm is tested where there is no GPU.
GPU: the op itself, eager and under CUDA graph capture, against the golden on random routings.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from service.config import BM
from service.moe.tables import Tables, build_tables_golden, check_invariants
from tests.helpers import ROUTING_KINDS, layer
from tests.moe.test_tables import assert_same, global_routing, make_counts

THREADS, WARP = 1024, 32

# (E, K, R, C): odd sizes, K = 1, C > BM, more than one 1024-item chunk, E = kMaxExperts.
SHAPES = [(8, 2, 2, 5), (5, 1, 3, 130), (16, 4, 4, 97), (64, 8, 4, 40), (1023, 2, 1, 600)]
COUNT_KINDS = ("full", "partial", "empty_rank", "t1", "none")


def _stable_place(keys: list[int], base: list[int], num_keys: int) -> list[int]:
    """Port of stable_place(): positions of items (key -1: none) chunk by chunk, warp by warp."""
    pos = [-1] * len(keys)
    running = [0] * num_keys
    for chunk in range(0, len(keys), THREADS):
        ck = [keys[i] if i < len(keys) else -1 for i in range(chunk, chunk + THREADS)]
        present = [0] * num_keys
        count8 = {}
        groups = []  # per warp: key -> lanes
        for w in range(THREADS // WARP):
            lanes: dict[int, list[int]] = {}
            for lane in range(WARP):
                lanes.setdefault(ck[w * WARP + lane], []).append(lane)  # __match_any_sync
            groups.append(lanes)
            for key, members in lanes.items():
                if key >= 0:
                    count8[(w, key)] = len(members)
                    present[key] |= 1 << w
        updates = {}
        for w, lanes in enumerate(groups):
            for key, members in lanes.items():
                if key < 0:
                    continue
                p = present[key]
                before = sum(count8[(v, key)] for v in range(w) if p >> v & 1)
                for lane_rank, lane in enumerate(members):
                    pos[chunk + w * WARP + lane] = base[key] + running[key] + before + lane_rank
                if p >> w == 1:  # the last warp holding the key advances running[]
                    updates[key] = running[key] + before + len(members)
        for key, value in updates.items():
            running[key] = value
    return pos


def _exclusive(values: list[int]) -> list[int]:
    out, acc = [], 0
    for v in values:
        out.append(acc)
        acc += v
    return out + [acc]


def emulate_kernel(ids: torch.Tensor, counts: torch.Tensor, E: int, C: int, S: int) -> Tables:
    """build_tables_kernel in Python (same phases, same formulas)."""
    R, K = counts.numel(), ids.shape[1]
    T, hits, blocks = R * C, R * C * ids.shape[1], S // BM
    flat, cnt = ids.reshape(-1).tolist(), counts.tolist()
    real = [g % C < cnt[g // C] for g in range(T)]

    def hit_expert(h):
        e = flat[h]
        return e if real[h // K] and 0 <= e < E else -1

    def token_key(g, largest):
        valid = [flat[g * K + k] for k in range(K) if 0 <= flat[g * K + k] < E] if real[g] else []
        return (max(valid) if largest else min(valid)) if valid else E

    hist, hmin, hmax = [0] * (E + 1), [0] * (E + 1), [0] * (E + 1)
    hit_keys = [hit_expert(h) for h in range(hits)]
    min_keys = [token_key(g, False) for g in range(T)]
    max_keys = [token_key(g, True) for g in range(T)]
    for k in hit_keys:
        if k >= 0:
            hist[k] += 1
    for a, b in zip(min_keys, max_keys):
        hmin[a] += 1
        hmax[b] += 1
    off = _exclusive([(hist[e] + BM - 1) // BM * BM for e in range(E)])
    bmin, bmax = _exclusive(hmin)[:-1], _exclusive(hmax)[:-1]

    def expert_of_row(row):  # last e with off[e] <= row
        lo, hi = 0, E - 1
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            lo, hi = (mid, hi) if off[mid] <= row else (lo, mid - 1)
        return lo

    block_expert, slack = [], []
    for b in range(blocks):
        row0 = b * BM
        e, real_rows = E, 0
        if row0 < off[E]:
            e = expert_of_row(row0)
            real_rows = min(max(off[e] + hist[e] - row0, 0), BM)
        block_expert.append(e)
        slack.append(BM - real_rows)
    row_token = [None] * S
    for row in range(S):
        if row >= off[E] or row >= off[expert_of_row(row)] + hist[expert_of_row(row)]:
            row_token[row] = -1
    slots = [-1] * hits
    for h, p in enumerate(_stable_place(hit_keys, off, E + 1)):
        if p >= 0:
            slots[h] = p
            row_token[p] = h // K
    pull, job = [None] * T, [None] * T
    for g, p in enumerate(_stable_place(min_keys, bmin, E + 1)):
        pull[p] = g
    for g, p in enumerate(_stable_place(max_keys, bmax, E + 1)):
        job[p] = g
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return Tables(expert_offsets=t(off), block_expert=t(block_expert), slots=t(slots).view(T, K),
                  row_token=t(row_token), pull_order=t(pull), job_order=t(job), slack=t(slack))


def _problem(E, K, R, C, count_kind, routing_kind):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((E, K, R, C, count_kind, routing_kind)).encode()))
    S = layer(E, K, R, C).S
    counts = make_counts(R, C, count_kind, gen)
    ids = global_routing(E, K, R, C, counts, routing_kind, gen)
    return ids, counts, S


@pytest.mark.parametrize("routing_kind", ["balanced", "skewed", "empty_expert"])
@pytest.mark.parametrize("count_kind", ["full", "empty_rank", "t1"])
@pytest.mark.parametrize("E,K,R,C", SHAPES[:4])
def test_kernel_algorithm_matches_golden(E, K, R, C, count_kind, routing_kind):
    ids, counts, S = _problem(E, K, R, C, count_kind, routing_kind)
    golden = build_tables_golden(ids, counts, E, C, S)
    assert_same(emulate_kernel(ids, counts, E, C, S), golden)


def test_kernel_algorithm_many_experts_and_chunks():
    """E = 1023 (the op's limit) and more than one 1024-item chunk of hits."""
    ids, counts, S = _problem(*SHAPES[4], "partial", "skewed")
    assert_same(emulate_kernel(ids, counts, SHAPES[4][0], SHAPES[4][3], S),
                build_tables_golden(ids, counts, SHAPES[4][0], SHAPES[4][3], S))


def test_orders_are_sorts_by_smallest_and_largest_expert():
    """The kernel's key fact: pull_order = tokens by (min expert, g), job_order by (max expert, g)."""
    E, K, R, C = 16, 4, 4, 97
    ids, counts, S = _problem(E, K, R, C, "partial", "skewed")
    golden = build_tables_golden(ids, counts, E, C, S)
    g = torch.arange(R * C)
    real = (g % C) < counts[g // C]
    emin = torch.where(real, ids.amin(1), E)
    emax = torch.where(real, ids.amax(1), E)
    assert torch.equal(golden.pull_order.long(), torch.sort(emin * (R * C) + g).indices)
    assert torch.equal(golden.job_order.long(), torch.sort(emax * (R * C) + g).indices)


def test_import_loads_nothing_and_cpu_falls_back():
    from service.kernels import schedule

    ids, counts, S = _problem(8, 2, 2, 5, "partial", "balanced")
    tables = schedule.build_tables(ids, counts, 8, 5, S)
    assert_same(tables, build_tables_golden(ids, counts, 8, 5, S))
    if not torch.cuda.is_available():
        available, reason = schedule.load()
        assert not available and "CUDA" in reason


# ---------------------------------------------------------------------------------------------
# GPU: the op itself.
# ---------------------------------------------------------------------------------------------


def _require_op():
    from service.kernels import schedule

    available, reason = schedule.load()
    if not available:
        pytest.skip(f"moe::build_tables not available: {reason}")
    return schedule


@pytest.mark.gpu
@pytest.mark.parametrize("routing_kind", ROUTING_KINDS)
@pytest.mark.parametrize("count_kind", COUNT_KINDS)
@pytest.mark.parametrize("E,K,R,C", SHAPES + [(64, 8, 4, 512)])
def test_cuda_op_matches_golden(E, K, R, C, count_kind, routing_kind):
    schedule = _require_op()
    ids, counts, S = _problem(E, K, R, C, count_kind, routing_kind)
    golden = build_tables_golden(ids, counts, E, C, S)
    dev = torch.device("cuda")
    got = schedule.build_tables_cuda(ids.to(dev, torch.int32), counts.to(dev, torch.int32), E, C, S)
    assert_same(got, golden)
    again = schedule.build_tables_cuda(ids.to(dev, torch.int32), counts.to(dev, torch.int32), E, C, S)
    assert_same(again, golden)  # deterministic: same tables on every run
    check_invariants(got.to("cpu"), ids, counts, E, C)


def _empty_tables(E, K, R, C, S, dev) -> Tables:
    i32 = dict(dtype=torch.int32, device=dev)
    return Tables(expert_offsets=torch.full((E + 1,), -7, **i32), block_expert=torch.full((S // BM,), -7, **i32),
                  slots=torch.full((R * C, K), -7, **i32), row_token=torch.full((S,), -7, **i32),
                  pull_order=torch.full((R * C,), -7, **i32), job_order=torch.full((R * C,), -7, **i32),
                  slack=torch.full((S // BM,), -7, **i32))


@pytest.mark.gpu
@pytest.mark.parametrize("builder", ["cuda_op", "torch"])
def test_builders_under_cuda_graph(builder):
    from service.moe import tables as torch_tables

    schedule = _require_op() if builder == "cuda_op" else None
    E, K, R, C = 64, 8, 4, 512
    dev = torch.device("cuda")
    ids0, counts0, S = _problem(E, K, R, C, "full", "balanced")
    ids = ids0.to(dev, torch.int32)
    counts = counts0.to(dev, torch.int32)
    out = _empty_tables(E, K, R, C, S, dev)

    def run():
        if builder == "cuda_op":
            schedule.build_tables_cuda(ids, counts, E, C, S, out=out)
        else:
            result = torch_tables.build_tables(ids, counts, E, C, S)
            for name in ("expert_offsets", "block_expert", "slots", "row_token", "pull_order", "job_order", "slack"):
                getattr(out, name).copy_(getattr(result, name))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for count_kind, routing_kind in [("empty_rank", "skewed"), ("t1", "single"), ("partial", "empty_expert"),
                                     ("none", "balanced")]:
        new_ids, new_counts, _ = _problem(E, K, R, C, count_kind, routing_kind)
        ids.copy_(new_ids.to(torch.int32))
        counts.copy_(new_counts.to(torch.int32))
        for t in (out.expert_offsets, out.block_expert, out.slots, out.row_token, out.pull_order, out.job_order,
                  out.slack):
            t.fill_(-7)  # poison: every element must be rewritten by the replay
        graph.replay()
        torch.cuda.synchronize()
        assert_same(out, build_tables_golden(new_ids, new_counts, E, C, S))


@pytest.mark.gpu
def test_cuda_op_entry_checks():
    schedule = _require_op()
    dev = torch.device("cuda")
    E, K, R, C = 8, 2, 2, 5
    ids, counts, S = _problem(E, K, R, C, "full", "balanced")
    ids, counts = ids.to(dev, torch.int32), counts.to(dev, torch.int32)
    with pytest.raises(RuntimeError, match="cannot hold the worst case"):
        torch.ops.moe.build_tables(ids, counts, E, C, BM)
    with pytest.raises(RuntimeError, match="E must be in"):
        torch.ops.moe.build_tables(ids, counts, 5000, C, 5000 * BM)
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.moe.build_tables(ids.long(), counts, E, C, S)
    with pytest.raises(RuntimeError, match="rows, expected R\\*C"):
        torch.ops.moe.build_tables(ids[:-1], counts, E, C, S)
    assert schedule.fits_cuda_op(R * C, K, E)
