"""The fused layer on a GPU against the fp32 reference (marked gpu; skipped on CPU).

- R=1 in process: graph and eager, balanced / skewed, T=1, empty and full batches; weights through
  pointer loads and through TMA descriptors (GemmConfig.w_desc).
- R=2 and R=4 as processes sharing one GPU (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, a gloo
  group, multicast off): many consecutive batches with balanced and skewed routing, empty ranks,
  T=1, full ranks; every rank's shard checked.
- A forced timeout: rank 1 withholds its tokens for one batch; rank 0's step must end in
  FusedTimeout within a bound, not hang.

All shapes share H, Ir, K so the kernels compile once per process (Triton's disk cache is shared).
"""

from __future__ import annotations

import datetime
import json
import os
import time

import pytest
import torch

from service.config import LayerConfig
from tests.helpers import TOL, rel_err, routing, slice_rank

pytestmark = pytest.mark.gpu

E, H, IR, K, C = 8, 256, 64, 3, 40
ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NCCL_NVLS_ENABLE": "0"}
JOIN_TIMEOUT_S = 240


def _cfg(R: int) -> LayerConfig:
    return LayerConfig(E=E, H=H, I=IR * R, K=K, R=R, C=C, dtype=torch.bfloat16)


def _weights(cfg: LayerConfig, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gate = (torch.randn(cfg.E, cfg.I, cfg.H, generator=gen) / cfg.H ** 0.5).bfloat16().float()
    up = (torch.randn(cfg.E, cfg.I, cfg.H, generator=gen) / cfg.H ** 0.5).bfloat16().float()
    down = (torch.randn(cfg.E, cfg.H, cfg.I, generator=gen) / cfg.I ** 0.5).bfloat16().float()
    return gate, up, down


def _batch(counts, kind, gen):
    xs, ids, ws = [], [], []
    for n in counts:
        xs.append(torch.randn(n, H, generator=gen).bfloat16())
        i, w = routing(n, E, K, kind, gen)
        ids.append(i.int())
        ws.append(w)
    return xs, ids, ws


def _schedule(R: int):
    """(counts per rank, routing) for every batch: full, partial, empty ranks, T=1."""
    steps = [([C] * R, "balanced"), ([C] * R, "skewed"), ([1] + [0] * (R - 1), "balanced"),
             ([0] * (R - 1) + [C], "skewed"), ([0] * R, "balanced")]
    g = torch.Generator().manual_seed(R)
    for i in range(7):
        counts = torch.randint(0, C + 1, (R,), generator=g).tolist()
        counts[i % R] = 0 if i % 2 else counts[i % R]
        steps.append((counts, "skewed" if i % 2 else "balanced"))
    return steps


# ---------------------------------------------------------------------------------------------
# R = 1, in process.
# ---------------------------------------------------------------------------------------------


# GemmConfig tile orders, set explicitly (the device's tile config may choose either).
ORDERS = {"static": {"queue": False, "pn_major": False}, "queue_pn_major": {"queue": True, "pn_major": True}}


@pytest.mark.parametrize("graph,w_desc,order", [(True, False, "static"), (False, False, "static"),
                                                (True, True, "static"), (True, False, "queue_pn_major")])
def test_r1_matches_reference(graph, w_desc, order):
    from service.moe.fused import FusedLayer, fused_unavailable_reason
    from service.moe.reference import moe_reference
    from service.moe.weights import RankWeights

    cfg = _cfg(1)
    dev = torch.device("cuda")
    assert fused_unavailable_reason(cfg, dev) is None
    gate, up, down = _weights(cfg)
    layer = FusedLayer(cfg, RankWeights(*slice_rank(gate, up, down, 0, 1)), rank=0, device=dev, graph=graph,
                       w_desc=w_desc, gemm=ORDERS[order])
    assert layer.plan.config1.w_desc == layer.plan.config2.w_desc == w_desc
    assert layer.plan.config1.queue == layer.plan.config2.queue == ORDERS[order]["queue"]
    gen = torch.Generator().manual_seed(11)
    gate, up, down = gate.to(dev), up.to(dev), down.to(dev)
    for seq, (counts, kind) in enumerate(_schedule(1), start=1):
        (x,), (ids,), (w,) = _batch(counts, kind, gen)
        out = layer.forward(x.to(dev), ids.to(dev), w.to(dev), seq).clone()
        layer.check_seq(seq)
        assert out.shape == (counts[0], H)
        if counts[0]:
            ref = moe_reference(x.to(dev).float(), ids.to(dev), w.to(dev), gate, up, down)
            assert torch.isfinite(out).all()
            assert rel_err(out, ref) <= TOL[torch.bfloat16], (seq, counts, kind, rel_err(out, ref))
        assert layer.exposed_comm_s() >= 0


def test_r1_states_own_graphs_two_steps_in_flight_match_the_stateless_steps():
    """The rank's way (service.worker.rank): two StepStates, each with its own graph (_StateGraph), a
    step enqueued with one while the other's is still on the device. Every answer equals the stateless
    forward's of the same rows bit for bit and is within the reference's tolerance; each state's
    words are its own step's (check_seq from the state); the timer reports the fused stage."""
    from service.moe.fused import FusedLayer, _StateGraph
    from service.moe.reference import moe_reference
    from service.moe.weights import RankWeights

    cfg = _cfg(1)
    dev = torch.device("cuda")
    gate, up, down = _weights(cfg)
    layer = FusedLayer(cfg, RankWeights(*slice_rank(gate, up, down, 0, 1)), rank=0, device=dev)
    states = [layer.new_state(), layer.new_state()]
    assert all(isinstance(s.graph, _StateGraph) for s in states)
    gen = torch.Generator().manual_seed(12)
    gate, up, down = gate.to(dev), up.to(dev), down.to(dev)
    batches = [_batch(counts, kind, gen) for counts, kind in _schedule(1)]
    x_in, ids_in, w_in = layer.inputs
    answers, pending = {}, []
    for seq, ((x,), (ids,), (w,)) in enumerate(batches, start=1):
        n = x.shape[0]
        state = states[seq % 2]
        rows = (x_in[:n].copy_(x.to(dev)), ids_in[:n].copy_(ids.to(dev)), w_in[:n].copy_(w.to(dev)))
        out = layer.forward(*rows, seq, state=state)
        done = torch.cuda.Event()
        answers[seq] = torch.empty(n, H, device=dev).copy_(out)  # before the next step overwrites it
        done.record()
        pending.append((seq, state, done))
        if len(pending) == 2:  # the step before this one finishes while this one is in flight
            old_seq, old_state, old_done = pending.pop(0)
            old_done.synchronize()
            layer.check_seq(old_seq, old_state)
            assert set(old_state.timer.seconds()) == {"fused"}
    for old_seq, old_state, old_done in pending:
        old_done.synchronize()
        layer.check_seq(old_seq, old_state)
    for seq, ((x,), (ids,), (w,)) in enumerate(batches, start=len(batches) + 1):  # again, no state
        out = layer.forward(x.to(dev), ids.to(dev), w.to(dev), seq).clone()
        layer.check_seq(seq)
        first = answers[seq - len(batches)]
        assert torch.equal(out, first), seq
        if x.shape[0]:
            ref = moe_reference(x.to(dev).float(), ids.to(dev), w.to(dev), gate, up, down)
            assert rel_err(first, ref) <= TOL[torch.bfloat16], seq


# ---------------------------------------------------------------------------------------------
# R = 2 and 4: processes sharing the GPU.
# ---------------------------------------------------------------------------------------------


def _worker(rank: int, R: int, port: int, mode: str, out_dir: str, plan: dict | None = None) -> None:
    os.environ.update(ENV)
    import torch.distributed as dist

    from service.moe.fused import FusedLayer, FusedTimeout, fused_unavailable_reason
    from service.moe.reference import moe_reference
    from service.moe.weights import RankWeights

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=R, timeout=datetime.timedelta(seconds=120))
    result: dict = {"rank": rank, "errors": []}
    try:
        cfg = _cfg(R)
        reason = fused_unavailable_reason(cfg, dev, dist.group.WORLD)
        assert reason is None, reason
        gate, up, down = _weights(cfg)
        spins = {"timeout": 1 << 20}.get(mode, 1 << 22)
        layer = FusedLayer(cfg, RankWeights(*slice_rank(gate, up, down, rank, R)), rank=rank, device=dev,
                           group=dist.group.WORLD, max_spins=spins, **(plan or {}))
        gate, up, down = gate.to(dev), up.to(dev), down.to(dev)
        gen = torch.Generator().manual_seed(5)  # the same global batches on every rank
        steps = _schedule(R) if mode == "batches" else [([C] * R, "balanced")] * 3
        for seq, (counts, kind) in enumerate(steps, start=1):
            xs, ids, ws = _batch(counts, kind, gen)
            if mode == "timeout" and seq == len(steps):
                if rank == 1:
                    result["withheld"] = seq  # never enters the step: rank 0 must time out
                    break
                t0 = time.monotonic()
                layer.forward(xs[rank].to(dev), ids[rank].to(dev), ws[rank].to(dev), seq)
                try:
                    layer.check_seq(seq)
                    result["timeout"] = None
                except FusedTimeout as exc:
                    result["timeout"] = str(exc)
                result["timeout_s"] = time.monotonic() - t0
                break
            out = layer.forward(xs[rank].to(dev), ids[rank].to(dev), ws[rank].to(dev), seq).clone()
            layer.check_seq(seq)
            n = counts[rank]
            err = 0.0
            if n:
                ref = moe_reference(xs[rank].to(dev).float(), ids[rank].to(dev), ws[rank].to(dev), gate, up, down)
                err = rel_err(out, ref)
                assert torch.isfinite(out).all(), f"seq {seq}: non-finite output"
            result["errors"].append([seq, counts, kind, err, layer.exposed_comm_s()])
    except BaseException as exc:  # noqa: BLE001 - reported to the parent through the file
        import traceback

        result["exception"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # Keep the mappings alive until every rank is done (a peer may still read our buffers).
    store.add("done", 1)
    deadline = time.monotonic() + 60
    while int(store.add("done", 0)) < R and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(0)


def _run_group(R: int, mode: str, tmp_path, plan: dict | None = None) -> list[dict]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    os.environ.update(ENV)
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    ctx = mp.spawn(_worker, args=(R, store.port, mode, str(tmp_path), plan), nprocs=R, join=False)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"R={R} {mode}: the group did not finish in {JOIN_TIMEOUT_S} s (a hang)")
    results = []
    for r in range(R):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result"
        results.append(json.loads(path.read_text()))
    return results


