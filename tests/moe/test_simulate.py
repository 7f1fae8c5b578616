"""CPU dataflow simulation of the fused algorithm vs the fp32 reference, every rank's shard."""

from __future__ import annotations

import pytest
import torch

from service.moe.reference import full_weights, moe_reference
from service.moe.simulate import simulate_fused
from service.moe.weights import synthetic_rank_weights
from tests.helpers import SIM_TOL, layer, one_thread, random_experts, rel_err, routing, slice_rank  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

# (E, K, R, C, H, Ir): odd sizes, R = 1, C > BM (an expert's run spans several blocks).
SHAPES = [(8, 2, 2, 20, 32, 16), (6, 3, 4, 37, 24, 8), (4, 2, 3, 150, 16, 8), (16, 4, 1, 50, 32, 16)]
COUNT_KINDS = ("full", "partial", "empty_rank")


def rank_counts(R: int, C: int, kind: str, gen: torch.Generator) -> list[int]:
    if kind == "full":
        return [C] * R
    counts = torch.randint(1, C + 1, (R,), generator=gen).tolist()
    if kind == "empty_rank":
        counts[0] = 0
    return counts


def run_case(cfg, counts, routing_kind, gen, rank_weights=None, full=None, seq=1):
    """Per-rank inputs -> (simulated shards, reference shards)."""
    xs, ids, ws = [], [], []
    for n in counts:
        xs.append(torch.randn(n, cfg.H, generator=gen))
        i, w = routing(n, cfg.E, cfg.K, routing_kind, gen)
        ids.append(i)
        ws.append(w)
    if full is None:
        full = random_experts(cfg.E, cfg.H, cfg.I, gen)
    if rank_weights is None:
        rank_weights = [slice_rank(*full, r, cfg.R) for r in range(cfg.R)]
    outs = simulate_fused(xs, ids, ws, rank_weights, cfg, seq=seq)
    refs = [moe_reference(x, i, w, *full) for x, i, w in zip(xs, ids, ws, strict=True)]
    return outs, refs


def assert_shards_close(outs, refs, counts, tol):
    assert len(outs) == len(refs) == len(counts)
    for r, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out.dtype == torch.float32 and out.shape == ref.shape, (f"rank {r}: {tuple(out.shape)} vs "
                                                                       f"{tuple(ref.shape)}")
        assert torch.isfinite(out).all(), f"rank {r}: non-finite output (a garbage row was read)"
        err = rel_err(out, ref)
        assert err <= tol, f"rank {r} (n={counts[r]}): relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("routing_kind", ["balanced", "skewed", "empty_expert"])
@pytest.mark.parametrize("count_kind", COUNT_KINDS)
@pytest.mark.parametrize("E,K,R,C,H,Ir", SHAPES)
def test_simulation_matches_reference(E, K, R, C, H, Ir, count_kind, routing_kind):
    gen = torch.Generator().manual_seed(1000 * E + 100 * K + 10 * R + C + len(count_kind) + len(routing_kind))
    cfg = layer(E, K, R, C, H=H, Ir=Ir)
    counts = rank_counts(R, C, count_kind, gen)
    outs, refs = run_case(cfg, counts, routing_kind, gen)
    assert_shards_close(outs, refs, counts, SIM_TOL)


@pytest.mark.parametrize("counts", [[1, 0, 0], [0, 0, 1], [0, 0, 0]])
def test_one_token_or_none(counts):
    gen = torch.Generator().manual_seed(sum(counts) + counts[0])
    cfg = layer(5, 2, 3, 4, H=16, Ir=4)
    outs, refs = run_case(cfg, counts, "balanced", gen)
    assert_shards_close(outs, refs, counts, SIM_TOL)


def test_single_expert_k1_spans_blocks():
    """All R*C hits on one expert: several row blocks, every other expert empty."""
    gen = torch.Generator().manual_seed(11)
    cfg = layer(6, 1, 2, 200, H=16, Ir=8)
    counts = [200, 133]
    outs, refs = run_case(cfg, counts, "single", gen)
    assert_shards_close(outs, refs, counts, SIM_TOL)


def test_later_sequence_number():
    """A later batch (seq 41): watermarks start where 40 batches leave them, at seq-1, so every
    target is a function of seq. (The simulation rebuilds that state
    per call; state carried across real consecutive batches is tested on the GPU, tests/moe/test_fused_gpu.py.)"""
    gen = torch.Generator().manual_seed(12)
    cfg = layer(8, 2, 2, 30, H=16, Ir=8)
    counts = [30, 7]
    outs, refs = run_case(cfg, counts, "skewed", gen, seq=41)
    assert_shards_close(outs, refs, counts, SIM_TOL)


def test_synthetic_weights_slices_match_full_weights():
    """synthetic_rank_weights slices the same experts that full_weights stacks (contract between the two)."""
    gen = torch.Generator().manual_seed(13)
    cfg = layer(6, 2, 2, 24, H=32, Ir=16)
    full = full_weights(cfg, seed=5)
    rank_weights = [synthetic_rank_weights(cfg, r, 5) for r in range(cfg.R)]
    counts = [24, 9]
    outs, refs = run_case(cfg, counts, "balanced", gen, rank_weights=rank_weights, full=full)
    assert_shards_close(outs, refs, counts, SIM_TOL)
