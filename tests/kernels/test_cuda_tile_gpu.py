"""The Hopper CUDA tile (GemmConfig.cuda_tile, service.kernels.cuda_tile) on an sm_90 GPU (marked gpu).

What the next GPU session runs first (bench/gpu_cuda_tile.sh), written without a device: GEMM1 +
SwiGLU on the tile against the fp32 reference and against the Triton tile, output poisoned with NaN
(rows it must not write stay NaN), fresh random inputs twice through the same buffers (barrier
phases, the tile queue), balanced / skewed routings and experts with zero tokens, odd counts, one
hit, the seed share; the persistent loop with few CTAs (bit-equal to the full grid); a CUDA graph
replay; the refusals on the device; the serial layer at R = 1 with the tile selected by its config.
Every kernel test runs once per mainloop variant (cuda_tile.VARIANTS; the serial layer runs the
default, "base").
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from service.config import BM, Activation, LayerConfig, round_up
from service.kernels.cuda_tile import VARIANTS
from tests.helpers import TOL, rel_err, routing, slice_rank
from tests.kernels.test_grouped_gemm import _routing_rows, make_block_expert

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs an sm_90 GPU (the tile is sm_90a code)")]

each_variant = pytest.mark.parametrize("variant", VARIANTS)

# (E, H, Ir, hits): odd counts; one K step per tile (H = 64: every stage a new tile, so a stage's
# rows are signalled two tiles later) and 3 (fewer than the 4 stages); one hit; the seed share.
SHAPES = [(5, 256, 128, 1700), (4, 64, 128, 200), (3, 192, 256, 333), (8, 512, 128, 1), (64, 4096, 768, 16384)]


def _problem(E, H, Ir, hits, kind, seed):
    """Tokens x [N, H] (each repeated behind ~4 layout rows, as K copies of a token are), W13, the
    layout's block_expert and row_token (real rows lead each expert's run, padding -1), and the
    fp32 reference on the gathered rows."""
    from service.kernels.grouped_gemm import gemm1_swiglu_ref

    gen = torch.Generator().manual_seed(seed)
    rows = _routing_rows(kind, E, hits, gen)
    S = round_up(hits + E * (BM - 1), BM)  # capacity layout, as LayerConfig.S
    block_expert, offsets = make_block_expert(rows, S // BM)
    N = max(1, hits // 4)
    row_token = torch.full((S,), -1, dtype=torch.int32)
    for e, n in enumerate(rows):
        row_token[offsets[e]:offsets[e] + n] = torch.randint(0, N, (n,), generator=gen, dtype=torch.int32)
    dev = torch.device("cuda")
    x = torch.randn(N, H, generator=gen).bfloat16().to(dev)
    w13 = (torch.randn(E, H, 2 * Ir, generator=gen) / math.sqrt(H)).bfloat16().to(dev)
    block_expert, offsets, row_token = block_expert.to(dev), offsets.to(dev), row_token.to(dev)
    ref = gemm1_swiglu_ref(x[row_token.clamp(min=0).long()], w13, block_expert)
    return x, w13, block_expert, offsets, row_token, ref


def _poisoned(S, Ir):
    return torch.full((S, Ir), float("nan"), dtype=torch.bfloat16, device="cuda")


def _decode(out: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Index of the candidate silu(values[i]) nearest to each output."""
    candidates = torch.nn.functional.silu(values.float())  # [V]
    return (out.float()[..., None] - candidates).abs().argmin(dim=-1)


def _mismatches(what: str, out, want, got) -> list[str]:
    """[] when every decoded index is within one bf16 step of the wanted one, else one line naming
    the first wrong (row, column, wanted, decoded)."""
    bad = ((got - want).abs() > 1) | ~torch.isfinite(out.float())
    if not bad.any():
        return []
    rows, cols = bad.nonzero(as_tuple=True)
    first = zip(rows[:12].tolist(), cols[:12].tolist(), strict=True)
    return [f"{what}: {int(bad.sum())} of {bad.numel()} wrong; first (row, col, wanted, got): "
            + ", ".join(f"({r}, {c}, {int(want[r, c])}, {int(got[r, c])})" for r, c in first)]


