"""Compile-only checks without a GPU: the Triton grouped GEMM for sm_90 and sm_120 (shared memory
per block asserted, tensor cores and, with weight descriptors, the TMA copy in the PTX, no
system-scope operation) and csrc/ with nvcc.

Run as a script to print the shared-memory table: `python tests/kernels/test_compile.py`.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import triton

if TYPE_CHECKING:  # imported where used: run as a script, this file has no tests package on its path yet
    from tests.background import Job

ROOT = Path(__file__).resolve().parents[2]
SMEM_LIMIT = {90: 232448, 120: 101376}  # bytes of shared memory per block (opt-in maximum)
CONSTEXPRS = ("ACT", "CLAMP", "BIAS", "W_DESC", "GATHER", "SPLIT", "QUEUE", "PN_MAJOR", "PAIR", "IEEE", "EVEN_K",
              "EVEN_N",
              "BM", "BN", "BK", "NUM_PROGRAMS")
# What the runtime specialises at launch for the seed shape: 16-byte aligned pointers, strides
# and sizes divisible by 16, unit inner strides. Without these hints no cp.async pipelining.
DIVISIBLE = ("stride_am", "stride_we", "stride_wk", "stride_om", "N", "K", "up_col")
UNIT = ("stride_ak", "stride_wn", "stride_on")
# Device name in the config file -> compile target.
DEVICE_ARCH = {"NVIDIA_H200": 90, "NVIDIA_H100_80GB_HBM3": 90, "NVIDIA_GeForce_RTX_5090": 120}

interpreting = pytest.mark.skipif(triton.knobs.runtime.interpret,
                                  reason="compile-only needs the compiler, not TRITON_INTERPRET")


def compile_gemm(arch: int, *, swiglu: bool, config, dtype="bf16", gather=False,
                 act: int = 1, clamp: bool = False, bias: bool = False):
    """triton.compile of the kernel for GPUTarget('cuda', arch, 32), as a launch would specialise it.
    swiglu: GEMM1 with activation `act` (grouped_gemm.ACT_CODES), else GEMM2 (ACT = 0); with
    config.w_desc, w_ptr is a tensor descriptor with [BK, BN] boxes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from service.kernels.grouped_gemm import BM, _grouped_gemm_kernel

    names = list(inspect.signature(_grouped_gemm_kernel.fn).parameters)
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        if name in CONSTEXPRS or name in UNIT:
            sig[name] = "constexpr"
        elif name == "w_ptr" and config.w_desc:
            sig[name] = f"tensordesc<{dtype}[{config.BK}, {config.BN}]>"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}" if name in ("a_ptr", "w_ptr", "out_ptr", "bias_ptr") else "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("limit", "alpha"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in DIVISIBLE:
                attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = dict(ACT=act if swiglu else 0, CLAMP=clamp, BIAS=bias, W_DESC=config.w_desc, GATHER=gather,
                      SPLIT=config.split_tail, QUEUE=config.queue, PN_MAJOR=config.pn_major,
                      PAIR=config.pair, IEEE=dtype == "fp32",
                      EVEN_K=True, EVEN_N=True, BM=BM, BN=config.BN, BK=config.BK, NUM_PROGRAMS=132,
                      **{name: 1 for name in UNIT})
    src = ASTSource(_grouped_gemm_kernel, sig, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=config.num_warps, num_stages=config.num_stages))


