"""Top-k combine: interpreter cases on CPU (in a subprocess), compile-only for sm_90 / sm_120,
and the compiled kernel on a GPU.

TRITON_INTERPRET is read when `@triton.jit` decorates, so the interpreter cases run in a child
process (this file as a script, tests/interp.py) and each test asserts on its case's JSON record.
"""

from __future__ import annotations

import pytest
import torch
import triton

from tests.helpers import SIM_TOL, rel_err
from tests.interp import job, main, run_cases

# Both sides accumulate in fp32, in the same k order, so they agree to rounding.
TOL = SIM_TOL

# name: (dtype, N, K, S, H, padding tokens)
CASES = {
    "fp32_padding": ("float32", 37, 4, 300, 96, [0, 5, 36]),
    "fp16_odd_h": ("float16", 20, 3, 64, 1500, [7]),        # H not a multiple of BLOCK_H: masked tail
    "fp32_k1": ("float32", 9, 1, 20, 130, [2, 3]),
    "fp32_all_padding": ("float32", 6, 2, 16, 40, [0, 1, 2, 3, 4, 5]),
}


def make_case(dtype: torch.dtype, N: int, K: int, S: int, H: int, padding: list[int], device="cpu", seed=0):
    """d [S, H] with NaN in every row no real hit points at; slots [N, K] distinct rows (-1 for the
    padding tokens, whose weights are NaN: neither may leak into the output)."""
    gen = torch.Generator().manual_seed(seed)
    d = torch.randn(S, H, generator=gen).to(dtype)
    slots = torch.randperm(S, generator=gen)[:N * K].view(N, K).to(torch.int32)
    w = torch.rand(N, K, generator=gen)
    slots[padding] = -1
    w[padding] = float("nan")
    unread = torch.ones(S, dtype=torch.bool)
    unread[slots[slots >= 0].long()] = False
    d[unread] = float("nan")
    return d.to(device), slots.to(device), w.to(device)


def _run_case(name: str) -> dict:
    from service.kernels.combine import combine, combine_ref

    dtype_name, N, K, S, H, padding = CASES[name]
    d, slots, w = make_case(getattr(torch, dtype_name), N, K, S, H, padding)
    out = torch.full((N, H), float("nan"))  # poisoned: every element must be written
    combine(d, slots, w, out=out)
    ref = combine_ref(d, slots, w)
    pad = torch.zeros(N, dtype=torch.bool)
    pad[padding] = True
    return dict(err=rel_err(out[~pad], ref[~pad]) if (~pad).any() else 0.0,
                finite=bool(torch.isfinite(out).all()),
                padding_zero=bool((out[pad] == 0).all()))


def background_jobs() -> list:
    """The interpreter run, started as soon as the session has collected this module (tests/background.py)."""
    return [job(__file__)]


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_cases(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreter_matches_reference(interpreter_results, name):
    r = interpreter_results[name]
    assert "exception" not in r, r.get("exception")
    assert r["err"] <= TOL, f"relative error {r['err']:.3g} > {TOL}"
    assert r["finite"], "NaN from an unread row of d, a padding weight, or an unwritten output element"
    assert r["padding_zero"], "a padding token's row is not exactly 0"


def test_reference_is_the_definition():
    d, slots, w = make_case(torch.float32, 5, 3, 30, 8, [1])
    ref = torch.zeros(5, 8)
    for g in range(5):
        for k in range(3):
            if slots[g, k] >= 0:
                ref[g] += w[g, k] * d[slots[g, k]]
    from service.kernels.combine import combine_ref

    assert torch.equal(combine_ref(d, slots, w), ref)


def test_launcher_rejects_bad_arguments():
    from service.kernels.combine import combine

    d, slots, w = make_case(torch.float32, 4, 2, 16, 8, [])
    with pytest.raises(ValueError, match="int32"):
        combine(d, slots.long(), w)
    with pytest.raises(ValueError, match="w \\[N, K\\]"):
        combine(d, slots, w[:, :1])
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        combine(d.double(), slots, w)
    with pytest.raises(ValueError, match="out must be"):
        combine(d, slots, w, out=torch.empty(4, 8, dtype=torch.float16))


# ---------------------------------------------------------------------------------------------
# Compile-only (no GPU needed).
# ---------------------------------------------------------------------------------------------

interpreting = pytest.mark.skipif(triton.knobs.runtime.interpret, reason="compile-only needs the compiler")


@interpreting
@pytest.mark.parametrize("arch", [90, 120])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_compiles(arch, dtype):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from service.kernels.combine import BLOCK_H, NUM_WARPS, _combine_kernel

    sig = {"d_ptr": f"*{dtype}", "slots_ptr": "*i32", "w_ptr": "*fp32", "out_ptr": "*fp32", "H": "i32",
           "stride_d": "i32", "stride_s": "i32", "stride_w": "i32", "stride_o": "i32",
           "K": "constexpr", "BLOCK_H": "constexpr"}
    aligned = [["tt.divisibility", 16]]
    attrs = {(i,): aligned for i, name in enumerate(sig)
             if name.endswith("_ptr") or name in ("H", "stride_d", "stride_o")}
    src = ASTSource(_combine_kernel, sig, {"K": 8, "BLOCK_H": BLOCK_H}, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=NUM_WARPS))
    ptx = kernel.asm["ptx"]
    if dtype != "fp32":  # 8 bf16 / fp16 per thread: one 16-byte load per row
        assert "ld.global.v4.b32" in ptx or "ld.global.nc.v4.b32" in ptx or ".v4." in ptx, "row loads not vectorized"


# ---------------------------------------------------------------------------------------------
# GPU.
# ---------------------------------------------------------------------------------------------

GPU_SHAPES = [(2048, 8, 24576, 4096, 0.1), (333, 2, 1000, 1000, 0.3), (1, 1, 128, 64, 0.0), (64, 8, 1024, 4097, 1.0)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "N{}_K{}_S{}_H{}_pad{}".format(*s))
def test_gpu_matches_reference(shape, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from service.kernels.combine import combine, combine_ref

    N, K, S, H, pad_fraction = shape
    padding = list(range(0, N, max(1, round(1 / pad_fraction)))) if pad_fraction else []
    d, slots, w = make_case(dtype, N, K, S, H, padding, device="cuda", seed=N + K)
    out = torch.full((N, H), float("nan"), device="cuda")  # poisoned before the run
    combine(d, slots, w, out=out)
    ref = combine_ref(d, slots, w)
    pad = torch.zeros(N, dtype=torch.bool, device="cuda")
    pad[padding] = True
    assert torch.isfinite(out).all(), "NaN leaked from an unread row of d or a padding weight"
    assert (out[pad] == 0).all(), "a padding token's row is not exactly 0"
    if (~pad).any():
        assert rel_err(out[~pad], ref[~pad]) <= TOL


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from service.kernels.combine import combine, combine_ref

    d, slots, w = make_case(torch.bfloat16, 256, 8, 4096, 512, [3, 100], device="cuda")
    out = torch.empty(256, 512, device="cuda")
    combine(d, slots, w, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        combine(d, slots, w, out=out)
    d2, slots2, w2 = make_case(torch.bfloat16, 256, 8, 4096, 512, [7], device="cuda", seed=1)
    d.copy_(d2), slots.copy_(slots2), w.copy_(w2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out[torch.arange(256, device="cuda") != 7], combine_ref(d, slots, w)[
        torch.arange(256, device="cuda") != 7]) <= TOL
    assert (out[7] == 0).all()


if __name__ == "__main__":
    main(CASES, _run_case)
