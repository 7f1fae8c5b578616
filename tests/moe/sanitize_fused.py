"""A few fused steps on a tiny shape, eager (no graph), for compute-sanitizer (bench/gpu_fused.sh).

    compute-sanitizer --tool memcheck python tests/moe/sanitize_fused.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from service.config import LayerConfig  # noqa: E402
from service.moe.fused import FusedLayer  # noqa: E402
from service.moe.reference import moe_reference  # noqa: E402
from service.moe.weights import RankWeights  # noqa: E402
from tests.helpers import rel_err, routing, slice_rank  # noqa: E402


def main() -> None:
    cfg = LayerConfig(E=4, H=64, I=32, K=2, R=1, C=24, dtype=torch.bfloat16)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(cfg.E, cfg.I, cfg.H, generator=gen) / 8).bfloat16().float(), \
        (torch.randn(cfg.E, cfg.I, cfg.H, generator=gen) / 8).bfloat16().float(), \
        (torch.randn(cfg.E, cfg.H, cfg.I, generator=gen) / 6).bfloat16().float()
    layer = FusedLayer(cfg, RankWeights(*slice_rank(gate, up, down, 0, 1)), rank=0, device=dev, graph=False,
                       num_programs=8, num_comm1=2, num_compute2=6)
    worst = 0.0
    for seq, n in enumerate((24, 1, 0, 17), start=1):
        x = torch.randn(n, cfg.H, generator=gen).bfloat16()
        ids, w = routing(n, cfg.E, cfg.K, "balanced", gen)
        out = layer.forward(x.to(dev), ids.int().to(dev), w.to(dev), seq).clone()
        layer.check_seq(seq)
        if n:
            ref = moe_reference(x.float().to(dev), ids.to(dev), w.to(dev), gate.to(dev), up.to(dev), down.to(dev))
            worst = max(worst, rel_err(out, ref))
    sys.stdout.write(f"sanitize_fused: 4 steps, worst relative error {worst:.2e}\n")
    assert worst < 2e-2


if __name__ == "__main__":
    main()
