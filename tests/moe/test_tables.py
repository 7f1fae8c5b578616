"""Schedule tables: vectorized builder vs golden, element by element, plus the invariants."""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from service.config import BM
from service.moe.tables import Tables, build_tables, build_tables_golden, check_invariants
from tests.helpers import ROUTING_KINDS, layer, routing

# (E, K, R, C): odd sizes; C > BM so one expert's run spans several blocks; K = 1 and K = E.
SHAPES = [(8, 2, 2, 5), (16, 4, 4, 33), (64, 8, 4, 40), (3, 3, 1, 7), (5, 1, 3, 130), (4, 2, 2, 200)]
COUNT_KINDS = ("full", "partial", "empty_rank", "t1", "none")


def make_counts(R: int, C: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "full":
        return torch.full((R,), C, dtype=torch.int64)
    if kind == "partial":
        return torch.randint(1, C + 1, (R,), generator=gen)
    if kind == "empty_rank":
        counts = torch.randint(1, C + 1, (R,), generator=gen)
        counts[R // 2] = 0
        return counts
    if kind == "t1":
        counts = torch.zeros(R, dtype=torch.int64)
        counts[-1] = 1
        return counts
    if kind == "none":
        return torch.zeros(R, dtype=torch.int64)
    raise ValueError(kind)


def global_routing(E: int, K: int, R: int, C: int, counts: torch.Tensor, kind: str,
                   gen: torch.Generator) -> torch.Tensor:
    """ids [R*C, K] int64: real rows from `routing`, padding rows garbage (out of range too) that must be ignored."""
    ids = torch.randint(-5, E + 5, (R * C, K), generator=gen)                     # [R*C, K]
    for r in range(R):
        n = int(counts[r])
        ids[r * C:r * C + n], _ = routing(n, E, K, kind, gen)
    return ids


def assert_same(got: Tables, want: Tables) -> None:
    for f in dataclasses.fields(Tables):
        a, b = getattr(got, f.name).cpu(), getattr(want, f.name).cpu()
        assert a.dtype == b.dtype == torch.int32, f"{f.name}: dtypes {a.dtype} vs {b.dtype}"
        assert torch.equal(a, b), f"{f.name} differs from golden at {(a != b).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("routing_kind", ROUTING_KINDS)
@pytest.mark.parametrize("count_kind", COUNT_KINDS)
@pytest.mark.parametrize("E,K,R,C", SHAPES)
def test_vectorized_matches_golden(E, K, R, C, count_kind, routing_kind):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((E, K, R, C, count_kind, routing_kind)).encode()))
    S = layer(E, K, R, C).S
    counts = make_counts(R, C, count_kind, gen)
    ids = global_routing(E, K, R, C, counts, routing_kind, gen)

    golden = build_tables_golden(ids, counts, E, C, S)
    check_invariants(golden, ids, counts, E, C)
    fast = build_tables(ids, counts, E, C, S)
    assert_same(fast, golden)
    # int32 ids and counts (the shared-memory slot's dtype) give the same tables.
    assert_same(build_tables(ids.to(torch.int32), counts.to(torch.int32), E, C, S), golden)


def test_larger_layout_than_needed():
    gen = torch.Generator().manual_seed(1)
    E, K, R, C = 6, 2, 2, 9
    S = layer(E, K, R, C).S + 3 * BM
    counts = torch.tensor([9, 4])
    ids = global_routing(E, K, R, C, counts, "skewed", gen)
    tables = build_tables(ids, counts, E, C, S)
    assert_same(tables, build_tables_golden(ids, counts, E, C, S))
    check_invariants(tables, ids, counts, E, C)
    assert tables.num_blocks == S // BM and tables.S == S
    assert (tables.block_expert[-3:] == E).all()


def test_known_small_case():
    """A case worked by hand: E=3, K=2, R=2, C=2; rank 1 holds one token."""
    ids = torch.tensor([[2, 0], [0, 2], [1, 2], [9, 9]])  # token 3 is padding (ids ignored)
    counts = torch.tensor([2, 1])
    S = layer(3, 2, 2, 2).S
    t = build_tables(ids, counts, 3, 2, S)
    # hits: e0: (0,1) (1,0); e1: (2,0); e2: (0,0) (1,1) (2,1)  -> runs of BM rows each
    assert t.expert_offsets.tolist() == [0, BM, 2 * BM, 3 * BM]
    assert t.slots.tolist() == [[2 * BM, 0], [1, 2 * BM + 1], [BM, 2 * BM + 2], [-1, -1]]
    assert t.pull_order.tolist() == [0, 1, 2, 3]
    assert t.job_order.tolist() == [0, 1, 2, 3]
    assert t.block_expert[:3].tolist() == [0, 1, 2] and (t.block_expert[3:] == 3).all()
    assert t.row_token[[0, 1, 2, BM, 2 * BM, 2 * BM + 2]].tolist() == [0, 1, -1, 2, 0, 2]


