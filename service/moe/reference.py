"""fp32 reference of the MoE layer, for tests only (never on the request path).

    out[t] = sum_k w[t,k] * down_e( act(gate_e(x[t]), up_e(x[t])) ),  e = ids[t,k]

with HF nn.Linear weights: gate_e(x) = x @ gate[e]^T (+ gate_bias[e]), gate/up [E, I, H],
down [E, H, I] (+ down_bias[e]); act is silu(g) * u unless told otherwise (service.config.Activation).
Everything is computed in fp32, one expert at a time, with nothing clever.
"""

from __future__ import annotations

import torch
from torch import Tensor

from service.config import Activation


def moe_reference(x: Tensor, ids: Tensor, w: Tensor, gate: Tensor, up: Tensor, down: Tensor,
                  act: Activation = Activation(), biases: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
    """x [T, H], ids [T, K] integer, w [T, K], gate/up [E, I, H], down [E, H, I] -> [T, H] fp32.
    biases: (gate [E, I], up [E, I], down [E, H]) or None."""
    T, H = x.shape
    E = gate.shape[0]
    assert ids.shape == w.shape and ids.shape[0] == T, f"ids {tuple(ids.shape)} and w {tuple(w.shape)} must be [T, K]"
    x = x.float()
    w = w.float()
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)   # [T, H]
    for e in range(E):
        t, k = (ids == e).nonzero(as_tuple=True)                     # [n_e], [n_e]
        if t.numel() == 0:
            continue
        xe = x[t]                                                    # [n_e, H]
        g, u = xe @ gate[e].float().T, xe @ up[e].float().T          # [n_e, I]
        if biases is not None:
            g, u = g + biases[0][e].float(), u + biases[1][e].float()
        y = act.apply(g, u) @ down[e].float().T                      # [n_e, H]
        if biases is not None:
            y = y + biases[2][e].float()
        out.index_add_(0, t, w[t, k, None] * y)
    return out


def full_weights(cfg, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """The synthetic checkpoint's full (unsliced) weights in fp32: gate, up [E, I, H], down [E, H, I]."""
    from service.moe.weights import synthetic_expert  # lazy: tests import this module on its own

    experts = [synthetic_expert(cfg, seed, e) for e in range(cfg.E)]
    gate, up, down = (torch.stack([ex[i].float() for ex in experts]) for i in range(3))
    return gate, up, down