@each_variant
def test_gpu_cuda_tile_probe_mapping(variant):
    """First, so that a wrong tile says where it is wrong: structured inputs whose outputs name the
    K row and the weight column they came from. Rows: A row t is one-hot at k = t % 256 (H = 256,
    4 K steps), gate W[k, n] = k / 64 (exact in bf16), up W = 1, so out[t, n] = silu(t % 256 / 64):
    a wrong A swizzle, K-major descriptor or stage order shows as decoded k != t % 256. Columns: A
    one-hot at k = 0, gate W[0, n] = n / 64, up W[0, n] = 1 (Ir = 256, two column tiles): out[t, n] =
    silu(n / 64), so a wrong B swizzle, MN-major descriptor (LBO / SBO) or box order shows as decoded
    n != n. Decoding tolerates one step of bf16 rounding."""
    from service.kernels import cuda_tile

    dev = torch.device("cuda")
    E, H, Ir, S = 1, 256, 256, 256
    block_expert = torch.tensor([0, 0], dtype=torch.int32, device=dev)
    tokens = torch.arange(S, dtype=torch.int32, device=dev)
    problems = []
    # Rows and K.
    a = torch.zeros(S, H, device=dev)
    a[torch.arange(S), torch.arange(S) % H] = 1.0
    w13 = torch.empty(E, H, 2 * Ir, device=dev)
    w13[0, :, :Ir] = (torch.arange(H, device=dev) / 64.0)[:, None]
    w13[0, :, Ir:] = 1.0
    out = _poisoned(S, Ir)
    cuda_tile.gemm1_swiglu(a.bfloat16(), w13.bfloat16(), block_expert, out=out, row_token=tokens, variant=variant)
    torch.cuda.synchronize()
    got = _decode(out, torch.arange(H, device=dev) / 64.0)  # [S, Ir] decoded k
    want = (torch.arange(S, device=dev) % H)[:, None].expand_as(got)
    problems += _mismatches("K/row mapping (k)", out, want, got)
    # Columns.
    a = torch.zeros(S, H, device=dev)
    a[:, 0] = 1.0
    w13 = torch.randn(E, H, 2 * Ir, device=dev)
    w13[0, 0, :Ir] = torch.arange(Ir, device=dev) / 64.0
    w13[0, 0, Ir:] = 1.0
    out = _poisoned(S, Ir)
    cuda_tile.gemm1_swiglu(a.bfloat16(), w13.bfloat16(), block_expert, out=out, row_token=tokens, variant=variant)
    torch.cuda.synchronize()
    got = _decode(out, torch.arange(Ir, device=dev) / 64.0)  # [S, Ir] decoded n
    want = torch.arange(Ir, device=dev)[None, :].expand_as(got)
    problems += _mismatches("column mapping (n)", out, want, got)
    assert not problems, "; ".join(problems)


