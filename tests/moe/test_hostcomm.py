"""The serial layer on shared-memory collectives (service.moe.hostcomm): ranks as threads of this
process sharing one HostPeers, each given the whole step's rows (as the rank processes read them
from the slot), every rank's own rows against the fp32 reference; the barrier's bounds. (The same
transport across rank processes: tests/worker/test_group.py.)"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import random
import threading
import time

import pytest
import torch

from service.config import LayerConfig
from service.moe import hostcomm
from service.moe.hostcomm import BarrierTimeout, HostComm, HostPeers
from service.moe.reference import full_weights, moe_reference
from service.moe.routing import SequenceMismatch, rank_range
from service.moe.serial import SerialLayer
from service.moe.weights import synthetic_rank_weights
from tests.helpers import TOL, one_thread, rel_err, routing  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

SEED = 5
CTX = mp.get_context("spawn")
JOIN_S = 60.0  # a step of these tiny layers takes milliseconds; a thread still running is a hang


def make_ranks(cfg: LayerConfig, timeout_s: float = 30.0) -> list[SerialLayer]:
    peers = HostPeers.create(CTX, cfg, timeout_s) if cfg.R > 1 else None
    return [SerialLayer(cfg, synthetic_rank_weights(cfg, r, SEED), rank=r, device=torch.device("cpu"), host=peers)
            for r in range(cfg.R)]


def run_step(layers: list[SerialLayer], x, ids, w, seq: int) -> list[torch.Tensor]:
    """One step on every rank (a thread each, as the rank processes run it); each rank's rows out.
    With R > 1 (host transport) each rank gets the whole step, at R = 1 its own rows (the same)."""
    R = len(layers)
    outs: list = [None] * R
    errors: list = []

    def rank(r: int) -> None:
        try:
            out = layers[r].forward(x, ids, w, seq)
            layers[r].check_seq(seq)
            outs[r] = out.clone()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(R)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return outs


def check(layers, ref_weights, T: int, kind: str, gen: torch.Generator, seq: int) -> None:
    cfg = layers[0].cfg
    x = torch.randn(T, cfg.H, generator=gen)
    ids, w = routing(T, cfg.E, cfg.K, kind, gen)
    ref = moe_reference(x, ids, w, *ref_weights)
    outs = run_step(layers, x, ids.to(torch.int32), w, seq)
    for r, out in enumerate(outs):  # every rank's own rows
        start, n = rank_range(T, cfg.R, r)
        assert out.shape == (n, cfg.H)
        if n:
            err = rel_err(out, ref[start:start + n])
            assert err <= TOL[torch.float32], (T, kind, r, err)


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty_expert"])
def test_every_rank_matches_the_reference(R, kind):
    cfg = LayerConfig(E=6, H=40, I=24 * R, K=2, R=R, C=9, dtype=torch.float32)
    layers, ref_weights = make_ranks(cfg), full_weights(cfg, SEED)
    gen = torch.Generator().manual_seed(R * 10 + len(kind))
    # T=1 (ranks without tokens), T % R != 0, a full step, and back to small: buffers are reused.
    for seq, T in enumerate((1, 7, R * cfg.C, R * cfg.C - 1, 3, 1), start=1):
        check(layers, ref_weights, T, kind, gen, seq)


def test_ranks_out_of_step_keep_their_answers(monkeypatch):
    """A rank held up after a barrier while its peers run on (the interleavings of R processes on
    fewer cores): with the partials and seq words double-buffered by parity, no step sees another's."""
    cfg = LayerConfig(E=5, H=24, I=32, K=3, R=4, C=6, dtype=torch.float32)
    layers, ref_weights = make_ranks(cfg), full_weights(cfg, SEED)
    barrier = HostComm.barrier
    delays = random.Random(7)
    lock = threading.Lock()

    def late_barrier(self) -> None:
        barrier(self)
        with lock:
            pause = delays.random() < 0.4
        if pause:
            time.sleep(0.003)

    monkeypatch.setattr(HostComm, "barrier", late_barrier)
    gen = torch.Generator().manual_seed(8)
    sizes = [1 + (i * 7) % (cfg.R * cfg.C) for i in range(24)]
    # Several steps in flight: each rank runs its steps back to back, as the rank processes do.
    x = [torch.randn(T, cfg.H, generator=gen) for T in sizes]
    rw = [routing(T, cfg.E, cfg.K, "skewed", gen) for T in sizes]
    outs: dict = {}
    errors: list = []

    def rank(r: int) -> None:
        try:
            for seq in range(1, len(sizes) + 1):
                ids, w = rw[seq - 1]
                out = layers[r].forward(x[seq - 1], ids.to(torch.int32), w, seq)
                layers[r].check_seq(seq)
                outs[r, seq] = out.clone()
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cfg.R)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors[0]
    for seq, T in enumerate(sizes, start=1):
        ref = moe_reference(x[seq - 1], *rw[seq - 1], *ref_weights)
        for r in range(cfg.R):
            start, n = rank_range(T, cfg.R, r)
            if n:
                assert rel_err(outs[r, seq], ref[start:start + n]) <= TOL[torch.float32], (seq, r)


