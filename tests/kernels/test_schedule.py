"""Schedule builder: the CUDA op (GPU) and its algorithm (CPU) against the golden builder.

CPU: `emulate_kernel` is a phase-by-phase Python port of csrc/schedule/schedule_kernel.cu
(FastDiv, per-warp segments and 16-bit counters, column and block scans, per-block binary search,
the warp-match placement), checked element by element against build_tables_golden, so the
algorithm is tested where there is no GPU.
GPU: the op itself, eager and under CUDA graph capture (preallocated outputs), against the golden on
random routings; the moe-side dispatcher (service.moe.serial.build_tables) taking it.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from service.config import BM
from service.moe.tables import Tables, build_tables_golden, check_invariants
from tests.helpers import ROUTING_KINDS, layer
from tests.moe.test_tables import assert_same, global_routing, make_counts

THREADS, WARP = 1024, 32
WARPS = THREADS // WARP
HIT_BATCH, TOKEN_BATCH = 16, 2  # kHitBatch, kTokenBatch: items per lane loaded before use

# (E, K, R, C): odd sizes, K = 1, C > BM, more than one batch per warp, E = kMaxExperts.
SHAPES = [(8, 2, 2, 5), (5, 1, 3, 130), (16, 4, 4, 97), (64, 8, 4, 40), (1023, 2, 1, 600)]
COUNT_KINDS = ("full", "partial", "empty_rank", "t1", "none")


def fastdiv(x: torch.Tensor, d: int) -> torch.Tensor:
    """FastDiv of schedule_kernel.cu: umulhi(x, ceil(2^32 / d)), identity for d = 1."""
    if d == 1:
        return x
    magic = ((1 << 32) + d - 1) // d
    return (x * magic) >> 32


def _segments(n: int) -> list[tuple[int, int]]:
    """warp_segment(): 32 contiguous segments in warp order."""
    per = -(-n // WARPS)
    return [(min(n, w * per), min(n, min(n, w * per) + per)) for w in range(WARPS)]


def _warp_sort(keys: list[int], num_keys: int, batch: int):
    """sort_count + column_scan + sort_place: returns (totals per key, place(base) -> positions).

    Item order = warp, then round (32 items), then lane; the rank inside a round is the number of
    lower lanes with the same key (__match_any_sync), the per-warp counters are 16-bit."""
    n = len(keys)
    segs = _segments(n)
    table = [[0] * num_keys for _ in range(WARPS)]
    for w, (lo, hi) in enumerate(segs):  # sort_count: a sum per (warp, key)
        for i in range(lo, hi):
            if keys[i] >= 0:
                table[w][keys[i]] += 1
    totals = [0] * num_keys
    for k in range(num_keys):  # column_scan: exclusive prefix over warps, in place
        acc = 0
        for w in range(WARPS):
            table[w][k], acc = acc, acc + table[w][k]
            assert table[w][k] < 1 << 16, "16-bit counter overflow"
        totals[k] = acc

    def place(base: list[int]) -> list[int]:
        pos = [-1] * n
        for w, (lo, hi) in enumerate(segs):
            row = table[w]
            for b0 in range(lo, hi, 32 * batch):
                for j in range(batch):
                    r0 = b0 + j * 32
                    lanes = [keys[i] if i < hi else -1 for i in range(r0, r0 + 32)]
                    groups: dict[int, list[int]] = {}
                    for lane, key in enumerate(lanes):  # __match_any_sync
                        groups.setdefault(key, []).append(lane)
                    for key, members in groups.items():
                        if key < 0:
                            continue
                        start = row[key]  # the leader reads and advances the counter
                        row[key] = start + len(members)
                        assert row[key] <= 1 << 16, "16-bit counter overflow"
                        for rank, lane in enumerate(members):
                            pos[r0 + lane] = base[key] + start + rank
        return pos

    return totals, place


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
    g_of_h = fastdiv(torch.arange(hits), K).tolist()
    r_of_g = fastdiv(torch.arange(T), C).tolist()
    real = [g - r_of_g[g] * C < cnt[r_of_g[g]] for g in range(T)]

    def hit_key(h):
        e = flat[h]
        return e if real[g_of_h[h]] and 0 <= e < E else -1

    def token_key(g, largest):
        valid = [flat[g * K + k] for k in range(K) if 0 <= flat[g * K + k] < E]
        return (max(valid) if largest else min(valid)) if real[g] and valid else E

    # Phases 1-2: hits per expert, padded offsets.
    hit_keys = [hit_key(h) for h in range(hits)]
    hist, place_hits = _warp_sort(hit_keys, E + 1, HIT_BATCH)
    off = _exclusive([(hist[e] + BM - 1) // BM * BM for e in range(E)])

    # Phase 3: blocks (binary search: last e with off[e] <= row0), slots, real rows.
    block_expert, used_expert = [], {}
    for b in range(blocks):
        row0 = b * BM
        e = E
        if row0 < off[E]:
            lo, hi = 0, E - 1
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                lo, hi = (mid, hi) if off[mid] <= row0 else (lo, mid - 1)
            e = used_expert[b] = lo
        block_expert.append(e)
    row_token = [None] * S
    slots = [-1] * hits
    for h, p in enumerate(place_hits(off)):
        if p >= 0:
            slots[h] = p
            row_token[p] = g_of_h[h]

    # Phase 4: padding rows, one warp per block.
    for b in range(blocks):
        row0 = b * BM
        pad_from = max(row0, off[used_expert[b]] + hist[used_expert[b]]) if row0 < off[E] else row0
        for r in range(pad_from, row0 + BM):
            assert row_token[r] is None, f"row {r} is both real and padding"
            row_token[r] = -1

    # Phases 4-7: the two token sorts.
    orders = []
    for largest in (False, True):
        totals, place = _warp_sort([token_key(g, largest) for g in range(T)], E + 1, TOKEN_BATCH)
        order = [None] * T
        for g, p in enumerate(place(_exclusive(totals)[:-1])):
            order[p] = g
        orders.append(order)
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return Tables(expert_offsets=t(off), block_expert=t(block_expert), slots=t(slots).view(T, K),
                  row_token=t(row_token), pull_order=t(orders[0]), job_order=t(orders[1]))


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


def test_fastdiv_exact_below_2_16():
    """FastDiv is exact for x < 2^16 and 1 <= d <= 2^16 (every x; all d up to 512, then a spread)."""
    x = torch.arange(1 << 16, dtype=torch.int64)
    gen = torch.Generator().manual_seed(5)
    divisors = list(range(1, 513)) + torch.randint(513, 1 << 16, (200,), generator=gen).tolist() + [
        (1 << 16) - 1, 1 << 16, 3 * 7 * 11 * 13 * 17]
    d = torch.tensor([v for v in divisors if v > 1])
    magic = ((1 << 32) + d - 1) // d  # as fastdiv() computes it, 64 divisors at a time
    for lo in range(0, len(d), 64):
        got = (x[None, :] * magic[lo:lo + 64, None]) >> 32
        bad = got != x[None, :] // d[lo:lo + 64, None]
        assert not bad.any(), f"FastDiv wrong for d = {d[lo:lo + 64][bad.any(1)].tolist()}"
    assert torch.equal(fastdiv(x, 1), x)


def test_kernel_algorithm_seed_shape():
    """The seed shape: 16384 hits, one batch of 16 per lane, several batches of tokens."""
    ids, counts, S = _problem(64, 8, 4, 512, "partial", "skewed")
    assert_same(emulate_kernel(ids, counts, 64, 512, S), build_tables_golden(ids, counts, 64, 512, S))


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


def test_op_fields_are_the_contract_order():
    """The op returns bare tensors; the dispatcher builds Tables from them by position."""
    from service.kernels import schedule

    assert schedule.FIELDS == tuple(f.name for f in dataclasses.fields(Tables))


def test_import_loads_nothing_and_cpu_falls_back():
    from service.kernels import schedule
    from service.moe.serial import build_tables

    ids, counts, S = _problem(8, 2, 2, 5, "partial", "balanced")
    tables = build_tables(ids, counts, 8, 5, S)
    assert_same(tables, build_tables_golden(ids, counts, 8, 5, S))
    assert not schedule.use_cuda_op(ids, 8)  # CPU ids never take the op
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
    got = Tables(*schedule.build_tables_cuda(ids.to(dev, torch.int32), counts.to(dev, torch.int32), E, C, S))
    assert_same(got, golden)
    again = Tables(*schedule.build_tables_cuda(ids.to(dev, torch.int32), counts.to(dev, torch.int32), E, C, S))
    assert_same(again, golden)  # deterministic: same tables on every run
    check_invariants(got.to("cpu"), ids, counts, E, C)


@pytest.mark.gpu
def test_dispatcher_takes_the_op_on_cuda():
    """service.moe.serial.build_tables: the op for CUDA ids within its limits, same values as golden."""
    from service.moe.serial import build_tables

    schedule = _require_op()
    E, K, R, C = 16, 4, 4, 97
    ids, counts, S = _problem(E, K, R, C, "partial", "skewed")
    dev = torch.device("cuda")
    assert schedule.use_cuda_op(ids.to(dev), E)
    tables = build_tables(ids.to(dev), counts.to(dev), E, C, S)
    assert isinstance(tables, Tables) and tables.slots.is_cuda
    assert_same(tables, build_tables_golden(ids, counts, E, C, S))


def _buffers(t: Tables) -> tuple[torch.Tensor, ...]:
    """The tables' tensors in field order (dataclasses.astuple would copy them)."""
    return tuple(getattr(t, f.name) for f in dataclasses.fields(t))


