"""The Hopper CUDA tile's host side, on the CPU (service.kernels.cuda_tile, GemmConfig.cuda_tile):
its constants against csrc/gemm_sm90/gemm1_sm90.h, every refusal (no silent fallback), the switch,
and the layout properties the kernel relies on, checked on real schedule tables. The compile checks
(ptxas registers, spills, wgmma serialisation) are in test_compile.py; the GPU run in
test_cuda_tile_gpu.py.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from service.config import BM, Activation
from service.kernels import cuda_tile, tuning
from service.kernels.grouped_gemm import GemmConfig, gemm1_swiglu, gemm2
from tests.helpers import routing

ROOT = Path(__file__).resolve().parents[2]
TILE = GemmConfig(BN=128, BK=64, num_warps=8, num_stages=4, queue=True, cuda_tile=True)


def test_constants_match_the_header():
    text = (ROOT / "csrc" / "gemm_sm90" / "gemm1_sm90.h").read_text()
    values = {name: int(v) for name, v in re.findall(r"constexpr int (k\w+) = (\d+);", text)}
    assert values == {"kTileRows": cuda_tile.TILE_ROWS, "kTileCols": cuda_tile.TILE_COLS,
                      "kTileDepth": cuda_tile.TILE_DEPTH, "kStages": cuda_tile.STAGES, "kThreads": cuda_tile.THREADS,
                      "kVariants": len(cuda_tile.VARIANTS)}
    # The variants' names in the enum's order: the index is what the launch passes.
    enum = re.search(r"enum Gemm1Variant : int \{([^}]*)\}", text).group(1)
    members = [(name.strip(), int(v)) for name, v in (m.split("=") for m in enum.split(","))]
    assert [(f"k{n.capitalize()}" if n != "n256" else "kN256", i) for i, n in enumerate(cuda_tile.VARIANTS)] == members
    assert cuda_tile.TILE_ROWS == BM, "one tile is one row block of the gathered layout"
    # 4 stages of A [128 x 64] + W [64 x 256] bf16, the barriers and 1 KB of alignment, within sm_90's 227 KB.
    assert cuda_tile.SMEM_BYTES == 196_608 and cuda_tile.SMEM_BYTES + 1024 + 256 <= 232_448


def _args(S=256, N=40, H=128, Ir=128, E=3, dtype=torch.bfloat16):
    a = torch.randn(N, H).to(dtype)
    w13 = torch.randn(E, H, 2 * Ir).to(dtype)
    block_expert = torch.tensor([0, E], dtype=torch.int32)[: S // BM].contiguous()
    row_token = torch.full((S,), -1, dtype=torch.int32)
    row_token[:N] = torch.arange(N, dtype=torch.int32)
    out = torch.empty(S, Ir, dtype=dtype)
    return a, w13, block_expert, out, row_token


def test_queue_counter_checked():
    from service.kernels.grouped_gemm import check_queue, queue_counter

    counter = queue_counter(torch.device("cpu"))
    assert check_queue(counter, counter.device) is counter and counter.tolist() == [0, 0]
    assert check_queue(None, counter.device).tolist() == [0, 0]  # a fresh one
    with pytest.raises(ValueError, match="queue must be int32 \\[2\\]"):
        check_queue(torch.zeros(1, dtype=torch.int32), counter.device)


def test_check_args_accepts_a_valid_call():
    assert cuda_tile.check_args(*_args()) == (256, 128)


@pytest.mark.parametrize("change,error,match", [
    (lambda a: a.update(a=a["a"].half()), TypeError, "bf16 only"),
    (lambda a: a.update(out=a["out"][:, :64]), ValueError, "out must be"),
    (lambda a: a.update(w13=a["w13"][:, :64]), ValueError, "H=64 rows per expert"),
    (lambda a: a.update(row_token=a["row_token"][:200]), ValueError, "multiple of BM"),
    (lambda a: a.update(row_token=a["row_token"].long()), ValueError, "row_token must be int32"),
    (lambda a: a.update(block_expert=a["block_expert"][:1]), ValueError, "block_expert must be int32"),
    (lambda a: a.update(a=a["a"].t().contiguous().t()), ValueError, "contiguous"),
    (lambda a: a.update(a=a["a"][:0]), ValueError, "at least one row"),
], ids=["fp16", "out_shape", "w13_rows", "S", "row_token_dtype", "block_expert", "strided", "no_rows"])
def test_check_args_refuses(change, error, match):
    names = ("a", "w13", "block_expert", "out", "row_token")
    args = dict(zip(names, _args(), strict=True))
    change(args)
    with pytest.raises(error, match=match):
        cuda_tile.check_args(*(args[n] for n in names))


@pytest.mark.parametrize("dtype,act,bias,H,Ir,match", [
    (torch.float16, Activation(), None, 128, 128, "bf16 only"),
    (torch.bfloat16, Activation("gelu_tanh"), None, 128, 128, "silu"),
    (torch.bfloat16, Activation(limit=7.0), None, 128, 128, "clamp"),
    (torch.bfloat16, Activation(), torch.zeros(3, 256), 128, 128, "no bias"),
    (torch.bfloat16, Activation(), None, 96, 128, "H % 64"),
    (torch.bfloat16, Activation(), None, 128, 192, "Ir % 128"),
])
def test_layer_reason(dtype, act, bias, H, Ir, match):
    assert match in cuda_tile.layer_reason(dtype, act, bias, H, Ir)
    assert cuda_tile.layer_reason(torch.bfloat16, Activation(), None, 4096, 768) is None  # the seed share


def test_an_unknown_variant_is_refused():
    a, w13, block_expert, out, row_token = _args()
    with pytest.raises(ValueError, match="variant must be one of"):
        cuda_tile.gemm1_swiglu(a, w13, block_expert, out=out, row_token=row_token, variant="n512")


def test_the_variant_comes_from_the_config():
    """GemmConfig.cuda_variant picks the CUDA tile's mainloop: a tuned file carries it (round trip),
    a name the tile does not know is refused when the file is read and at the launch, and it means
    nothing without cuda_tile (refused rather than ignored)."""
    n256 = dataclasses.replace(TILE, cuda_variant="n256")
    assert tuning.config_from_dict(tuning.config_to_dict(n256)) == n256
    assert tuning.config_to_dict(n256)["cuda_variant"] == "n256"
    assert "cuda_variant" not in tuning.config_to_dict(TILE)
    with pytest.raises(ValueError, match="cuda_variant must be one of"):
        tuning.config_from_dict({**tuning.config_to_dict(TILE), "cuda_variant": "n512"})
    with pytest.raises(AssertionError, match="needs cuda_tile"):
        GemmConfig(BN=128, BK=64, num_warps=8, num_stages=4, cuda_variant="n256")
    a, w13, block_expert, out, row_token = _args()
    with pytest.raises(ValueError, match="variant must be one of"):  # the launch reads it (before the device)
        gemm1_swiglu(a, w13, block_expert, config=dataclasses.replace(TILE, cuda_variant="n512"), out=out,
                     row_token=row_token)


def test_the_switch_never_falls_back():
    """gemm1_swiglu with GemmConfig.cuda_tile goes to the CUDA tile, which refuses a CPU device
    instead of running the Triton tile or torch (here: no GPU, so the refusal is what we see)."""
    a, w13, block_expert, out, row_token = _args()
    assert "needs a CUDA device" in cuda_tile.device_reason(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="cuda_tile: the CUDA tile needs a CUDA device"):
        gemm1_swiglu(a, w13, block_expert, config=TILE, out=out, row_token=row_token)
    with pytest.raises(RuntimeError, match="silu"):  # the layer's limits come first, on any device
        gemm1_swiglu(a, w13, block_expert, config=TILE, out=out, row_token=row_token, act=Activation("gelu_tanh"))
    with pytest.raises(ValueError, match="GEMM2 has no CUDA tile"):
        gemm2(out, w13[:, :128, :128].contiguous(), block_expert, config=TILE)


@pytest.mark.parametrize("field", [dict(BN=64), dict(BK=128), dict(queue=False), dict(split_tail=False),
                                   dict(pair=True), dict(w_desc=True), dict(pn_major=True), dict(ctas_per_sm=2)],
                         ids=lambda f: next(iter(f)))
def test_config_says_what_the_tile_runs(field):
    fields = dict(BN=128, BK=64, num_warps=8, num_stages=4, queue=True, cuda_tile=True) | field
    with pytest.raises(AssertionError, match="the CUDA tile is BN=128"):
        GemmConfig(**fields)


def test_tuning_files_carry_the_switch_and_fused_refuses_it():
    from service.kernels import tuning
    from service.kernels.fused_kernels import Plan

    assert tuning.config_from_dict(tuning.config_to_dict(TILE)) == TILE
    assert "cuda_tile" not in tuning.config_to_dict(GemmConfig(BN=128, BK=64, num_warps=8, num_stages=4))
    for path in tuning.CONFIG_DIR.glob("*.json"):  # the default stays the Triton tile until measured faster
        assert "cuda_tile" not in path.read_text(), path.name
    with pytest.raises(AssertionError, match="serial GEMM1's"):
        Plan(num_programs=4, num_comm1=0, num_compute2=4, join=True, config1=TILE,
             config2=GemmConfig(BN=256, BK=64, num_warps=8, num_stages=4))


@pytest.mark.parametrize("kind,T", [("balanced", 700), ("skewed", 700), ("empty_expert", 700), ("single", 300),
                                    ("balanced", 1), ("balanced", 0)])
def test_tables_give_what_the_tile_assumes(kind, T):
    """The kernel writes exactly the rows with row_token >= 0 of used blocks, and its second consumer
    warp group skips a block whose row 64 is padding. Both are right only if, in the tables the
    layers build, an expert's real rows lead its run (so row 64 padding means rows 64..127 are),
    blocks past the last expert (E) hold no real row, and every real row lies in a used block."""
    from service.moe.tables import build_tables

    E, K, C = 16, 4, 700
    gen = torch.Generator().manual_seed(T + len(kind))
    ids, _ = routing(T, E, K, kind, gen)
    ids = torch.cat([ids, torch.zeros(C - T, K, dtype=ids.dtype)]).int()  # [C, K], padding tokens past T
    S = -(-(C * K + E * (BM - 1)) // BM) * BM
    tables = build_tables(ids, torch.tensor([T], dtype=torch.int32), E, C, S)
    rt = tables.row_token.view(-1, BM)  # [S/BM, BM]
    used = tables.block_expert < E
    assert int((rt >= 0).sum()) == T * K, "every hit on one row"
    assert not (rt[~used] >= 0).any(), "a real row in an unused block: the tile would never compute it"
    real = rt >= 0
    assert not (real[:, 1:] & ~real[:, :-1]).any(), "inside a block, real rows lead"
    half = used & ~real[:, BM // 2]
    if T == 1:  # one hit on each of K experts: K half tails, the case the skip is for
        assert int(half.sum()) == K
    assert not real[half][:, BM // 2:].any(), "a half tail with real rows past 64: warp group 2 would drop them"
    if kind == "empty_expert" and T:
        counts = torch.bincount(ids[:T].reshape(-1).long(), minlength=E)
        assert (counts == 0).any(), "the routing must leave experts without tokens"