def _config_cases():
    from service.kernels import tuning

    cases = []
    for path in sorted(tuning.CONFIG_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        arch = DEVICE_ARCH.get(data["device"])
        for m, entry in data["configs"].items():
            cases.append(pytest.param(arch, data["mode"], tuning.config_from_dict(entry), id=f"{path.stem}@M{m}"))
    for (size, mode), config in tuning._DEFAULTS.items():
        for arch in ((90,) if size == "large" else (90, 120)):
            cases.append(pytest.param(arch, mode, config, id=f"default_{size}_{mode}_sm{arch}"))
    return cases


@interpreting
@pytest.mark.parametrize("arch,mode,config", _config_cases())
def test_config_fits_shared_memory(arch, mode, config):
    assert arch is not None, "config file for a device with no known compile target: add it to DEVICE_ARCH"
    kernel = compile_gemm(arch, swiglu=mode == "gemm1", config=config)
    shared = kernel.metadata.shared
    assert shared <= SMEM_LIMIT[arch], \
        f"{mode} {config} needs {shared} B of shared memory, sm_{arch} has {SMEM_LIMIT[arch]}"
    assert shared >= config.BM * config.BK * 2, "no shared-memory staging: the K loop was not pipelined"
    ptx = kernel.asm["ptx"]
    if arch == 90:
        assert "wgmma" in ptx, "sm_90 build without wgmma"


@interpreting
@pytest.mark.parametrize("arch", [90, 120])
@pytest.mark.parametrize("mode", ["gemm1", "gemm2"])
def test_weight_descriptor_compiles(arch, mode):
    """GemmConfig.w_desc on the default tiles of both targets: the weights come through the TMA
    copy (cp.async.bulk.tensor), the tile still fits the shared memory, sm_90 keeps wgmma."""
    import dataclasses

    from service.kernels import tuning

    config = dataclasses.replace(tuning._DEFAULTS[("large" if arch == 90 else "small", mode)], w_desc=True)
    kernel = compile_gemm(arch, swiglu=mode == "gemm1", config=config, gather=mode == "gemm1")
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx, "w_desc build without TMA loads"
    assert kernel.metadata.shared <= SMEM_LIMIT[arch], f"{mode} w_desc needs {kernel.metadata.shared} B"
    if arch == 90:
        assert "wgmma" in ptx, "sm_90 build without wgmma"


@interpreting
@pytest.mark.parametrize("arch", [90, 120])
@pytest.mark.parametrize("variant", ["silu_clamp", "gelu_tanh", "gpt_oss_bias", "gemm2_bias"])
def test_epilogue_variants_compile(arch, variant):
    """Every activation of GEMM1's epilogue (with its clamp and biases) and GEMM2's bias compile for
    both targets, fit the shared memory of the tuned configs, and keep the tensor-core path."""
    from service.kernels import tuning
    from service.kernels.grouped_gemm import ACT_CODES

    mode = "gemm2" if variant == "gemm2_bias" else "gemm1"
    config = tuning._DEFAULTS[("large" if arch == 90 else "small", mode)]
    act = {"silu_clamp": "silu", "gelu_tanh": "gelu_tanh", "gpt_oss_bias": "gpt_oss"}.get(variant, "silu")
    kernel = compile_gemm(arch, swiglu=mode == "gemm1", config=config, act=ACT_CODES[act],
                          clamp=variant in ("silu_clamp", "gpt_oss_bias"), bias="bias" in variant)
    assert kernel.metadata.shared <= SMEM_LIMIT[arch]
    if arch == 90:
        assert "wgmma" in kernel.asm["ptx"], "sm_90 build without wgmma"


@interpreting
@pytest.mark.parametrize("arch,mode,config", [c for c in _config_cases() if c.values[0] is not None])
def test_pair_tiles_compile(arch, mode, config):
    """GemmConfig.pair as tuning.pair_config sets it on each committed config and default (the lead's
    switch): the kernel with BM-row, half and pair tiles compiles for the target, its shared memory
    is what tuning.tile_smem_bytes predicts (pair off too) and fits, and sm_90 keeps wgmma. At the
    sm_90 defaults a pair stage is the BM-row tile's 48 KB in both GEMMs: no growth."""
    from service.kernels import tuning

    swiglu = mode == "gemm1"
    paired = tuning.pair_config(config, SMEM_LIMIT[arch], swiglu=swiglu)
    kernel = compile_gemm(arch, swiglu=swiglu, config=paired, gather=swiglu)
    shared = kernel.metadata.shared
    assert shared <= SMEM_LIMIT[arch], f"pair {paired} needs {shared} B, sm_{arch} has {SMEM_LIMIT[arch]}"
    assert shared == tuning.tile_smem_bytes(paired, SMEM_LIMIT[arch], swiglu=swiglu), f"byte model off: {shared} B"
    if arch == 90:
        assert "wgmma" in kernel.asm["ptx"], "sm_90 pair build without wgmma"
    rows = compile_gemm(arch, swiglu=swiglu, config=config, gather=swiglu).metadata.shared  # pair off
    assert rows == tuning.tile_smem_bytes(config, SMEM_LIMIT[arch], swiglu=swiglu), f"byte model off: {rows} B"


@interpreting
def test_no_sync_instructions():
    from service.kernels.grouped_gemm import GemmConfig

    config = GemmConfig(BN=64, BK=64, num_warps=4, num_stages=2)
    ptx = compile_gemm(90, swiglu=True, config=config, gather=True).asm["ptx"]
    assert ".sys" not in ptx, "the grouped GEMM synchronises with nobody: no system-scope operations"


# ---------------------------------------------------------------------------------------------
# csrc with nvcc.
# ---------------------------------------------------------------------------------------------

NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: the CUDA toolkit is not installed here")
@pytest.mark.parametrize("arch", [90, 120])
def test_schedule_kernel_compiles(arch, tmp_path):
    src = ROOT / "csrc" / "schedule" / "schedule_kernel.cu"
    cmd = [NVCC, "-c", str(src), "-o", str(tmp_path / f"schedule_sm{arch}.o"), "-std=c++17", "-O3",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas=-v"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"


TILE_SOURCE = ROOT / "csrc" / "gemm_sm90" / "gemm1_sm90.cu"


@pytest.fixture(scope="module")
def tile_ptxas(tmp_path_factory):
    """ptxas -v of the Hopper GEMM1 tile for sm_90a, as csrc/build.py compiles it."""
    if NVCC is None:
        pytest.skip("nvcc not on PATH: the CUDA toolkit is not installed here")
    sys.path.insert(0, str(ROOT))
    from csrc.build import STD, TILE_GENCODE

    out = tmp_path_factory.mktemp("tile") / "gemm1_sm90.o"
    cmd = [NVCC, "-c", str(TILE_SOURCE), "-o", str(out), "-O3", STD, f"-I{ROOT / 'csrc'}", TILE_GENCODE, "-Xptxas=-v"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def test_cuda_tile_registers_and_no_spills(tile_ptxas):
    """One 384-thread CTA per SM: ptxas caps the kernel at 168 registers (setmaxnreg then gives the
    producer warp group 40 and the consumers 232); nothing may spill and no local memory is used,
    in every variant's instance."""
    from service.kernels.cuda_tile import VARIANTS

    regs = [int(r) for r in re.findall(r"Used (\d+) registers", tile_ptxas)]
    assert regs and max(regs) <= 168, tile_ptxas
    # One kernel instance per mainloop variant (gemm1_kernel<V>), each without stack or spills.
    entries = re.findall(r"Compiling entry function '\w*gemm1_kernel\w*' for 'sm_90a'", tile_ptxas)
    assert len(entries) == len(VARIANTS) == len(regs), tile_ptxas
    clean = tile_ptxas.count("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads")
    assert clean == len(entries), tile_ptxas


def test_cuda_tile_wgmma_not_serialized(tile_ptxas):
    """ptxas serialises the wgmma pipeline (warning C7510 / C7518: waits inserted after every wgmma)
    when it cannot prove the accumulators untouched, e.g. a wgmma under a divergent branch: the tile
    would then run at a fraction of its rate without any error."""
    assert "Potential Performance Loss" not in tile_ptxas and "serialized" not in tile_ptxas, tile_ptxas


def test_build_skips_the_tile_without_sm90(tmp_path, capsys):
    """csrc/build.py builds the tile for a 9.0 target only; for sm_120 alone it says why not."""
    sys.path.insert(0, str(ROOT))
    import types

    from csrc import build

    assert build.wants_tile(["9.0", "12.0"]) and build.wants_tile(["9.0a"]) and not build.wants_tile(["12.0"])
    assert build._build_tile(types.SimpleNamespace(CUDA_HOME="/nonexistent"), tmp_path, ["12.0"], False) is None
    assert "skipping the sm_90a GEMM1 tile" in capsys.readouterr().out


@functools.cache
def _cuda_include() -> Path | None:
    """The CUDA toolkit's include directory, as nvcc itself reports it (nvcc may be a wrapper script)."""
    if NVCC is None:
        return None
    out = subprocess.run([NVCC, "--dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"], capture_output=True,
                         text=True, timeout=60).stderr
    found = re.search(r'INCLUDES="-I([^"]+)"', out)
    return Path(found.group(1).strip()) if found else None


CXX = shutil.which("g++") or shutil.which("c++")
BINDINGS_TIMEOUT_S = 180


def _bindings_job(tile: bool, cuda: bool) -> Job | None:
    """g++ -fsyntax-only over bindings.cpp, the variant's defines and include paths; None where the
    variant cannot be checked here (no compiler; cuda_path: no CUDA toolkit headers)."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    from tests.background import Job

    include = _cuda_include() if cuda else None
    if CXX is None or (cuda and not (include and (include / "cuda_runtime_api.h").is_file())):
        return None
    flags = [f"-I{p}" for p in include_paths()]
    flags.append(f"-I{sysconfig.get_paths()['include']}")
    defines = ["-DMOE_SM90_TILE"] if tile else []
    defines += [f"-I{include}", "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE"] if cuda else ["-DMOE_SYNTAX_ONLY"]
    cmd = [CXX, "-std=c++20", "-fsyntax-only", *defines, *flags, str(ROOT / "csrc" / "bindings.cpp")]
    return Job.of(f"bindings tile={tile} cuda={cuda}", cmd, BINDINGS_TIMEOUT_S)


def background_jobs() -> list[Job]:
    """The g++ runs of test_bindings_syntax, started as soon as the session has collected this module
    (~5 s each; tests/background.py)."""
    jobs = [_bindings_job(tile, cuda) for cuda in (False, True) for tile in (False, True)]
    return [j for j in jobs if j is not None]


@pytest.mark.skipif(CXX is None, reason="no host C++ compiler")
@pytest.mark.parametrize("tile", [False, True], ids=["schedule_only", "with_sm90_tile"])
@pytest.mark.parametrize("cuda", [False, True], ids=["syntax_only", "cuda_path"])
def test_bindings_syntax(tile, cuda):
    """bindings.cpp against the installed torch headers. syntax_only: CPU builds ship no CUDA
    headers, and the file keeps CUDA types behind the launchers' plain C signatures, so this works
    without them. cuda_path: the stream and guard code too, against the CUDA toolkit's headers
    and torch's c10/cuda ones (a CPU wheel lacks their cmake-generated file, which the macro
    C10_CUDA_NO_CMAKE_CONFIGURE_FILE skips)."""
    from tests import background

    job = _bindings_job(tile, cuda)
    if job is None:
        pytest.skip("no CUDA toolkit headers here")
    proc = background.result(job)
    assert proc.returncode == 0, f"{' '.join(job.argv)}\n{proc.stderr[-4000:]}"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for case in _config_cases():
        arch, mode, config = case.values
        k = compile_gemm(arch, swiglu=mode == "gemm1", config=config)
        print(f"{case.id:55s} sm_{arch} {mode} BN={config.BN} BK={config.BK} w{config.num_warps} "
              f"s{config.num_stages}: shared {k.metadata.shared} B (limit {SMEM_LIMIT[arch]})")
