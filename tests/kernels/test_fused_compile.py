"""Compile-only checks of the fused kernels without a GPU, for sm_90 and sm_120: shared memory per
block under the device's limit, the ordering instructions present in the PTX (system-scope
acquire polls, a CTA barrier before every release, release stores to peers, %globaltimer).

Run as a script to print the table: `python tests/kernels/test_fused_compile.py`.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[2]
SMEM_LIMIT = {90: 232448, 120: 101376}
DIVISIBLE = ("stride_am", "stride_we", "stride_wk", "stride_om", "H", "Ir", "C", "tok_off", "pull_off", "stage_off",
             "rt_off")

interpreting = pytest.mark.skipif(triton.knobs.runtime.interpret, reason="compile-only needs the compiler")

# Kernel -> pointer types (everything else ending in _ptr / _ptrs is int32).
POINTERS = {
    "region_ptr": "*u8", "region_off": "*i64", "stats_ptr": "*i64",
    "a_ptr": "*{dt}", "w_ptr": "*{dt}", "act_ptr": "*{dt}", "d_ptr": "*{dt}",
    "stage_ptr": "*fp32", "out_ptr": "*fp32", "x_in_ptr": "*{dt}", "w_in_ptr": "*fp32", "bias_ptr": "*{dt}",
    "limit": "fp32", "alpha": "fp32",
}


def compile_kernel(name: str, arch: int, *, config=None, dtype: str = "bf16", use_ptx: bool = True, K: int = 8,
                   act: int = 1, clamp: bool = False, bias: bool = False):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from service.config import BM
    from service.kernels import fused_kernels as fk

    kernel = getattr(fk, name)
    names = list(inspect.signature(kernel.fn).parameters)
    constexprs = {"USE_PTX": use_ptx, "SYNC": True, "K": K, "KP": triton.next_power_of_2(K), "RP": 4, "TB": 4, "JT": 2,
                  "ACT": act, "CLAMP": clamp, "BIAS": bias, "W_DESC": bool(config and config.w_desc),
                  "SPLIT": bool(config and config.split_tail), "QUEUE": bool(config and config.queue),
                  "PN_MAJOR": bool(config and config.pn_major), "PAIR": bool(config and config.pair)}
    if config is not None:
        constexprs.update(BM=BM, BN=config.BN, BK=config.BK, IEEE=False, EVEN_K=True, EVEN_N=True,
                          NUM_PROGRAMS=132, NUM_COMM=8, NUM_COMPUTE=124, JOIN=True, BH=512)
    constexprs.update({"BL": 1024, "BR": 4, "BH": constexprs.get("BH", 1024), "BRK": 32})
    sig, attrs, cx = {}, {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            sig[n] = "constexpr"
            cx[n] = constexprs[n]
        elif n == "w_ptr" and config is not None and config.w_desc:
            sig[n] = f"tensordesc<{dtype}[{config.BK}, {config.BN}]>"
        elif n.endswith("_ptr") or n.endswith("_ptrs") or n in POINTERS:
            sig[n] = POINTERS.get(n, "*i32").format(dt=dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "i32"
            if n in DIVISIBLE:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages) if config else dict(num_warps=4)
    return triton.compile(ASTSource(kernel, sig, cx, attrs), target=GPUTarget("cuda", arch, 32), options=options)


def _configs(arch: int):
    from service.kernels import tuning

    size = "large" if arch == 90 else "small"
    return tuning._DEFAULTS[(size, "gemm1")], tuning._DEFAULTS[(size, "gemm2")]


@interpreting
@pytest.mark.parametrize("arch", [90, 120])
def test_tile_queue_compiles(arch):
    """GemmConfig.queue + pn_major in both kernels: same shared memory as the static walk, the
    tensor-core path kept, and the queue is a GPU-scope relaxed counter (a local one, no system
    scope: no peer ever reads it)."""
    import dataclasses

    for name, config in zip(("_ag_gemm1_kernel", "_gemm2_push_kernel"), _configs(arch), strict=True):
        static = compile_kernel(name, arch, config=config)
        queued = compile_kernel(name, arch, config=dataclasses.replace(config, queue=True, pn_major=True))
        assert queued.metadata.shared == static.metadata.shared, f"{name}: the queue changed the tile's shared memory"
        ptx = queued.asm["ptx"]
        if arch == 90:
            assert "wgmma" in ptx, f"{name}: sm_90 build without wgmma"
        def atomics(p):
            return re.findall(r"(?<![\w.])atom\.global[\w.]*", p)

        before, after = atomics(static.asm["ptx"]), atomics(ptx)
        assert set(after) - set(before) <= {"atom.global.gpu.relaxed.add.u32", "atom.global.gpu.relaxed.add.s32"}, \
            f"{name}: the tile queue added other atomics: {set(after) - set(before)}"
        relaxed = [a for a in after if a.startswith("atom.global.gpu.relaxed.add.") and not a.endswith("64")]
        assert len(relaxed) > len([a for a in before if a in relaxed]), f"{name}: no tile-queue atomic"


@interpreting
@pytest.mark.parametrize("arch", [90, 120])
def test_pair_tiles_compile(arch):
    """Both GEMM kernels with GemmConfig.pair (tuning.pair_config of the target's defaults): within
    shared memory as tuning.tile_smem_bytes predicts, tensor cores and the acquire polls kept,
    kernel 1's A rows still 16-byte copies, kernel 2 still marking tiles with release signals."""
    from service.kernels import tuning

    for name, config in zip(("_ag_gemm1_kernel", "_gemm2_push_kernel"), _configs(arch), strict=True):
        swiglu = name == "_ag_gemm1_kernel"
        paired = tuning.pair_config(config, SMEM_LIMIT[arch], swiglu=swiglu)
        k = compile_kernel(name, arch, config=paired)
        ptx = k.asm["ptx"]
        assert k.metadata.shared <= SMEM_LIMIT[arch], f"{name} with pair tiles needs {k.metadata.shared} B"
        assert k.metadata.shared == tuning.tile_smem_bytes(paired, SMEM_LIMIT[arch], swiglu=swiglu), name
        if arch == 90:
            assert "wgmma" in ptx, f"{name}: sm_90 build without wgmma"
        assert "ld.global.acquire.sys.b32" in ptx, f"{name}: no acquire poll"
        if swiglu:
            sizes = set(re.findall(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^]]+\], \[[^]]+\], (\w+)", ptx))
            assert sizes == {"0x10"}, f"{name}: async copy sizes {sizes}"
        else:
            assert "red.release.sys.global.add.s32" in ptx, f"{name}: no release tile marks"


