"""The portable grouped GEMM (service.moe.grouped) and the serial layer's packed loop: real rows
only, against a plain per-row product."""

from __future__ import annotations

import torch

from service.moe import grouped
from service.moe.tables import build_tables
from tests.helpers import routing


def test_loop_computes_real_rows_only(monkeypatch):
    E, K, C, H, N = 6, 2, 37, 24, 40
    gen = torch.Generator().manual_seed(5)
    ids, _ = routing(C, E, K, "empty_expert", gen)          # some experts get no token
    S = -(-(C * K + E * 127) // 128) * 128
    t = build_tables(ids.int(), torch.tensor([C - 4]), E, C, S)  # 4 padding tokens at the end
    rows = grouped.real_rows(t.expert_offsets, t.row_token)
    off = t.expert_offsets.tolist()
    for e in range(E):  # real rows lead the run, padding rows follow
        run = t.row_token[off[e]:off[e + 1]]
        assert rows[e] == int((run >= 0).sum()) and bool((run[:rows[e]] >= 0).all())
    assert sum(rows) == (C - 4) * K and 0 in rows

    # The packed hits (as SerialLayer's loop lays them out): expert e's rows at packed[e]..packed[e+1].
    packed = [0]
    for n in rows:
        packed.append(packed[-1] + n)
    a = torch.randn(packed[-1], H, generator=gen)
    b = torch.randn(E, H, N, generator=gen)
    computed = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda x, y, out: (computed.append(x.shape[0]), mm(x, y, out=out))[1])
    out = grouped.grouped_mm_loop(a, b, torch.tensor(packed))
    assert out.shape == (packed[-1], N)
    assert computed == [n for n in rows if n]  # every hit once, no padding row, no empty expert
    for e in range(E):
        lo, hi = packed[e], packed[e + 1]
        torch.testing.assert_close(out[lo:hi], a[lo:hi] @ b[e])


def test_serial_packed_loop_matches_the_reference_with_biases():
    """SerialLayer's per-expert loop (CPU): hits packed, slots renumbered, biases by packed row's
    expert; R=1, T=1 and an odd T with empty experts, against the fp32 reference."""
    from service.config import Activation, LayerConfig
    from service.moe.reference import moe_reference
    from service.moe.serial import SerialLayer
    from service.moe.weights import RankWeights
    from tests.helpers import TOL, random_experts, rel_err, slice_rank

    cfg = LayerConfig(E=7, H=20, I=12, K=3, R=1, C=23, dtype=torch.float32, act=Activation("gpt_oss", limit=7.0),
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
