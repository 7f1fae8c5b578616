"""Four GPUs, one rank process per GPU: the serial and fused backends through the rank group at the
seed shape against the fp32 reference (issue 7, step 2). Marked multigpu; skipped with fewer than 4
GPUs (`bash bench/multigpu.sh` runs it on a 4-GPU host).

Per backend, 100 consecutive batches through `WorkerGroup(device="cuda")` (NCCL; the fused backend
with its symmetric-memory rendezvous across the 4 GPUs): balanced and skewed routing, plus an
empty-expert and a single-expert batch; T = 1 (three empty ranks), T = R - 1 (one empty rank), odd
sizes, full steps (R*C) and batches of two and three steps. Every rank's rows of every step are
checked on their own against the reference, so a wrong shard cannot hide behind good ones.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from service.config import preset
from service.moe.reference import moe_reference
from service.moe.weights import synthetic_expert
from service.worker.group import WorkerGroup
from service.worker.rank import rank_range
from tests.helpers import TOL, rel_err, routing

GPUS = 4
BATCHES = 100
SEED = 0                 # synthetic weights: the ranks draw their slices, the reference the whole
START_TIMEOUT_S = 300.0  # the first group start compiles the Triton kernels (cold cache)
STEP_TIMEOUT_S = 60.0
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

pytestmark = [pytest.mark.multigpu,
              pytest.mark.skipif(torch.cuda.device_count() < GPUS, reason=f"needs {GPUS} CUDA GPUs")]


@pytest.fixture(scope="module", autouse=True)
def _no_multicast():
    """The rank processes inherit the environment: NVLink multicast stays off (ARCHITECTURE.md 5.2)."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in ENV.items():
            mp.setenv(key, value)
        yield


@pytest.fixture(scope="module")
def cfg():
    cfg = preset("seed")
    assert cfg.R == GPUS
    return cfg


@pytest.fixture(scope="module")
def full_weights_gpu(cfg):
    """The synthetic checkpoint's full fp32 weights on GPU 0: gate, up [E, I, H], down [E, H, I].

    Same values as service.moe.reference.full_weights, drawn by experts in threads (each expert's
    draws use their own generators, so the order does not matter) and copied straight to the GPU.
    """
    dev = torch.device("cuda", 0)
    gate = torch.empty(cfg.E, cfg.I, cfg.H, device=dev)  # [E, I, H]
    up = torch.empty(cfg.E, cfg.I, cfg.H, device=dev)    # [E, I, H]
    down = torch.empty(cfg.E, cfg.H, cfg.I, device=dev)  # [E, H, I]

    def fill(e: int) -> None:
        g, u, d = synthetic_expert(cfg, SEED, e)
        gate[e].copy_(g)
        up[e].copy_(u)
        down[e].copy_(d)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:  # torch's draws release the GIL
        list(pool.map(fill, range(cfg.E)))
    return gate, up, down


def _schedule(cfg) -> list[tuple[int, str]]:
    """BATCHES (T, routing) pairs: the edge cases first, then random sizes up to one full step."""
    step = cfg.tokens_per_step
    fixed = [(1, "balanced"), (cfg.R - 1, "skewed"), (step, "balanced"), (step, "skewed"),
             (step - 1, "empty_expert"), (cfg.C + 1, "single"), (step + 7, "balanced"), (3 * step, "skewed")]
    gen = torch.Generator().manual_seed(17)
    sizes = torch.randint(1, step + 1, (BATCHES - len(fixed),), generator=gen).tolist()
    return fixed + [(T, ("balanced", "skewed")[i % 2]) for i, T in enumerate(sizes)]


@pytest.mark.parametrize("backend", ["serial", "fused"])
def test_four_ranks_match_reference(backend, cfg, full_weights_gpu):
    gate, up, down = full_weights_gpu
    dev = gate.device
    step = cfg.tokens_per_step
    gen = torch.Generator().manual_seed(23)
    worst = [0.0] * cfg.R
    checked = [0] * cfg.R
    steps = 0
    with WorkerGroup(cfg, device="cuda", seed=SEED, backend=backend, start_timeout_s=START_TIMEOUT_S,
                     step_timeout_s=STEP_TIMEOUT_S) as group:
        assert group.backend == backend, f"asked for {backend}, the ranks run {group.backend} (their log says why)"
        for i, (T, kind) in enumerate(_schedule(cfg)):
            x = torch.randn(T, cfg.H, generator=gen).to(cfg.dtype)  # [T, H]
            ids, w = routing(T, cfg.E, cfg.K, kind, gen)            # [T, K], [T, K]
            out = group.forward(x, ids.int(), w)                    # [T, H]
            steps += -(-T // step)
            assert torch.isfinite(out).all(), f"{backend} batch {i} (T={T}, {kind}): non-finite output"
            ref = moe_reference(x.to(dev).float(), ids.to(dev), w.to(dev), gate, up, down).cpu()  # [T, H]
            for lo in range(0, T, step):  # the group cut the batch into steps of R*C tokens
                for r in range(cfg.R):
                    start, n = rank_range(min(step, T - lo), cfg.R, r)
                    if n == 0:
                        continue
                    rows = slice(lo + start, lo + start + n)
                    err = rel_err(out[rows], ref[rows])
                    assert err <= TOL[cfg.dtype], (f"{backend} batch {i} (T={T}, {kind}), step at row {lo}, "
                                                   f"rank {r} rows {rows.start}..{rows.stop}: rel err {err:.2e}")
                    worst[r] = max(worst[r], err)
                    checked[r] += 1
        assert group.seq == steps, f"the group ran {group.seq} steps, the batches needed {steps}"

        slot = group.acquire_slot(timeout=STEP_TIMEOUT_S)  # one more full step, for its figures
        try:
            slot.x[:step].copy_(torch.randn(step, cfg.H, generator=gen).to(cfg.dtype))
            ids, w = routing(step, cfg.E, cfg.K, "balanced", gen)
            slot.ids[:step].copy_(ids.int())
            slot.w[:step].copy_(w)
            stats = group.run(slot, step)
        finally:
            group.release(slot)
    assert stats.backend == backend and stats.layer_s > 0 and stats.exposed_comm_s >= 0
    assert all(checked), f"some rank never had rows to check: {checked}"
    print(  # noqa: T201 (the run's report: errors per rank and a step's timings, for pytest -s on the GPU host)
        f"\n{backend}: {BATCHES} batches, {steps} steps on {GPUS} GPUs; worst rel err per rank "
        f"{', '.join(f'{e:.2e}' for e in worst)} (tolerance {TOL[cfg.dtype]:.0e}); shards checked {checked}; "
        f"a full step: layer {stats.layer_s * 1e6:.0f} us, exposed comm {stats.exposed_comm_s * 1e6:.0f} us (rank 0)")
