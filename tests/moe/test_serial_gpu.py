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
    with WorkerGroup(cfg, device="cuda", seed=0, backend="serial", start_timeout_s=600) as group:
        assert group.backend == "serial"
        steps = 0
        for kind in ("balanced", "skewed"):
            for T in (1, 333, cfg.tokens_per_step, cfg.tokens_per_step + 100):
                x = torch.randn(T, cfg.H, generator=gen).to(torch.bfloat16)
                ids, w = routing(T, cfg.E, cfg.K, kind, gen)
                out = group.forward(x, ids.int(), w)
                steps += -(-T // cfg.tokens_per_step)
                ref = moe_reference(x.cuda().float(), ids.cuda(), w.cuda(), gate, up, down).cpu()
                err = rel_err(out, ref)
                print(f"seed shape R=1 {kind} T={T}: rel err {err:.2e}")  # noqa: T201 (the figures, for pytest -s)
                assert err <= TOL[torch.bfloat16], (T, kind, err)
                assert torch.isfinite(out).all()
        assert group.seq == steps


@pytest.mark.parametrize("gemm,graph", [("torch", False), ("triton", False), ("triton", True)])
def test_serial_layer_gemm_impls_in_process(gemm, graph):
    """Both GEMM paths of the serial backend, in process (R=1), odd shape, poisoned buffers; and the
    step captured in a CUDA graph (graph=True), replayed on new rows, counts and routing."""
    from service.config import LayerConfig
    from service.moe.serial import SerialLayer
    from service.moe.weights import synthetic_rank_weights

    cfg = LayerConfig(E=12, H=384, I=320, K=3, R=1, C=300, dtype=torch.bfloat16)
    dev = torch.device("cuda")
    layer = SerialLayer(cfg, synthetic_rank_weights(cfg, 0, seed=1, device=dev), rank=0, device=dev, gemm=gemm,
                        graph=graph)
    assert layer.gemms.impl == gemm and (layer._graph is not None) == graph
    weights = [t.to(dev) for t in full_weights(cfg, 1)]
    gen = torch.Generator().manual_seed(3)
    for seq, (T, kind) in enumerate([(1, "balanced"), (299, "skewed"), (300, "empty_expert")], start=1):
        layer.x_in.fill_(float("nan"))  # rows past T and padding rows (which read some token row) are garbage
        if gemm == "triton":
            layer.gemms.h.fill_(float("nan"))
            layer.gemms.d.fill_(float("nan"))
        else:
            layer.gemms.A.fill_(float("nan"))
        x = torch.randn(T, cfg.H, generator=gen).to(torch.bfloat16).to(dev)
        ids, w = routing(T, cfg.E, cfg.K, kind, gen)
        out = layer.forward(x, ids.int().to(dev), w.to(dev), seq=seq)
        layer.check_seq(seq)
        ref = moe_reference(x.float(), ids.to(dev), w.to(dev), *weights)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) <= TOL[torch.bfloat16], (T, kind, rel_err(out, ref))


def test_fused_backend_through_the_group():
    """The rank group picks the fused backend when asked and it can run (R=1 on one GPU)."""
    from service.config import LayerConfig

    cfg = LayerConfig(E=16, H=512, I=384, K=4, R=1, C=256, dtype=torch.bfloat16)
    weights = [t.cuda() for t in full_weights(cfg, 2)]
    gen = torch.Generator().manual_seed(5)
    with WorkerGroup(cfg, device="cuda", seed=2, backend="fused", start_timeout_s=600) as group:
        assert group.backend == "fused"
        for T in (1, 200, 256, 700):
            x = torch.randn(T, cfg.H, generator=gen).to(torch.bfloat16)
            ids, w = routing(T, cfg.E, cfg.K, "skewed", gen)
            out = group.forward(x, ids.int(), w)
            ref = moe_reference(x.cuda().float(), ids.cuda(), w.cuda(), *weights).cpu()
            assert rel_err(out, ref) <= TOL[torch.bfloat16], (T, rel_err(out, ref))
        slot = group.acquire_slot()
        try:
            slot.x[:5].normal_()
            slot.ids[:5] = torch.randint(0, cfg.E, (5, cfg.K), dtype=torch.int32)
            slot.w[:5] = 0.25
            stats = group.run(slot, 5)
        finally:
            group.release(slot)
        assert stats.backend == "fused" and stats.exposed_comm_s >= 0 and stats.layer_s > 0
