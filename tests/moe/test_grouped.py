"""The portable grouped GEMM (service.moe.grouped): real rows only, against a plain per-row product."""

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

    a = torch.randn(S, H, generator=gen)
    b = torch.randn(E, H, N, generator=gen)
    computed = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda x, y, out: (computed.append(x.shape[0]), mm(x, y, out=out))[1])
    out = grouped.grouped_mm_loop(a, b, t.expert_offsets, rows)
    assert sum(computed) == sum(rows) and all(n > 0 for n in computed)  # no padding row, no empty expert
    for e in range(E):
        lo = off[e]
        torch.testing.assert_close(out[lo:lo + rows[e]], a[lo:lo + rows[e]] @ b[e])