# Plan variants under trial (bench/fused_layer.py --variants): proven across processes here
# before one becomes the default.
PLAN_VARIANTS = {"default": {}, "one-puller": {"num_comm1": 1},  # one puller: the gates wait most
                 "queue": {"gemm": {"queue": True, "pn_major": True}},  # the tile queues, across ranks
                 "static": {"gemm": {"queue": False}}}  # the static walk, whatever the tile config says


@pytest.mark.parametrize("plan", sorted(PLAN_VARIANTS))
@pytest.mark.parametrize("R", [2, 4])
def test_ranks_sharing_one_gpu_match_reference(R, plan, tmp_path):
    results = _run_group(R, "batches", tmp_path, PLAN_VARIANTS[plan])
    steps = len(_schedule(R))
    for res in results:
        assert "exception" not in res, f"rank {res['rank']}: {res['exception']}"
        assert len(res["errors"]) == steps, f"rank {res['rank']} ran {len(res['errors'])} of {steps} steps"
        for seq, counts, kind, err, exposed in res["errors"]:
            print(f"R={R} rank {res['rank']} seq {seq} counts {counts} {kind}: rel err {err:.2e}, "
                  f"exposed {exposed * 1e6:.0f} us")
            assert err <= TOL[torch.bfloat16], (res["rank"], seq, counts, kind, err)


def test_withheld_tokens_end_in_error_not_hang(tmp_path):
    results = _run_group(2, "timeout", tmp_path)
    r0, r1 = results
    assert "exception" not in r0, r0["exception"]
    assert "exception" not in r1, r1["exception"]
    assert r1.get("withheld") == 3
    assert r0.get("timeout"), "rank 0 finished a step its peer never entered"
    assert "barrier" in r0["timeout"], r0["timeout"]
    print(f"timeout reported after {r0['timeout_s']:.2f} s: {r0['timeout']}")
    assert r0["timeout_s"] < 60
