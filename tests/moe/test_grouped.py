"""The portable grouped GEMM (service.moe.grouped) and the serial layer's packed loop: real rows
only, against a plain per-row product."""

from __future__ import annotations

import pytest
import torch

from service.moe import grouped
from service.moe.tables import build_tables
from tests.helpers import routing


def test_packed_hits_are_the_real_hits_by_expert():
    """pack_hits: every real hit once, in expert order (within an expert by (token, k), as the padded
    layout orders them), padding tokens' hits left out (-1), empty experts with empty runs; R=3 blocks
    of odd C with their own counts, one block empty, and one block (the CPU ranks' step) of one token,
    none and all C."""
    E, K, C = 6, 2, 37
    gen = torch.Generator().manual_seed(5)
    for counts in ([C - 4, 0, 11], [1], [0], [C]):
        R = len(counts)
        ids, _ = routing(R * C, E, K, "empty_expert", gen)   # some experts get no token
        ids = ids.int()
        hits = grouped.pack_hits(ids, torch.tensor(counts), E, C)
        real = [g for g in range(R * C) if g % C < counts[g // C]]
        want = sorted((int(ids[g, k]), g, k) for g in real for k in range(K))  # (expert, token, k)
        assert hits.tokens.tolist() == [g for _, g, _ in want]
        assert hits.experts.tolist() == [e for e, _, _ in want]
        for row, (_, g, k) in enumerate(want):
            assert int(hits.slots[g, k]) == row
        assert bool((hits.slots[[g for g in range(R * C) if g not in set(real)]] == -1).all())
        per_expert = [sum(e == x for x, _, _ in want) for e in range(E)]
        assert hits.offsets.tolist() == [sum(per_expert[:e]) for e in range(E + 1)] and 0 in per_expert
        # The same order as the padded layout's real rows (service.moe.tables).
        S = -(-(R * C * K + E * 127) // 128) * 128
        t = build_tables(ids, torch.tensor(counts), E, C, S)
        assert hits.tokens.tolist() == t.row_token[t.row_token >= 0].tolist()


def test_loop_computes_real_rows_only(monkeypatch):
    """grouped_mm_loop over packed hits: every hit once, no padding row, no empty expert."""
    E, K, C, H, N = 6, 2, 37, 24, 40
    gen = torch.Generator().manual_seed(5)
    ids, _ = routing(C, E, K, "empty_expert", gen)          # some experts get no token
    hits = grouped.pack_hits(ids.int(), torch.tensor([C - 4]), E, C)  # 4 padding tokens at the end
    packed = hits.offsets.tolist()
    rows = [packed[e + 1] - packed[e] for e in range(E)]
    assert sum(rows) == (C - 4) * K and 0 in rows
    a = torch.randn(packed[-1], H, generator=gen)
    b = torch.randn(E, H, N, generator=gen)
    computed = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda x, y, out: (computed.append(x.shape[0]), mm(x, y, out=out))[1])
    out = grouped.grouped_mm_loop(a, b, hits.offsets)
    assert out.shape == (packed[-1], N)
    assert computed == [n for n in rows if n]  # every hit once, no padding row, no empty expert
    for e in range(E):
        lo, hi = packed[e], packed[e + 1]
        torch.testing.assert_close(out[lo:hi], a[lo:hi] @ b[e])


def test_host_grouped_mm_is_the_loop_in_one_call(monkeypatch):
    """grouped_mm_host on the CPU: torch's grouped GEMM where it takes the shape (the CPU preset's
    fp32 rank shapes, bf16) and the result is small, the same product as the loop, empty experts
    included; the loop for a large result, where rows are not multiples of 16 bytes or where this
    torch's `_grouped_mm` refuses (found at the trial)."""

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    E, K, C = 6, 2, 37
    gen = torch.Generator().manual_seed(7)
    ids, _ = routing(C, E, K, "empty_expert", gen)
    hits = grouped.pack_hits(ids.int(), torch.tensor([C - 3]), E, C)
    M = int(hits.offsets[-1])
    for dtype, Kd, N in ((torch.float32, 256, 256), (torch.float32, 128, 256), (torch.bfloat16, 64, 24)):
        assert grouped.host_grouped_mm_reason(dtype, Kd, N) is None, (dtype, Kd, N)
        a = torch.randn(M, Kd, generator=gen).to(dtype)
        b = torch.randn(E, Kd, N, generator=gen).to(dtype)
        out = torch.full((M, N), float("nan"), dtype=dtype)
        with monkeypatch.context() as m:  # one native call: the loop's torch.mm is not reached
            m.setattr(torch, "mm", lambda *args, **kwargs: pytest.fail("the loop ran"))
            got = grouped.grouped_mm_host(a, b, hits.offsets, out=out)
        torch.testing.assert_close(got, grouped.grouped_mm_loop(a, b, hits.offsets))
    # A non-contiguous `a` (rows of 68 bytes apart) takes the loop: the native call wants 16-byte rows.
    wide = torch.randn(M, 17, generator=gen)
    b = torch.randn(E, 16, 16, generator=gen)
    torch.testing.assert_close(grouped.grouped_mm_host(wide[:, :16], b, hits.offsets),
                               grouped.grouped_mm_loop(wide[:, :16].contiguous(), b, hits.offsets))
    # A large result (400 rows of 256 fp32: 400 KB) takes the loop, into `out`: no fresh block a step.
    offsets = torch.tensor([0, 100, 100, 200, 300, 300, 400])
    a, b = torch.randn(400, 64, generator=gen), torch.randn(E, 64, 256, generator=gen)
    out, mm, calls = torch.empty(400, 256), torch.mm, []
    with monkeypatch.context() as m:
        m.setattr(torch, "mm", lambda x, y, out: (calls.append(x.shape[0]), mm(x, y, out=out))[1])
        got = grouped.grouped_mm_host(a, b, offsets, out=out)
    assert calls == [100, 100, 100, 100] and got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got[100:200], a[100:200] @ b[2])
    refused = []

    def refuse(*args, **kwargs):
        refused.append(args[0].dtype)
        raise RuntimeError("no CPU kernel")

    monkeypatch.setattr(torch, "_grouped_mm", refuse)
    try:
        for dtype, Kd, N in ((torch.float32, 18, 24), (torch.float16, 40, 8)):  # 72-byte rows; the trial refused
            grouped.host_grouped_mm_reason.cache_clear()
            a = torch.randn(M, Kd, generator=gen).to(dtype)
            b = torch.randn(E, Kd, N, generator=gen).to(dtype)
            reason = grouped.host_grouped_mm_reason(dtype, Kd, N)
            assert reason and ("16 bytes" in reason if Kd == 18 else "refused" in reason), reason
            torch.testing.assert_close(grouped.grouped_mm_host(a, b, hits.offsets),
                                       grouped.grouped_mm_loop(a, b, hits.offsets))
        assert refused == [torch.float16]  # the fp16 trial alone: the 72-byte shape never called it
    finally:
        grouped.host_grouped_mm_reason.cache_clear()  # the next test's reasons are this torch's


@pytest.mark.parametrize("H", [20, 18])  # torch's CPU grouped GEMM (80-byte rows); the loop (72)
def test_serial_packed_loop_matches_the_reference_with_biases(H):
    """SerialLayer's per-expert loop (CPU): hits packed, slots renumbered, biases by packed row's
    expert; R=1, T=1 and an odd T with empty experts, against the fp32 reference."""
    from service.config import Activation, LayerConfig
    from service.moe.reference import moe_reference
    from service.moe.serial import SerialLayer
    from service.moe.weights import RankWeights
    from tests.helpers import TOL, random_experts, rel_err, slice_rank

    cfg = LayerConfig(E=7, H=H, I=12, K=3, R=1, C=23, dtype=torch.float32, act=Activation("gpt_oss", limit=7.0),
                      bias=True)
    gen = torch.Generator().manual_seed(9)
    gate, up, down = random_experts(cfg.E, cfg.H, cfg.I, gen)
    biases = tuple(torch.randn(*shape, generator=gen) for shape in ((cfg.E, cfg.I), (cfg.E, cfg.I), (cfg.E, cfg.H)))
    w13, w2 = slice_rank(gate, up, down, 0, 1)
    weights = RankWeights(w13, w2, b13=torch.cat(biases[:2], dim=1), b2=biases[2])
    layer = SerialLayer(cfg, weights, rank=0, device=torch.device("cpu"))
    assert layer.gemms.impl == "torch"
    for seq, T in enumerate((1, 17, cfg.C), start=1):
        x = torch.randn(T, cfg.H, generator=gen)
        ids, w = routing(T, cfg.E, cfg.K, "empty_expert", gen)
        out = layer.forward(x, ids.int(), w, seq)
        ref = moe_reference(x, ids, w, gate, up, down, act=cfg.act, biases=biases)
        assert rel_err(out, ref) <= TOL[torch.float32], (T, rel_err(out, ref))


def test_packed_hits_refuse_ids_outside_the_experts():
    """A real token's id outside [0, E) fails the step (the front end refuses it first); a padding
    token's id is never read."""
    E, C = 4, 5
    ids = torch.randint(0, E, (C, 2), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    ids[C - 1] = 1_000  # padding token (count C - 1): ignored
    assert grouped.pack_hits(ids, torch.tensor([C - 1]), E, C).tokens.numel() == (C - 1) * 2
    for bad in (E, -1, 2**31 - 1):  # the last: refused before anything of its size is allocated
        ids[0, 1] = bad
        with pytest.raises(ValueError, match=f"got {bad}"):
            grouped.pack_hits(ids, torch.tensor([C - 1]), E, C)