def test_a_missing_rank_expires_the_barrier_and_is_named(monkeypatch):
    monkeypatch.setattr(hostcomm, "SLICE_S", 0.05)
    cfg = LayerConfig(E=4, H=8, I=12, K=1, R=3, C=2, dtype=torch.float32)
    peers = HostPeers.create(CTX, cfg, timeout_s=0.3)
    # Rank 1 arrives first and waits longer; rank 0 enters once rank 1's arrival shows, so each
    # names rank 2 alone (two threads started together assumed both arrive within the other's 0.3 s).
    comms = [HostComm(peers, cfg, 0), HostComm(dataclasses.replace(peers, timeout_s=1.0), cfg, 1)]
    errors: list = []

    def rank1() -> None:  # arrives; rank 2 never does
        try:
            comms[1].barrier()
        except BarrierTimeout as err:
            errors.append(err)

    other = threading.Thread(target=rank1)
    other.start()
    deadline = time.monotonic() + JOIN_S
    while int(comms[0]._arrived[1]) < 1:  # rank 1 is in its barrier
        assert time.monotonic() < deadline, "rank 1 never arrived"
        time.sleep(0.001)
    t0 = time.monotonic()
    with pytest.raises(BarrierTimeout, match=r"rank 0: barrier 1: ranks \[2\] did not arrive within 0.3 s"):
        comms[0].barrier()
    assert 0.25 <= time.monotonic() - t0 < 5
    other.join(JOIN_S)
    assert not other.is_alive() and errors, "rank 1's barrier did not time out"
    assert "rank 1: barrier 1: ranks [2] did not arrive within 1 s" in str(errors[0])


def test_ranks_disagreeing_on_the_step_are_caught():
    cfg = LayerConfig(E=4, H=8, I=8, K=2, R=2, C=3, dtype=torch.float32)
    layers = make_ranks(cfg)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, cfg.H, generator=gen)
    ids, w = routing(4, cfg.E, cfg.K, "balanced", gen)
    errors: list = []

    def rank(r: int, seq: int) -> None:
        try:
            layers[r].forward(x, ids.to(torch.int32), w, seq)
            layers[r].check_seq(seq)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=rank, args=(r, 1 + r)) for r in range(2)]  # seqs 1 and 2
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert len(errors) == 2 and all(isinstance(e, SequenceMismatch) for e in errors), errors
    assert "rank 0 ran seq 1, the group ran [1, 0]" in str(errors[0]) + str(errors[1])  # rank 1's word is elsewhere


def test_host_transport_is_for_cpu_ranks_of_a_group():
    cfg = LayerConfig(E=4, H=8, I=8, K=2, R=1, C=3, dtype=torch.float32)
    peers = HostPeers.create(CTX, cfg.replace(R=2), 1.0)
    with pytest.raises(ValueError, match="CPU ranks, R > 1"):
        SerialLayer(cfg, synthetic_rank_weights(cfg, 0, SEED), rank=0, device=torch.device("cpu"), host=peers)