@each_variant
@pytest.mark.parametrize("kind", ["balanced", "skewed", "holes"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}_H{}_Ir{}_hits{}".format(*s))
def test_gpu_cuda_tile_matches_reference_and_triton(shape, kind, variant):
    from service.kernels import cuda_tile, tuning
    from service.kernels.grouped_gemm import gemm1_swiglu

    E, H, Ir, hits = shape
    x, w13, block_expert, offsets, row_token, ref = _problem(E, H, Ir, hits, kind, seed=hits + E + len(kind))
    S = row_token.shape[0]
    real = row_token >= 0
    triton_config = tuning.lookup_for_device(x.device, "gemm1", E, H, Ir)
    gen = torch.Generator().manual_seed(7)
    for round_ in range(2):  # the second round: fresh values through the same buffers
        if round_:
            x.copy_(torch.randn(x.shape, generator=gen).bfloat16())
            w13.copy_((torch.randn(w13.shape, generator=gen) / math.sqrt(H)).bfloat16())
            from service.kernels.grouped_gemm import gemm1_swiglu_ref

            ref = gemm1_swiglu_ref(x[row_token.clamp(min=0).long()], w13, block_expert)
        out = _poisoned(S, Ir)
        cuda_tile.gemm1_swiglu(x, w13, block_expert, out=out, row_token=row_token, variant=variant)
        torch.cuda.synchronize()
        assert torch.isfinite(out[real]).all(), f"round {round_}: a real row left unwritten or not finite"
        assert torch.isnan(out[~real]).all(), f"round {round_}: a padding row or an unused block was written"
        err = rel_err(out[real], ref[real])
        assert err <= TOL[torch.bfloat16], (round_, err)
        triton_out = _poisoned(S, Ir)
        gemm1_swiglu(x, w13, block_expert, config=triton_config, out=triton_out, row_token=row_token,
                     expert_offsets=offsets)
        torch.cuda.synchronize()
        # Same products in the same K order (wgmma k16 steps), other epilogue arithmetic: the rows
        # agree within one bf16 rounding or so, far inside the reference tolerance.
        assert rel_err(out[real], triton_out[real]) <= TOL[torch.bfloat16], rel_err(out[real], triton_out[real])


@each_variant
def test_gpu_cuda_tile_without_gather_and_with_few_ctas(variant):
    """A is the layout itself (no row_token: every row of a used block written); and the persistent
    loop with 1, 3, 7 and 10 CTAs (many tiles each: the stage ring wraps many times) bit-equal to the
    grid, all through one reused tile-queue counter, which every launch must leave at zero. mcast
    (clusters of 2, an even grid of at most num_programs, >= 2) walks its static schedule of 12 units
    (11 blocks in pairs x 2 column tiles) with 1 cluster for 1 and 3 CTAs, 3 for 7 (an odd grid
    rounded down) and 5 for 10 (a ragged stride: 3, 3, 2, 2, 2 units)."""
    from service.kernels import cuda_tile
    from service.kernels.grouped_gemm import gemm1_swiglu_ref, queue_counter

    E, H, Ir, hits = 4, 384, 256, 900
    x, w13, block_expert, _, row_token, _ = _problem(E, H, Ir, hits, "skewed", seed=11)
    a = x[row_token.clamp(min=0).long()].contiguous()  # [S, H]
    used = (block_expert < E).repeat_interleave(BM)
    ref = gemm1_swiglu_ref(a, w13, block_expert)
    counter = queue_counter(x.device)
    out = _poisoned(a.shape[0], Ir)
    cuda_tile.gemm1_swiglu(a, w13, block_expert, out=out, queue=counter, variant=variant)
    torch.cuda.synchronize()
    assert counter.tolist() == [0, 0], "the last CTA did not rewind the tile queue"
    assert torch.isfinite(out[used]).all() and torch.isnan(out[~used]).all()
    assert rel_err(out[used], ref[used]) <= TOL[torch.bfloat16]
    assert (a.shape[0] // BM + 1) // 2 * (Ir // cuda_tile.TILE_COLS) == 12  # the units the docstring counts
    for programs in (1, 3, 7, 10, 1):
        again = _poisoned(a.shape[0], Ir)
        cuda_tile.gemm1_swiglu(a, w13, block_expert, out=again, num_programs=programs, queue=counter,
                               variant=variant)
        torch.cuda.synchronize()
        assert counter.tolist() == [0, 0], f"{programs} CTAs: the tile queue was not rewound"
        assert torch.equal(again[used], out[used]), f"{programs} CTAs changed bits"


@each_variant
def test_gpu_cuda_tile_in_a_graph(variant):
    from service.kernels import cuda_tile
    from service.kernels.grouped_gemm import gemm1_swiglu_ref

    E, H, Ir, hits = 6, 512, 128, 1000
    x, w13, block_expert, _, row_token, ref = _problem(E, H, Ir, hits, "balanced", seed=5)
    real = row_token >= 0
    out = _poisoned(row_token.shape[0], Ir)
    cuda_tile.gemm1_swiglu(x, w13, block_expert, out=out, row_token=row_token, variant=variant)  # first: outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_tile.gemm1_swiglu(x, w13, block_expert, out=out, row_token=row_token, variant=variant)
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen).bfloat16())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = gemm1_swiglu_ref(x[row_token.clamp(min=0).long()], w13, block_expert)
        assert torch.isnan(out[~real]).all()
        assert rel_err(out[real], ref[real]) <= TOL[torch.bfloat16]


