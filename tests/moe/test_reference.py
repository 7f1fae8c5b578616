"""The fp32 reference vs an independent per-token computation in fp64."""

from __future__ import annotations

import math

import pytest
import torch

from service.moe.reference import full_weights, moe_reference
from service.moe.weights import synthetic_expert
from tests.helpers import layer, one_thread, random_experts, rel_err, routing  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def naive(x, ids, w, gate, up, down):
    """Token by token, hit by hit, matrix-vector products in fp64: out[t] = sum_k w * down(silu(gate x) * up x)."""
    T, H = x.shape
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            xt = x[t].double()
            g = gate[e].double() @ xt                        # [I]
            u = up[e].double() @ xt                          # [I]
            a = torch.tensor([gi / (1 + math.exp(-gi)) for gi in g.tolist()], dtype=torch.float64) * u
            out[t] += float(w[t, k]) * (down[e].double() @ a)
    return out


@pytest.mark.parametrize("T,E,K,H,I,kind", [(7, 5, 2, 12, 10, "balanced"), (1, 3, 3, 8, 6, "balanced"),
                                           (9, 6, 2, 16, 12, "empty_expert"), (5, 4, 1, 8, 8, "single")])
def test_reference_matches_naive(T, E, K, H, I, kind):  # noqa: E741
    gen = torch.Generator().manual_seed(T * 100 + E)
    x = torch.randn(T, H, generator=gen)
    ids, w = routing(T, E, K, kind, gen)
    gate, up, down = random_experts(E, H, I, gen)
    out = moe_reference(x, ids, w, gate, up, down)
    assert out.dtype == torch.float32 and out.shape == (T, H)
    assert rel_err(out, naive(x, ids, w, gate, up, down)) <= 1e-6


def test_reference_int32_ids_and_low_precision_inputs():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, generator=gen)
    ids, w = routing(6, 4, 2, "skewed", gen)
    gate, up, down = random_experts(4, 8, 8, gen)
    want = moe_reference(x, ids, w, gate, up, down)
    assert torch.equal(moe_reference(x, ids.int(), w, gate, up, down), want)
    got = moe_reference(x.bfloat16(), ids, w, gate.bfloat16(), up.bfloat16(), down.bfloat16())
    assert got.dtype == torch.float32
    assert rel_err(got, want) < 3e-2  # inputs rounded to bf16, maths in fp32


def test_full_weights_stacks_synthetic_experts():
    cfg = layer(3, 2, 2, 4, H=8, Ir=4)
    gate, up, down = full_weights(cfg, seed=9)
    assert gate.shape == up.shape == (cfg.E, cfg.I, cfg.H) and down.shape == (cfg.E, cfg.H, cfg.I)
    assert gate.dtype == up.dtype == down.dtype == torch.float32
    for e in range(cfg.E):
        g, u, d = synthetic_expert(cfg, 9, e)
        assert torch.equal(gate[e], g.float()) and torch.equal(up[e], u.float()) and torch.equal(down[e], d.float())
