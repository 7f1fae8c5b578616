"""Every stage label a backend emits is one of the declared, pre-created values."""

from __future__ import annotations

import re
from pathlib import Path

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