def test_gpu_cuda_tile_refusals():
    from service.kernels import cuda_tile

    x, w13, block_expert, _, row_token, _ = _problem(3, 256, 128, 300, "balanced", seed=1)
    with pytest.raises(TypeError, match="bf16 only"):
        cuda_tile.gemm1_swiglu(x.half(), w13.half(), block_expert, row_token=row_token)
    with pytest.raises(RuntimeError, match="silu"):
        cuda_tile.gemm1_swiglu(x, w13, block_expert, row_token=row_token, act=Activation("gelu_tanh"))
    with pytest.raises(RuntimeError, match="no bias"):
        cuda_tile.gemm1_swiglu(x, w13, block_expert, row_token=row_token, bias=torch.zeros_like(w13[:, 0]))
    with pytest.raises(RuntimeError, match="Ir % 128"):
        cuda_tile.gemm1_swiglu(x, w13[:, :, :192].contiguous(), block_expert, row_token=row_token)
    out = torch.empty(row_token.shape[0], w13.shape[2] // 2, dtype=x.dtype, device=x.device)
    queue = torch.zeros(2, dtype=torch.int32, device=x.device)
    with pytest.raises(RuntimeError, match="variant must be in"):  # the op's own check, past the Python one
        getattr(torch.ops.moe, cuda_tile.OP)(x, w13, block_expert, row_token, queue, out, 1, len(VARIANTS))


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_gpu_serial_layer_with_the_cuda_tile(graph, monkeypatch, caplog):
    """SerialLayer at R = 1 whose GEMM1 config says cuda_tile (the switch as the service would set it,
    through the tile config lookup): balanced, skewed, T = 1, an empty step, one expert set for all."""
    from service.kernels import tuning
    from service.moe.reference import moe_reference
    from service.moe.serial import SerialLayer
    from service.moe.weights import RankWeights

    lookup = tuning.lookup_for_device

    def with_tile(device, mode, *args, **kw):
        config = lookup(device, mode, *args, **kw)
        if mode != "gemm1":
            return config
        return dataclasses.replace(config, BN=128, BK=64, queue=True, split_tail=True, pair=False, w_desc=False,
                                   pn_major=False, ctas_per_sm=1, cuda_tile=True)

    monkeypatch.setattr(tuning, "lookup_for_device", with_tile)
    E, H, Ir, K, C = 8, 512, 256, 2, 700
    cfg = LayerConfig(E=E, H=H, I=Ir, K=K, R=1, C=C, dtype=torch.bfloat16)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    gate, up, down = ((torch.randn(*s, generator=gen) / math.sqrt(s[2])).bfloat16().float()
                      for s in ((E, Ir, H), (E, Ir, H), (E, H, Ir)))
    with caplog.at_level("INFO", logger="service.moe.serial"):
        layer = SerialLayer(cfg, RankWeights(*slice_rank(gate, up, down, 0, 1)), rank=0, device=dev, gemm="triton",
                            graph=graph)
    assert layer.gemms.configs[0].cuda_tile and "sm_90a CUDA tile" in caplog.text
    gate, up, down = gate.to(dev), up.to(dev), down.to(dev)
    for seq, (n, kind) in enumerate([(C, "balanced"), (C, "skewed"), (1, "balanced"), (0, "skewed"),
                                     (C, "single")], start=1):
        x = torch.randn(n, H, generator=gen).bfloat16().to(dev)
        ids, w = routing(n, E, K, kind, gen)
        out = layer.forward(x, ids.int().to(dev), w.to(dev), seq).clone()
        layer.check_seq(seq)
        assert out.shape == (n, H)
        if n:
            ref = moe_reference(x.float(), ids.to(dev), w.to(dev), gate, up, down)
            assert torch.isfinite(out).all()
            assert rel_err(out, ref) <= TOL[torch.bfloat16], (seq, n, kind, rel_err(out, ref))
