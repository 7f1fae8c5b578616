"""Pair tiles (GemmConfig.pair) on a GPU, against the fp32 reference and the BM-row tiles (marked gpu).

The lead's A/B run turns pair tiles on from bench/gpu_core.sh's measurement; this file is what that
run checks first (about a minute on an H200): GEMM1 and GEMM2 with the device's tile configs and
tuning.pair_config of them, the layout's row_token (real rows lead each expert's run, as in both
layers), split_tail on and off, both tile orders; then the fused layer at R = 1 with pair tiles in
kernel 1, and in kernel 2 or not. The interpreter cases (test_grouped_gemm.py,
test_fused_interpreter.py) check the same on the CPU, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import pytest
import torch

from service.config import BM, LayerConfig, round_up
from tests.helpers import TOL, rel_err, routing, slice_rank
from tests.kernels.test_grouped_gemm import _routing_rows, layout_real_rows, make_block_expert

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (E, H, Ir, hits): odd sizes (K and N tiles masked) and the seed share.
SHAPES = [(5, 200, 72, 1700), (64, 4096, 768, 16384)]


def _layout(E, H, Ir, hits, kind, seed):
    """Tokens x [S, H] shuffled behind the layout's row_token (padding rows -1), W13, block_expert,
    expert_offsets, and the masks of real rows and of split_tail's skipped padding halves."""
    gen = torch.Generator().manual_seed(seed)
    rows = _routing_rows(kind, E, hits, gen)
    S = round_up(hits + E * (BM - 1), BM)  # capacity layout, as LayerConfig.S
    block_expert, offsets = make_block_expert(rows, S // BM)
    real, skipped = layout_real_rows(rows, S // BM)
    x = torch.randn(S, H, generator=gen).bfloat16()
    w13 = (torch.randn(E, H, 2 * Ir, generator=gen) / math.sqrt(H)).bfloat16()
    row_token = torch.where(real, torch.randperm(S, generator=gen), -1).int()
    pairs = sum((-(-n // BM) - (1 if 0 < n % BM <= BM // 2 else 0)) // 2 for n in rows)
    dev = torch.device("cuda")
    return (x.to(dev), w13.to(dev), block_expert.to(dev), offsets.to(dev), row_token.to(dev), real.to(dev),
            skipped.to(dev), pairs)


@pytest.mark.parametrize("mode", ["gemm1", "gemm2"])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "holes"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}_H{}_Ir{}_hits{}".format(*s))
def test_gpu_pair_tiles_match_reference(shape, kind, mode):
    from service.kernels import tuning
    from service.kernels.grouped_gemm import gemm1_swiglu, gemm1_swiglu_ref, gemm2, gemm2_ref

    E, H, Ir, hits = shape
    x, w13, block_expert, offsets, row_token, real, skipped, pairs = _layout(E, H, Ir, hits, kind, seed=hits + E)
    assert pairs > 0, "the routing must give experts of two full blocks or more"
    base = tuning.lookup_for_device(x.device, mode, E, H, Ir)
    paired = tuning.pair_config(base, tuning.smem_per_block(x.device), swiglu=mode == "gemm1")
    if mode == "gemm1":
        a = x[row_token.clamp(min=0).long()]  # [S, H] the rows as GEMM1 reads them (padding rows: any)
        ref, n = gemm1_swiglu_ref(a, w13, block_expert), Ir
        run = partial(gemm1_swiglu, x, w13, block_expert, row_token=row_token, expert_offsets=offsets)
    else:  # GEMM2 on act-like rows [S, Ir], W2 [E, Ir, H]
        gen = torch.Generator().manual_seed(hits)
        a = torch.randn(x.shape[0], Ir, generator=gen).bfloat16().to(x.device)
        w2 = (torch.randn(E, Ir, H, generator=gen) / math.sqrt(Ir)).bfloat16().to(x.device)
        ref, n = gemm2_ref(a, w2, block_expert), H
        run = partial(gemm2, a, w2, block_expert, row_token=row_token, expert_offsets=offsets)
    for split in (True, False):
        computed = (block_expert < E).repeat_interleave(BM) & ~(skipped if split else torch.zeros_like(skipped))
        outs = {}
        variants = [("rows", base), ("pair", paired)]
        if split:  # the other tile order once (each variant is a compile)
            variants.append(("pair_order", dataclasses.replace(paired, queue=not base.queue, pn_major=True)))
        for name, config in variants:
            out = torch.full((x.shape[0], n), float("nan"), dtype=x.dtype, device=x.device)  # poisoned
            run(config=dataclasses.replace(config, split_tail=split), out=out)
            torch.cuda.synchronize()
            assert torch.isfinite(out[computed]).all(), f"{name} split={split}: NaN left in computed rows"
            assert torch.isnan(out[~computed]).all(), f"{name} split={split}: rows outside the tiles written"
            assert rel_err(out[real], ref[real]) <= TOL[torch.bfloat16], (name, split, rel_err(out[real], ref[real]))
            outs[name] = out[computed].float()
        # Same sums in the same K order, other tile shapes: within rounding of the BM-row tiles.
        assert rel_err(outs["pair"], outs["rows"]) <= TOL[torch.bfloat16]
        if split:
            assert torch.equal(outs["pair_order"], outs["pair"]), "the pair tiles' order changed bits"


@pytest.mark.parametrize("graph,pair2", [(True, True), (False, True), (True, False)],
                         ids=["graph_both", "eager_both", "graph_gemm1"])
def test_gpu_fused_layer_with_pair_tiles(graph, pair2):
    """FusedLayer at R = 1 with pair tiles in kernel 1 and in kernel 2 (pair2) or BM-row tiles there:
    balanced, skewed, T=1, an empty step and all tokens on K experts against the fp32 reference."""
    from service.kernels import tuning
    from service.moe.fused import FusedLayer
    from service.moe.reference import moe_reference
    from service.moe.weights import RankWeights

    E, H, Ir, K, C = 4, 512, 192, 2, 600  # ~300 hits per expert: a pair, then a half tail
    cfg = LayerConfig(E=E, H=H, I=Ir, K=K, R=1, C=C, dtype=torch.bfloat16)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    gate, up, down = ((torch.randn(*s, generator=gen) / math.sqrt(s[2])).bfloat16().float()
                      for s in ((E, Ir, H), (E, Ir, H), (E, H, Ir)))
    c1 = tuning.pair_config(tuning.lookup_for_device(dev, "gemm1", E, H, Ir), tuning.smem_per_block(dev), swiglu=True)
    c2 = tuning.lookup_for_device(dev, "gemm2", E, H, Ir)
    c2 = tuning.pair_config(c2, tuning.smem_per_block(dev), swiglu=False) if pair2 else c2
    layer = FusedLayer(cfg, RankWeights(*slice_rank(gate, up, down, 0, 1)), rank=0, device=dev, graph=graph,
                       config1=c1, config2=c2)
    assert layer.plan.config1.pair and layer.plan.config2.pair == pair2
    gate, up, down = gate.to(dev), up.to(dev), down.to(dev)
    for seq, (n, kind) in enumerate([(C, "balanced"), (C, "skewed"), (1, "balanced"), (0, "skewed"),
                                     (C, "single")], start=1):
        x = torch.randn(n, H, generator=gen).bfloat16().to(dev)
        ids, w = routing(n, E, K, kind, gen)
        ids, w = ids.int().to(dev), w.to(dev)
        if kind == "balanced" and n == C:
            counts = torch.bincount(ids.reshape(-1).long(), minlength=E)
            assert int((counts > BM + BM // 2).sum()) > 0, "no expert with two full blocks: no pair tile runs"
        out = layer.forward(x, ids, w, seq).clone()
        layer.check_seq(seq)
        assert out.shape == (n, H)
        if n:
            ref = moe_reference(x.float(), ids, w, gate, up, down)
            assert torch.isfinite(out).all()
            assert rel_err(out, ref) <= TOL[torch.bfloat16], (seq, n, kind, rel_err(out, ref))
