"""Shared test helpers: tolerances (defined once), routing generators, error measure, layer shapes,
independent commands run side by side."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import subprocess

import pytest
import torch
from torch import Tensor

from service.config import LayerConfig

# Relative error ||out - ref|| / ||ref|| allowed end to end, by compute dtype: one bound for a
# batch and for each rank's shard of it. Measured bf16: 2.2e-3..5.0e-3 per batch (H200 serial and
# fused, CPU group); one-token batches up to 7.9e-3 on the CPU group (40 seeds; the worst single
# row among 7880 was 1.2e-2, so a bound for any one token would be looser). fp16: about 8x less
# (6e-4 per batch, one-token batches up to 9e-4 on the CPU group; 2.9e-4 in the interpreter).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# A different quantity: rounding fp32 values once to a dtype (round to nearest, at most half an
# ulp, so at most eps/2 relative in norm too). Added where an answer is handed back in a dtype
# coarser than the one the layer computes in (an fp32 layer serving bf16 requests).
ROUNDING = {dtype: torch.finfo(dtype).eps / 2 for dtype in TOL}
# Two fp32 computations of the same sums that differ only in summation order (the CPU dataflow
# simulation against the reference, the Triton top-k combine against its torch reference).
SIM_TOL = 1e-6

ROUTING_KINDS = ("balanced", "skewed", "single", "empty_expert")

# The proxy variables tests/conftest.py took out of the tests' environment (their servers are all on
# this host), for a child that reaches outside: the image recipe's pip installs.
OUTSIDE_PROXIES: dict[str, str] = {}


def external_tool(name: str) -> str:
    """The path of a command-line tool that `.ci/install-tools` installs. Where it is missing the
    test skips, except in CI (CI=true), where it fails: such a test can never silently not run."""
    path = shutil.which(name)
    if path is None:
        why = f"{name} is not on PATH: run `bash .ci/install-tools` in this environment"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tiny matmuls on one intra-op thread: on a shared 2-core box, thread hand-off
    costs ~100x the [128, 16] GEMMs themselves. Import it into a test module to apply it there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel_err(out: Tensor, ref: Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (0 when both are empty)."""
    out, ref = out.double(), ref.double()
    if ref.numel() == 0:
        assert out.numel() == 0, "reference is empty but output is not"
        return 0.0
    return float((out - ref).norm() / ref.norm())


def tolerance(layer_dtype: torch.dtype, io_dtype: torch.dtype) -> float:
    """TOL of the layer's dtype, plus one rounding when the answer comes back in a coarser dtype."""
    coarser = torch.finfo(io_dtype).eps > torch.finfo(layer_dtype).eps
    return TOL[layer_dtype] + (ROUNDING[io_dtype] if coarser else 0.0)


def routing(T: int, E: int, K: int, kind: str, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Top-k routing for T tokens: ids [T, K] int64 (K distinct experts per token), w [T, K] fp32 rows summing to 1.

    balanced      every expert equally likely
    skewed        expert e drawn with probability ~ 1 / (e + 1)^2 (a few hot experts)
    single        every token picks the same K experts (K = 1: all hits on one expert)
    empty_expert  only max(K, E // 2) of the experts ever chosen; the rest get no tokens
    """
    if kind == "balanced":
        probs = torch.ones(E)
    elif kind == "skewed":
        probs = 1.0 / (torch.arange(E, dtype=torch.float32) + 1) ** 2
    elif kind == "single":
        probs = None
    elif kind == "empty_expert":
        probs = torch.zeros(E)
        probs[torch.randperm(E, generator=generator)[:max(K, E // 2)]] = 1.0
    else:
        raise ValueError(f"kind must be one of {ROUTING_KINDS}, got {kind!r}")
    if probs is None:
        chosen = torch.randperm(E, generator=generator)[:K]                       # [K]
        ids = chosen.repeat(T, 1)                                                  # [T, K]
    elif T == 0:
        ids = torch.empty(0, K, dtype=torch.int64)
    else:
        ids = torch.multinomial(probs.expand(T, E), K, replacement=False, generator=generator)  # [T, K]
    logits = torch.randn(T, K, generator=generator)                                # [T, K]
    return ids.to(torch.int64), torch.softmax(logits, dim=1)


def layer(E: int, K: int, R: int, C: int, H: int = 8, Ir: int = 4) -> LayerConfig:
    """A fp32 LayerConfig; H and I matter only where activations are computed."""
    return LayerConfig(E=E, H=H, I=Ir * R, K=K, R=R, C=C, dtype=torch.float32)


def random_experts(E: int, H: int, I: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:  # noqa: E741
    """Random fp32 HF-layout expert weights gate, up [E, I, H], down [E, H, I], scaled to keep activations O(1)."""
    gate = torch.randn(E, I, H, generator=generator) / H ** 0.5
    up = torch.randn(E, I, H, generator=generator) / H ** 0.5
    down = torch.randn(E, H, I, generator=generator) / I ** 0.5
    return gate, up, down


def slice_rank(gate: Tensor, up: Tensor, down: Tensor, r: int, R: int) -> tuple[Tensor, Tensor]:
    """Rank r's tensor-parallel slice as RankWeights describes it: w13 [E, H, 2*Ir] (gate columns, then up),
    w2 [E, Ir, H]."""
    Ir = gate.shape[1] // R
    rows = slice(r * Ir, (r + 1) * Ir)
    w13 = torch.cat([gate[:, rows, :], up[:, rows, :]], dim=1).transpose(1, 2).contiguous()  # [E, H, 2*Ir]
    w2 = down[:, :, rows].transpose(1, 2).contiguous()                                        # [E, Ir, H]
    return w13, w2


def run_at_once(commands: list[list[str]], timeout: float) -> list[subprocess.CompletedProcess]:
    """Independent commands run side by side, output captured as text; their results in order. Most
    time of a short `python -m service` run is its start (~2 s importing torch), which two cores
    take side by side."""
    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=timeout),
                             commands))


SIDE_BY_SIDE_WORKERS = 3  # two cores busy while a third child starts or exits


@contextlib.contextmanager
def side_by_side(jobs: dict, workers: int = SIDE_BY_SIDE_WORKERS):
    """Independent jobs (key -> callable) of several tests started together, `workers` at a time: a
    module fixture yields {key: Future} and each test checks its own job's result (`.result()`, which
    raises what the job raised). For children that mostly spend one core importing torch (~2 s of a
    short `python -m service` run), which run one after another left the other core idle. On exit,
    waits for the jobs under way and drops those not started (the tests that wanted them were not run)."""
    pool = concurrent.futures.ThreadPoolExecutor(workers)
    try:
        yield {key: pool.submit(job) for key, job in jobs.items()}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
