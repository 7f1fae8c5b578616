"""The warm-up check: a group is ready only if its answer is the layer's, computed independently."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from service.config import LayerConfig
from service.errors import ConfigError, WorkerError
from service.moe.weights import write_synthetic_checkpoint
from service.worker.group import WorkerGroup
from service.worker.warmup import expert_source, warm_up

CFG = LayerConfig(E=7, H=24, I=40, K=3, R=2, C=5, dtype=torch.bfloat16)


class Detached:
    """A group whose ranks compute on memory the front end never sees: its slot's `out` is not written."""

    def __init__(self, group: WorkerGroup):
        self.group = group

    def acquire_slot(self, timeout=None):
        return self.group.acquire_slot(timeout)

    def release(self, slot):
        self.group.release(slot)

    def run(self, slot, T):
        other = self.group.acquire_slot(1)
        try:
            other.x[:T].copy_(slot.x[:T])
            other.ids[:T].copy_(slot.ids[:T])
            other.w[:T].copy_(slot.w[:T])
            return self.group.run(other, T)
        finally:
            self.group.release(other)


@pytest.fixture(scope="module")
def seeded():
    """One started group of CFG with seed 4's weights for the tests that only run warm-ups on it: a
    warm-up fills its slot's rows and answer (UNWRITTEN) before its step, and a warm-up's refusal is
    the checker's, not a failure of the group, so nothing of one test's run reaches the next."""
    with WorkerGroup(CFG, seed=4) as g:
        yield g


def test_a_correct_group_passes(tmp_path, seeded):
    warm_up(seeded, CFG, expert_source(CFG, None, "", 4), timeout_s=30)
    path = tmp_path / "w.safetensors"
    write_synthetic_checkpoint(path, CFG, seed=5, prefix="mlp.")
    with WorkerGroup(CFG, weights=str(path), weights_prefix="mlp.") as g:
        warm_up(g, CFG, expert_source(CFG, str(path), "mlp.", 0), timeout_s=30)


def test_rows_the_ranks_did_not_write_fail_it(seeded):
    with pytest.raises(WorkerError, match="left 10 of 10 rows unwritten"):
        warm_up(Detached(seeded), CFG, expert_source(CFG, None, "", 4), timeout_s=30)


def test_an_answer_from_other_weights_fails_it(seeded):
    with pytest.raises(WorkerError, match="disagrees with the fp32 reference"):
        warm_up(seeded, CFG, expert_source(CFG, None, "", 5), timeout_s=30)


@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v3"])
def test_a_model_directory_passes(tmp_path, model_type):
    """The warm-up's reference reads the checkpoint's own experts block (deepseek_v3: layer 1, after a
    dense layer 0) with its activation and biases (gpt_oss: clamped, biased), as the ranks do."""
    from service.moe.weights import checkpoint_layer
    from tests.hf_models import build

    build(model_type, tmp_path)
    base = LayerConfig(E=8, H=40, I=30, K=2, R=2, C=5, dtype=torch.float32)
    cfg, spec = checkpoint_layer(base, str(tmp_path))
    with WorkerGroup(cfg, weights=str(tmp_path), weights_prefix=spec.prefix) as g:
        warm_up(g, cfg, expert_source(cfg, str(tmp_path), spec.prefix, 0), timeout_s=60)
        with pytest.raises(WorkerError, match="disagrees"):  # other weights fail: no tautology
            warm_up(g, cfg, expert_source(cfg, None, "", 3), timeout_s=60)


class Overflowing(Detached):
    """A group whose answer holds an infinity in one row and NaN in a whole other row, as a layer that
    overflows its dtype gives (fp16: silu(-inf) is NaN, which the down GEMM spreads over the row)."""

    def run(self, slot, T):
        stats = self.group.run(slot, T)
        slot.out[2, 5] = float("inf")
        slot.out[7] = float("nan")
        return stats


def test_an_answer_that_overflows_its_dtype_is_a_setting_to_change_not_the_slots(seeded):
    """Rows written with infinities are the layer overflowing (weights too large for the dtype: exit 2,
    naming --dtype), not ranks writing elsewhere (all NaN rows, as the slot was filled)."""
    with pytest.raises(ConfigError, match=r"overflows torch.bfloat16 .* 2 of 10 .*first: row 2.*same range"):
        warm_up(Overflowing(seeded), CFG, expert_source(CFG, None, "", 4), timeout_s=30)
    fp16 = dataclasses.replace(CFG, dtype=torch.float16)
    with WorkerGroup(fp16, seed=4) as g:
        with pytest.raises(ConfigError, match=r"overflows torch.float16 .*bfloat16 or float32 \(--dtype\)"):
            warm_up(Overflowing(g), fp16, expert_source(fp16, None, "", 4), timeout_s=30)
