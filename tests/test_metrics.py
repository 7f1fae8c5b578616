"""Every stage label a backend emits is one of the declared, pre-created values."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from service.config import LayerConfig, Settings
from service.metrics import BACKEND_STAGES, SERIAL_STAGES, STAGES, TIME_BUCKETS, Metrics
from service.moe.serial import SerialLayer
from service.moe.timing import StageTimer
from service.moe.weights import synthetic_rank_weights


def test_serial_stages_are_declared():
    cfg = LayerConfig(E=4, H=16, I=8, K=2, R=1, C=8, dtype=torch.float32)
    layer = SerialLayer(cfg, synthetic_rank_weights(cfg, 0, seed=0), rank=0, device=torch.device("cpu"))
    timer = StageTimer(torch.device("cpu"))
    layer.forward(torch.randn(5, 16), torch.randint(0, 4, (5, 2)), torch.full((5, 2), 0.5), seq=1, timer=timer)
    assert set(timer.seconds()) <= set(BACKEND_STAGES["serial"]) == set(SERIAL_STAGES)


def test_fused_stages_are_declared():
    source = (Path(__file__).parents[1] / "service/moe/fused.py").read_text()
    names = set(re.findall(r"""mark\(["'](\w+)["']\)""", source))
    assert names and names <= set(BACKEND_STAGES["fused"]), names


def test_series_of_the_running_backend_exist_before_any_step():
    """Zeros for what runs, nothing for the backend that does not (no empty legend entries)."""
    for backend, other in (("serial", "fused"), ("fused", "serial")):
        metrics = Metrics()
        metrics.use_backend(backend)
        value = metrics.registry.get_sample_value
        for stage in STAGES:
            expected = 0.0 if stage in BACKEND_STAGES[backend] else None
            assert value("moe_stage_seconds_count", {"stage": stage}) == expected, (backend, stage)
        assert value("moe_layer_seconds_count", {"backend": backend}) == 0.0
        assert value("moe_layer_seconds_count", {"backend": other}) is None
        assert value("moe_exposed_comm_seconds_count", {"backend": other}) is None


def test_buckets_reach_past_the_request_deadline():
    deadline = Settings.model_fields["request_timeout_s"].default
    assert deadline in TIME_BUCKETS and max(TIME_BUCKETS) > deadline


def test_standard_collectors_and_no_created_series():
    text = generate_latest(Metrics().registry).decode()
    assert "process_cpu_seconds_total" in text and "python_info" in text
    assert "_created" not in text


def test_merge_adds_up_front_ends_and_keeps_the_owners_process_series():
    """Several front-end processes' snapshots (service.fleet): counters, histograms and the queue
    gauges are summed, the process's own series and readiness are the first (owner's) snapshot's,
    and the exposition keeps every series name."""
    import pickle

    from service.metrics import Snapshot, merge

    owner, other = Metrics(), Metrics()
    owner.requests.labels("grpc", "200").inc(3)
    other.requests.labels("grpc", "200").inc(4)
    other.requests.labels("grpc", "400").inc()  # a series only one process has
    owner.queue_time.observe(1e-3)
    other.queue_time.observe(2.0)
    owner.queued_tokens.set(5)
    other.queued_tokens.set(7)
    owner.ready.set(1)
    other.ready.set(0)
    other.request_compute["compute_infer"].add(0.5)
    snaps = [Snapshot(list(m.registry.collect()), count, last, dict(m.request_compute))
             for m, count, last in ((owner, 10, 100), (other, 32, 90))]
    snaps = pickle.loads(pickle.dumps(snaps))  # as they cross the control channel
    merged = merge(snaps)
    assert merged.value("moe_requests_total", protocol="grpc", status="200") == 7
    assert merged.value("moe_requests_total", protocol="grpc", status="400") == 1
    assert merged.value("moe_queue_time_seconds_count") == 2
    assert merged.value("moe_queue_time_seconds_bucket", le="0.001") == 1
    assert merged.value("moe_queue_time_seconds_bucket", le="+Inf") == 2
    assert merged.value("moe_queued_tokens") == 12
    assert merged.value("moe_ready") == 1
    own_start = owner.registry.get_sample_value("process_start_time_seconds")
    assert merged.value("process_start_time_seconds") == own_start
    assert (merged.inference_count, merged.last_inference_ms) == (42, 100)
    assert merged.request_compute["compute_infer"].count == 1
    text = generate_latest(merged).decode()
    assert set(re.findall(r"^(moe_\w+?)(?:_bucket|_count|_sum)?[{ ]", generate_latest(owner.registry).decode(),
                          re.M)) == set(re.findall(r"^(moe_\w+?)(?:_bucket|_count|_sum)?[{ ]", text, re.M))


def test_step_wall_times_by_part():
    """moe_step_seconds: the owner's wall of a step (part=group) and rank 0's (part=rank), zero series
    from the start, one observation of each per step."""
    from service.worker.group import StepStats

    metrics = Metrics()
    metrics.use_backend("fused")
    value = metrics.registry.get_sample_value
    assert [value("moe_step_seconds_count", {"part": p}) for p in ("group", "rank")] == [0.0, 0.0]
    for wall, rank_wall in ((0.004, 0.0025), (0.003, 0.002)):
        metrics.observe_step(StepStats(seq=1, tokens=8, backend="fused", layer_s=0.0015, stages={"fused": 0.0015},
                                       exposed_comm_s=0.0, wall_s=wall, rank_wall_s=rank_wall))
    assert value("moe_step_seconds_count", {"part": "group"}) == 2.0
    assert value("moe_step_seconds_sum", {"part": "group"}) == pytest.approx(0.007)
    assert value("moe_step_seconds_sum", {"part": "rank"}) == pytest.approx(0.0045)


def test_steps_behind_count_the_looked_ahead_steps():
    """moe_steps_behind_total: steps rank 0 enqueued behind a step in flight, zero from the start."""
    from service.worker.group import StepStats

    metrics = Metrics()
    value = metrics.registry.get_sample_value
    assert value("moe_steps_behind_total") == 0.0
    for behind in (False, True, True):
        metrics.observe_step(StepStats(seq=1, tokens=8, backend="fused", layer_s=0.001, stages={"fused": 0.001},
                                       exposed_comm_s=0.0, behind=behind))
    assert value("moe_steps_total") == 3.0
    assert value("moe_steps_behind_total") == 2.0


def test_step_phases_are_exported_in_order():
    """moe_step_phase_seconds{phase}: zero series of every phase once the backend is known, one
    observation per phase and step, whatever order a StepStats lists them in."""
    from service.metrics import STEP_PHASES
    from service.worker.group import StepStats, step_phases

    metrics = Metrics()
    value = metrics.registry.get_sample_value
    assert value("moe_step_phase_seconds_count", {"phase": "to_rank"}) is None
    metrics.use_backend("serial")
    assert [value("moe_step_phase_seconds_count", {"phase": p}) for p in STEP_PHASES] == [0.0] * len(STEP_PHASES)
    # The owner's send at 10.0, two ranks' six stamps, every answer read at 10.0105, run returns at 10.011.
    stamps = [(10.0002, 10.0003, 10.0080, 10.0090, 10.0091, 10.0092), (10.0004, 10.0, 10.0, 10.0, 10.0, 10.0101)]
    phases = step_phases(10.0, stamps, 10.0105, 10.011)
    assert list(phases) == list(STEP_PHASES)
    want = (0.0002, 0.0001, 0.0077, 0.0010, 0.0001, 0.0001, 0.0009, 0.0004, 0.0005)
    assert list(phases.values()) == pytest.approx(want, abs=1e-9)
    assert sum(phases.values()) == pytest.approx(0.011)
    for _ in range(2):
        metrics.observe_step(StepStats(seq=1, tokens=8, backend="serial", layer_s=0.007, stages={"gemm1": 0.007},
                                       exposed_comm_s=0.0, wall_s=0.011, rank_wall_s=0.0092 - 0.0002,
                                       phases=dict(reversed(list(phases.items())))))
    for p, seconds in zip(STEP_PHASES, want, strict=True):
        assert value("moe_step_phase_seconds_count", {"phase": p}) == 2.0
        assert value("moe_step_phase_seconds_sum", {"phase": p}) == pytest.approx(2 * seconds, abs=1e-9)