def _empty_tables(E, K, R, C, S, dev) -> Tables:
    i32 = dict(dtype=torch.int32, device=dev)
    return Tables(expert_offsets=torch.full((E + 1,), -7, **i32), block_expert=torch.full((S // BM,), -7, **i32),
                  slots=torch.full((R * C, K), -7, **i32), row_token=torch.full((S,), -7, **i32),
                  pull_order=torch.full((R * C,), -7, **i32), job_order=torch.full((R * C,), -7, **i32))


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
            written = schedule.build_tables_cuda(ids, counts, E, C, S, out=_buffers(out))
            assert all(a is b for a, b in zip(written, _buffers(out), strict=True))  # written in place, returned
        else:
            for buf, result in zip(_buffers(out), _buffers(torch_tables.build_tables(ids, counts, E, C, S)),
                                   strict=True):
                buf.copy_(result)

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
        for t in _buffers(out):
            t.fill_(-7)  # poison: every element must be rewritten by the replay
        graph.replay()
        torch.cuda.synchronize()
        assert_same(out, build_tables_golden(new_ids, new_counts, E, C, S))


ENTRY_CHECKS = r"""
import sys
import torch
from service.config import BM
from service.kernels import schedule
from tests.kernels.test_schedule import _problem, _empty_tables

available, reason = schedule.load()
if not available:
    print("SKIP", reason)
    sys.exit(0)
dev = torch.device("cuda")
E, K, R, C = 8, 2, 2, 5
ids, counts, S = _problem(E, K, R, C, "full", "balanced")
ids, counts = ids.to(dev, torch.int32), counts.to(dev, torch.int32)
op, out_op = torch.ops.moe.build_tables, torch.ops.moe.build_tables_out
good = _empty_tables(E, K, R, C, S, dev)
bufs = lambda t: (t.expert_offsets, t.block_expert, t.slots, t.row_token, t.pull_order, t.job_order)
cases = [
    ("cannot hold the worst case", lambda: op(ids, counts, E, C, BM)),
    ("E must be in", lambda: op(ids, counts, 5000, C, 5000 * BM)),
    ("E must be in", lambda: op(ids, counts, 0, C, S)),
    ("int32", lambda: op(ids.long(), counts, E, C, S)),
    ("int32", lambda: op(ids, counts.long(), E, C, S)),
    (r"rows, expected R\*C", lambda: op(ids[:-1], counts, E, C, S)),
    (r"must be \[R\*C, K\]", lambda: op(ids.view(-1), counts, E, C, S)),
    ("must be positive", lambda: op(ids, counts, E, 0, S)),
    ("multiple of BM", lambda: op(ids, counts, E, C, S + 1)),
    ("CPU", lambda: op(ids.cpu(), counts.cpu(), E, C, S)),  # no CPU kernel: the dispatcher refuses
    ("CUDA tensor", lambda: op(ids, counts.cpu(), E, C, S)),
    ("exceeds", lambda: op(torch.zeros(70000, 1, dtype=torch.int32, device=dev),
                           torch.tensor([70000], dtype=torch.int32, device=dev), E, 70000, 2 ** 20)),
    ("contiguous", lambda: op(ids.t().contiguous().t(), counts, E, C, S)),
    ("slots must have", lambda: out_op(ids, counts, E, C, *bufs(good)[:2], good.slots[:-1], *bufs(good)[3:])),
    ("row_token must be", lambda: out_op(ids, counts, E, C, *bufs(good)[:3], good.row_token.view(-1, BM),
                                          *bufs(good)[4:])),
    ("job_order must be int32", lambda: out_op(ids, counts, E, C, *bufs(good)[:5], good.job_order.long())),
]
import re
for pattern, call in cases:
    try:
        call()
    except RuntimeError as exc:
        assert re.search(pattern, str(exc)), f"{pattern!r} not in {exc}"
        print("ok", pattern)
        continue
    raise AssertionError(f"no error for {pattern!r}")
torch.cuda.synchronize()  # nothing was launched with bad arguments: no sticky CUDA error either
print("ALL OK")
"""


@pytest.mark.gpu
def test_cuda_op_entry_checks():
    """Every bad argument raises a clean RuntimeError before any data is touched. In a child
    process, so that a crash shows up as a failed test with its output, not a dead session."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    schedule = _require_op()
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", ENTRY_CHECKS], capture_output=True,
                          text=True, cwd=root, env=env, timeout=120)
    assert proc.returncode == 0 and "ALL OK" in proc.stdout, (
        f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    assert schedule.fits_cuda_op(2 * 5, 2, 8)
