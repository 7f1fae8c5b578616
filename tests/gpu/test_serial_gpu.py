"""The serial backend on a GPU (R=1, NCCL) at the seed shape against the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from service.config import preset
from service.moe.reference import full_weights, moe_reference
from service.worker.group import WorkerGroup
from tests.helpers import TOL, rel_err, routing

pytestmark = pytest.mark.gpu


def test_seed_shape_r1_nccl():
    seed = preset("seed")
    cfg = seed.replace(R=1, C=seed.tokens_per_step)  # the whole seed batch (2048 tokens) on one GPU
    gen = torch.Generator().manual_seed(7)
    gate, up, down = (t.cuda() for t in full_weights(cfg, 0))
    with WorkerGroup(cfg, device="cuda", seed=0, start_timeout_s=600) as group:
        steps = 0
        for kind in ("balanced", "skewed"):
            for T in (1, 333, cfg.tokens_per_step, cfg.tokens_per_step + 100):
                x = torch.randn(T, cfg.H, generator=gen).to(torch.bfloat16)
                ids, w = routing(T, cfg.E, cfg.K, kind, gen)
                out = group.forward(x, ids.int(), w)
                steps += -(-T // cfg.tokens_per_step)
                ref = moe_reference(x.cuda().float(), ids.cuda(), w.cuda(), gate, up, down).cpu()
                err = rel_err(out, ref)
                print(f"seed shape R=1 {kind} T={T}: rel err {err:.2e}")
                assert err <= TOL[torch.bfloat16], (T, kind, err)
                assert torch.isfinite(out).all()
        assert group.seq == steps
