"""The fast kernels' activation variants on a GPU: the serial backend's Triton GEMMs and the fused
kernels, R = 1 in process, for a clamped-SwiGLU (DeepSeek-V4), a GELU-tanh and a gpt-oss model
(biases), against the same fp32 reference (service.moe.reference with the model's activation).

    python -m pytest -q -m gpu tests/moe/test_activations_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from service.config import Activation, LayerConfig
from service.moe.reference import moe_reference
from service.moe.weights import RankWeights
from tests.helpers import TOL, random_experts, rel_err, routing, slice_rank

pytestmark = pytest.mark.gpu

# name -> (activation, biases, input scale): the scale puts a good share of the gate
# pre-activations past the clamp (asserted below), so the clamp is tested, not just compiled.
MODELS = {
    "clamped_swiglu": (Activation("silu", limit=2.0), False, 4.0),
    "gelu_tanh": (Activation("gelu_tanh"), False, 1.0),
    "gpt_oss": (Activation("gpt_oss", limit=2.0), True, 4.0),
    "gpt_oss_unbiased": (Activation("gpt_oss", limit=2.0), False, 4.0),  # MiniMax-M3's experts
}
E, H, I, K, C = 12, 384, 320, 3, 300  # noqa: E741  odd-ish: 12 experts, N tiles masked


def _model(name: str):
    act, biased, scale = MODELS[name]
    cfg = LayerConfig(E=E, H=H, I=I, K=K, R=1, C=C, dtype=torch.bfloat16, act=act, bias=biased)
    gen = torch.Generator().manual_seed(len(name))
    full = tuple(t.bfloat16().float() for t in random_experts(E, H, I, gen))  # exact in bf16
    biases = None
    rw = RankWeights(*slice_rank(*full, 0, 1))
    if biased:
        biases = tuple((torch.randn(E, n, generator=gen) * 0.5).bfloat16().float() for n in (I, I, H))
        rw = RankWeights(rw.w13, rw.w2, b13=torch.cat([biases[0], biases[1]], 1), b2=biases[2])
    return cfg, full, biases, rw, scale, gen


@pytest.mark.parametrize("backend", ["serial", "fused"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_backend_matches_reference(name, backend):
    from service.moe.fused import FusedLayer
    from service.moe.serial import SerialLayer

    cfg, full, biases, rw, scale, gen = _model(name)
    dev = torch.device("cuda")
    rw = RankWeights(*(None if t is None else t.to(dev) for t in (rw.w13, rw.w2, rw.b13, rw.b2)))
    if backend == "serial":
        layer = SerialLayer(cfg, rw, rank=0, device=dev, gemm="triton")
        assert layer.gemms.impl == "triton"
    else:
        layer = FusedLayer(cfg, rw, rank=0, device=dev)
    gate, up, down = (t.to(dev) for t in full)
    b = None if biases is None else tuple(t.to(dev) for t in biases)
    for seq, (T, kind) in enumerate([(1, "balanced"), (C - 1, "skewed"), (C, "empty_expert")], start=1):
        x = (torch.randn(T, H, generator=gen) * scale).bfloat16().to(dev)
        ids, w = routing(T, E, K, kind, gen)
        out = layer.forward(x, ids.int().to(dev), w.to(dev), seq=seq).clone()
        layer.check_seq(seq)
        ref = moe_reference(x.float(), ids.to(dev), w.to(dev), gate, up, down, act=cfg.act, biases=b)
        assert torch.isfinite(out).all()
        err = rel_err(out, ref)
        print(f"{name} {backend} T={T} {kind}: rel err {err:.2e}")  # noqa: T201 (the figures, for pytest -s)
        assert err <= TOL[torch.bfloat16], (name, backend, T, kind, err)
        if cfg.act.limit is not None and T > 1:
            share = float((x.float() @ gate[0].T > cfg.act.limit).float().mean())
            assert share > 0.05, f"inputs too small to reach the clamp ({share:.3f})"
