"""The warm-up step: a new rank group must compute the layer the front end serves before it is ready.

One full step (R*C tokens) on random rows. The front end fills the slot's `out` with UNWRITTEN first,
so a row that no rank wrote (a rank mapped other memory than the front end's) is caught, and it
checks the first and last row of every rank's share against the fp32 reference computed here,
independently of the ranks, from the same weights (synthetic or the checkpoint's, one expert at a
time). Those rows are routed to K experts only, so the check reads K experts, not E.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import torch

from service.config import LayerConfig
from service.errors import ConfigError, WorkerError
from service.moe.reference import moe_reference
from service.moe.weights import ExpertWeights, load_expert, synthetic_expert
from service.worker.rank import rank_range

log = logging.getLogger(__name__)

# Largest relative error ||out - ref|| / ||ref|| of one checked row. Measured single rows reach
# 1.2e-2 in bf16 (tests/helpers.py); fp32 leaves room for TF32 GEMMs on a GPU (~1e-3). What
# this guards against is far above: a row from memory the front end never sees is off by ~1,
# one computed with other weights by ~1.4.
# What the slot's answer rows hold before the step: a finite value no row of the layer's is made of (an
# overflowing layer's rows can be all NaN: fp16 silu(-inf) is NaN, spread over the row by the down GEMM),
# so a row still all this value was not written, and any non-finite one was written by an overflow.
UNWRITTEN = 31337.0
ROW_TOL = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}

Expert = Callable[[int], ExpertWeights]  # e -> gate, up, down, biases (fp32)


def _synthetic(cfg: LayerConfig, seed: int, e: int) -> ExpertWeights:
    return (*synthetic_expert(cfg, seed, e), None)


def expert_source(cfg: LayerConfig, weights: str | None, prefix: str, seed: int) -> Expert:
    """Where the reference reads expert e's full weights: the checkpoint (`prefix` is the resolved
    experts block), else the synthetic ones."""
    if weights:
        return functools.partial(load_expert, weights, cfg, prefix=prefix)
    return functools.partial(_synthetic, cfg, seed)


def warm_up(group, cfg: LayerConfig, expert: Expert, timeout_s: float) -> None:
    """Run the warm-up step on `group`; WorkerError if its answer is not the layer's."""
    T = cfg.tokens_per_step
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, cfg.H, generator=gen).to(cfg.dtype)                         # [T, H]
    ids = torch.randint(0, cfg.E, (T, cfg.K), generator=gen, dtype=torch.int32)    # [T, K]
    w = torch.softmax(torch.randn(T, cfg.K, generator=gen), dim=1)                 # [T, K]
    owner = {}  # checked row -> the rank that writes it
    for r in range(cfg.R):
        start, n = rank_range(T, cfg.R, r)
        owner.update({start: r, start + n - 1: r})
    rows = torch.tensor(sorted(owner))                                             # [n]
    chosen = torch.randperm(cfg.E, generator=gen)[:cfg.K].to(torch.int32)          # [K]
    for row in rows.tolist():
        ids[row] = chosen[torch.randperm(cfg.K, generator=gen)]

    slot = group.acquire_slot(timeout=timeout_s)
    t0 = time.perf_counter()
    try:
        slot.x[:T].copy_(x)
        slot.ids[:T].copy_(ids)
        slot.w[:T].copy_(w)
        slot.out[:T].fill_(UNWRITTEN)
        group.run(slot, T)
        out = slot.out[:T].float()                                                 # [T, H]
        fill = float(torch.tensor(UNWRITTEN, dtype=slot.out.dtype))  # (as the slot's dtype holds it)
    finally:
        group.release(slot)
    elapsed = time.perf_counter() - t0

    unwritten = (out == fill).all(dim=1).nonzero().flatten()
    if unwritten.numel():
        raise WorkerError(f"the warm-up step left {unwritten.numel()} of {T} rows unwritten (first: row "
                          f"{int(unwritten[0])}); the ranks do not share the front end's slots")
    bad = (~torch.isfinite(out).all(dim=1)).nonzero().flatten()
    if bad.numel():  # written, with an infinity or a NaN: the layer overflowed its dtype
        wider = ("serve them in bfloat16 or float32 (--dtype)" if cfg.dtype == torch.float16 else
                 "bfloat16 and float32 have the same range: the checkpoint's values are beyond what the layer "
                 "can compute")
        raise ConfigError(f"the layer overflows {cfg.dtype} on the warm-up's random rows: {bad.numel()} of {T} "
                          f"answers hold infinity or NaN (first: row {int(bad[0])}); {wider}")
    ref = torch.zeros(len(rows), cfg.H)                                            # [n, H]
    for e in chosen.tolist():
        gate, up, down, biases = expert(e)
        mine = torch.where(ids[rows] == e, 0, 1)  # this expert as expert 0 of a one-expert layer
        one = None if biases is None else (biases[0][None], biases[1][None], biases[2][None])
        ref += moe_reference(x[rows], mine, w[rows], gate[None], up[None], down[None], act=cfg.act, biases=one)
    err = (out[rows] - ref).norm(dim=1) / ref.norm(dim=1)                          # [n]
    worst = int(err.argmax())
    if float(err[worst]) > ROW_TOL[cfg.dtype]:
        row = int(rows[worst])
        raise WorkerError(f"the warm-up step disagrees with the fp32 reference: relative error "
                          f"{float(err[worst]):.2e} on row {row} (rank {owner[row]}), over {ROW_TOL[cfg.dtype]:.0e}")
    log.info("warm-up step of %d tokens in %.1f ms; %d rows match the fp32 reference (worst %.1e)",
             T, elapsed * 1e3, len(rows), float(err[worst]))
