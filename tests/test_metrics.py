"""Every stage label a backend emits is one of the declared, pre-created values."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from service.config import LayerConfig
from service.metrics import FUSED_STAGES, SERIAL_STAGES, STAGES, Metrics
from service.moe.serial import SerialLayer
from service.moe.timing import StageTimer
from service.moe.weights import synthetic_rank_weights


def test_serial_stages_are_declared():
    cfg = LayerConfig(E=4, H=16, I=8, K=2, R=1, C=8, dtype=torch.float32)
    layer = SerialLayer(cfg, synthetic_rank_weights(cfg, 0, seed=0), rank=0, device=torch.device("cpu"))
    timer = StageTimer(torch.device("cpu"))
    layer.forward(torch.randn(5, 16), torch.randint(0, 4, (5, 2)), torch.full((5, 2), 0.5), seq=1, timer=timer)
    assert set(timer.seconds()) <= set(SERIAL_STAGES)


def test_fused_stages_are_declared():
    source = (Path(__file__).parents[1] / "service/moe/fused.py").read_text()
    names = set(re.findall(r"""mark\(["'](\w+)["']\)""", source))
    assert names and names <= set(FUSED_STAGES) | {"tables"}, names


def test_stage_series_exist_before_any_step():
    text = Metrics().registry.get_sample_value
    for stage in STAGES:
        assert text("moe_stage_seconds_count", {"stage": stage}) == 0.0
