"""The gated activation between the two GEMMs, in torch: the CPU path and the fp32 reference.

The Triton kernels compute the same function in GEMM1's epilogue (service/kernels/grouped_gemm.py,
`_act`); service.config.Activation defines the variants and their clamp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.config import Activation


def gated(g: torch.Tensor, u: torch.Tensor, act: Activation) -> torch.Tensor:
    """act(g, u) elementwise for gate pre-activations g and up pre-activations u of one shape."""
    if act.limit is not None:
        g = g.clamp(max=act.limit)
        u = u.clamp(min=-act.limit, max=act.limit)
    if act.kind == "silu":
        return F.silu(g) * u
    if act.kind == "gelu_tanh":
        return F.gelu(g, approximate="tanh") * u
    assert act.kind == "gpt_oss", act.kind
    return (u + 1) * (g * torch.sigmoid(act.alpha * g))