def test_orders_differ_when_tokens_interleave():
    """pull_order and job_order disagree when a token's hits span blocks: the builder must not alias them."""
    E, K, R, C = 2, 2, 1, 3
    ids = torch.tensor([[1, 0], [0, 1], [0, 1]])
    counts = torch.tensor([3])
    t = build_tables(ids, counts, E, C, layer(E, K, R, C).S)
    assert_same(t, build_tables_golden(ids, counts, E, C, layer(E, K, R, C).S))
    assert t.pull_order.tolist() == [0, 1, 2]       # min slots 0, 1, 2
    assert t.job_order.tolist() == [0, 1, 2]        # max slots BM, BM+1, BM+2
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])
    t = build_tables(ids, counts, E, C, layer(E, K, R, C).S)
    check_invariants(t, ids, counts, E, C)
    assert t.slots.tolist() == [[0, BM], [BM + 1, 1], [2, BM + 2]]


@pytest.mark.parametrize("corrupt", ["swap_slots", "order", "block_expert", "row_token", "offsets"])
def test_invariants_catch_corruption(corrupt):
    gen = torch.Generator().manual_seed(7)
    E, K, R, C = 8, 2, 2, 40
    counts = torch.tensor([40, 17])
    ids = global_routing(E, K, R, C, counts, "balanced", gen)
    t = build_tables(ids, counts, E, C, layer(E, K, R, C).S)
    check_invariants(t, ids, counts, E, C)
    if corrupt == "swap_slots":
        t.slots[[0, 1]] = t.slots[[1, 0]]
    elif corrupt == "order":
        t.job_order[[0, 1]] = t.job_order[[1, 0]]
    elif corrupt == "block_expert":
        t.block_expert[0] = t.block_expert[1]
    elif corrupt == "row_token":
        t.row_token[0] = t.row_token[1]
    elif corrupt == "offsets":
        t.expert_offsets[1:] += BM
    with pytest.raises(AssertionError):
        check_invariants(t, ids, counts, E, C)


def test_to_and_num_blocks():
    ids = torch.tensor([[0], [1]])
    t = build_tables(ids, torch.tensor([2]), 2, 2, BM * 3)
    assert t.num_blocks == 3
    moved = t.to("cpu")
    assert moved is not t
    assert_same(moved, t)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda_case(seed: int = 3, counts=(40, 0, 13, 1)):
    gen = torch.Generator().manual_seed(seed)
    E, K, R, C = 64, 8, 4, 40
    counts = torch.tensor(counts)
    ids = global_routing(E, K, R, C, counts, "skewed", gen)
    return E, K, R, C, counts, ids


@pytest.mark.gpu
@cuda
def test_cuda_no_host_sync():
    E, K, R, C, counts, ids = _cuda_case()
    S = layer(E, K, R, C).S
    ids_d, counts_d = ids.cuda(), counts.cuda()
    build_tables(ids_d, counts_d, E, C, S)  # warm-up: lazy initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tables = build_tables(ids_d, counts_d, E, C, S)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_same(tables, build_tables_golden(ids, counts, E, C, S))


@pytest.mark.gpu
@cuda
def test_cuda_graph_capture():
    E, K, R, C, counts, ids = _cuda_case()
    S = layer(E, K, R, C).S
    ids_d, counts_d = ids.cuda(), counts.cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        build_tables(ids_d, counts_d, E, C, S)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = build_tables(ids_d, counts_d, E, C, S)
    for seed, counts_new in ((4, (1, 13, 0, 40)), (5, (40, 40, 40, 40))):  # new routing, same static inputs
        _, _, _, _, counts2, ids2 = _cuda_case(seed, counts_new)
        ids_d.copy_(ids2)
        counts_d.copy_(counts2)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(out, build_tables_golden(ids2, counts2, E, C, S))