@interpreting
@pytest.mark.parametrize("arch", [90, 120])
def test_gemm_kernels_fit_and_order(arch):
    c1, c2 = _configs(arch)
    for name, config in (("_ag_gemm1_kernel", c1), ("_gemm2_push_kernel", c2)):
        k = compile_kernel(name, arch, config=config)
        shared = k.metadata.shared
        assert shared <= SMEM_LIMIT[arch], f"{name} needs {shared} B of shared memory, sm_{arch} has {SMEM_LIMIT[arch]}"
        assert shared >= config.BM * config.BK * 2, f"{name}: the K loop was not pipelined"
        ptx = k.asm["ptx"]
        if arch == 90:
            assert "wgmma" in ptx, f"{name}: sm_90 build without wgmma"
        assert "ld.global.acquire.sys.b32" in ptx, f"{name}: no per-thread acquire poll"
        assert "%globaltimer" in ptx, f"{name}: no wait timer"
        if name == "_ag_gemm1_kernel":
            # The pullers' arrivals: release stores after a CTA barrier; no read-modify-write.
            at = ptx.find("st.release.sys.global.b32")
            assert at > 0 and "bar.sync" in ptx[:at], f"{name}: arrival without a preceding CTA barrier"
            atomics = set(re.findall(r"(?<![\w.])(?:atom|red)\.global[\w.]*", ptx))
            assert atomics <= {"atom.global.gpu.relaxed.add.u64", "atom.global.acq_rel.gpu.cas.b32"}, \
                f"{name}: atomics beyond the stats sum and the error flag: {atomics}"
            # The gathered A rows still move in 16-byte pieces (the row offsets' alignment was
            # proven to the compiler): every asynchronous copy is 16 bytes.
            sizes = set(re.findall(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^]]+\], \[[^]]+\], (\w+)", ptx))
            assert sizes == {"0x10"}, f"{name}: async copy sizes {sizes}"
            assert "ld.global.b16" not in ptx, f"{name}: element-wise 2-byte loads (lost alignment)"
        else:
            assert "red.release.sys.global.add.s32" in ptx, "GEMM2 epilogue: no release signal"
            assert "st.release.sys.global.b32" in ptx, "watermark: no release store to the owner"
            assert "atom.global.sys.acq_rel.add" in ptx, "elected last writer: no acq_rel local count"
            # No remote read-modify-write: the only system-scope RMWs are the local counters.
            assert "atom.global.sys.release" not in ptx and "atom.global.release.sys" not in ptx


@interpreting
@pytest.mark.parametrize("arch", [90, 120])
@pytest.mark.parametrize("variant", ["silu_clamp", "gelu_tanh", "gpt_oss_bias"])
def test_epilogue_variants_compile(arch, variant):
    """Kernel 1 with every activation (clamp, biases) and kernel 2 with the down bias: both targets,
    within shared memory, tensor cores kept."""
    from service.kernels.grouped_gemm import ACT_CODES

    c1, c2 = _configs(arch)
    act = {"silu_clamp": "silu", "gelu_tanh": "gelu_tanh", "gpt_oss_bias": "gpt_oss"}[variant]
    bias = variant == "gpt_oss_bias"
    kernels = [compile_kernel("_ag_gemm1_kernel", arch, config=c1, act=ACT_CODES[act], clamp=variant != "gelu_tanh",
                              bias=bias)]
    if bias:
        kernels.append(compile_kernel("_gemm2_push_kernel", arch, config=c2, bias=True))
    for k in kernels:
        assert k.metadata.shared <= SMEM_LIMIT[arch]
        if arch == 90:
            assert "wgmma" in k.asm["ptx"]


@interpreting
@pytest.mark.parametrize("arch", [90, 120])
def test_weight_descriptors_compile(arch):
    """Both GEMM kernels with GemmConfig.w_desc (the tile code the grouped GEMM runs too): TMA copies
    of the weights, within shared memory, tensor cores kept, the gathered A rows still 16-byte copies."""
    import dataclasses

    c1, c2 = (dataclasses.replace(c, w_desc=True) for c in _configs(arch))
    for name, config in (("_ag_gemm1_kernel", c1), ("_gemm2_push_kernel", c2)):
        k = compile_kernel(name, arch, config=config)
        ptx = k.asm["ptx"]
        assert "cp.async.bulk.tensor" in ptx, f"{name}: w_desc build without TMA loads"
        assert k.metadata.shared <= SMEM_LIMIT[arch], f"{name} needs {k.metadata.shared} B"
        if arch == 90:
            assert "wgmma" in ptx
        assert "ld.global.b16" not in ptx, f"{name}: element-wise 2-byte loads (lost alignment)"


@interpreting
@pytest.mark.parametrize("arch", [90, 120])
def test_small_kernels_compile(arch):
    for name in ("_exchange_kernel", "_final_reduce_kernel"):
        k = compile_kernel(name, arch)
        assert k.metadata.shared <= SMEM_LIMIT[arch]
        ptx = k.asm["ptx"]
        assert "ld.global.acquire.sys.b32" in ptx, f"{name}: no acquire poll"
        if name == "_exchange_kernel":
            at = ptx.find("st.release.sys.global.b32")
            assert at > 0 and "bar.sync" in ptx[:at], "barrier signal without a preceding CTA barrier"
            assert "fence.acq_rel.sys" in ptx


@interpreting
@pytest.mark.parametrize("arch", [90, 120])
def test_stage_kernel_moves_vectors(arch):
    ptx = compile_kernel("_stage_kernel", arch).asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, "token rows not copied in 16-byte vectors"
    assert "ld.global.b16" not in ptx


@interpreting
def test_interpreter_path_compiles_too():
    """USE_PTX=False (what CI interprets) is also valid GPU code."""
    c1, c2 = _configs(90)
    for name, config in (("_ag_gemm1_kernel", c1), ("_gemm2_push_kernel", c2), ("_exchange_kernel", None),
                         ("_final_reduce_kernel", None)):
        ptx = compile_kernel(name, 90, config=config, use_ptx=False).asm["ptx"]
        assert "acquire" in ptx, f"{name}: no acquire on the atomic path"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for arch in (90, 120):
        c1, c2 = _configs(arch)
        for name, config in (("_ag_gemm1_kernel", c1), ("_gemm2_push_kernel", c2), ("_exchange_kernel", None),
                             ("_final_reduce_kernel", None)):
            k = compile_kernel(name, arch, config=config)
            print(f"sm_{arch} {name:22s} {config}: shared {k.metadata.shared} B (limit {SMEM_LIMIT[arch]}), "
                  f"regs {getattr(k, 'n_regs', '?')}")
