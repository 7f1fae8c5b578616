"""Ahead-of-time build of csrc/ into build/moe_csrc/moe_csrc.so (no setup.py, no import-time build).

    python csrc/build.py [--verbose] [--arch "9.0;12.0"]

Needs a CUDA build of torch and nvcc (torch.utils.cpp_extension finds CUDA_HOME). The library
registers the `moe::` ops of csrc/bindings.cpp; service/kernels/schedule.py loads it lazily on
the first call and falls back to the torch builder (logged once) when it is absent.
Target architectures: --arch, else TORCH_CUDA_ARCH_LIST, else the visible GPUs' own.
The Hopper GEMM1 tile (csrc/gemm_sm90/gemm1_sm90.cu: wgmma, setmaxnreg) exists for sm_90a only: it
is compiled, for that target alone, when 9.0 is among the targets, linked into the same library
and its op registered (MOE_SM90_TILE); otherwise it is skipped with a line saying so, and the op
`moe::gemm1_swiglu_sm90` is absent (service/kernels/cuda_tile.py then refuses with that reason).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SOURCES = [ROOT / "csrc" / "bindings.cpp", ROOT / "csrc" / "schedule" / "schedule_kernel.cu"]
TILE_SOURCE = ROOT / "csrc" / "gemm_sm90" / "gemm1_sm90.cu"  # sm_90a only
TILE_GENCODE = "-gencode=arch=compute_90a,code=sm_90a"
# The language standard torch itself is built with (torch.utils.cpp_extension passes -std=c++20 since
# torch 2.10 and its headers use C++20 features): compiling the torch headers as C++17 builds, with
# warnings, but risks inline code that differs from libtorch's.
STD = "-std=c++20"


def build(verbose: bool = False, arch: str | None = None) -> Path:
    import torch
    from torch.utils import cpp_extension

    from service.kernels.schedule import BUILD_DIR, LIBRARY_NAME, LIBRARY_PATH

    if torch.version.cuda is None:
        raise SystemExit(f"torch {torch.__version__} is a CPU build: nothing to build (the torch builder is used)")
    if cpp_extension.CUDA_HOME is None:
        raise SystemExit("nvcc / CUDA_HOME not found: install the CUDA toolkit to build csrc/")
    if arch:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch  # read by cpp_extension for -gencode flags
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tile = _build_tile(cpp_extension, BUILD_DIR, _arch_versions(), verbose)  # an object file, or None
    defines = ["-DMOE_SM90_TILE"] if tile else []
    if tile:  # ninja's link step does not depend on an object passed as an ldflag: relink every time
        LIBRARY_PATH.unlink(missing_ok=True)
    if cpp_extension.is_ninja_available():
        cpp_extension.load(
            name=LIBRARY_NAME,
            sources=[str(s) for s in SOURCES],
            build_directory=str(BUILD_DIR),
            extra_cflags=["-O3", STD, *defines],
            extra_cuda_cflags=["-O3", STD, "-lineinfo"],
            extra_ldflags=[str(tile)] if tile else [],
            extra_include_paths=[str(ROOT / "csrc")],
            is_python_module=False,
            verbose=verbose,
        )
    else:  # no ninja: the same two compiles and one link, by hand
        _build_direct(cpp_extension, BUILD_DIR, LIBRARY_PATH, verbose, tile)
    assert LIBRARY_PATH.is_file(), f"build finished but {LIBRARY_PATH} is missing"
    print(f"built {LIBRARY_PATH} in {time.perf_counter() - start:.1f} s")
    _warn_private_libstdcxx(LIBRARY_PATH)
    return LIBRARY_PATH


def _warn_private_libstdcxx(library: Path) -> None:
    """Say so when the library defines libstdc++'s stream code itself (a static libstdc++ got
    linked in): that copy's locale is never initialised, so any std::ostream use inside the
    library is broken. bindings.cpp formats its messages without streams for that reason (the
    H200 image produced such a library); this line makes the condition visible."""
    import shutil
    import subprocess

    nm = shutil.which("nm")
    if nm is None:
        return
    out = subprocess.run([nm, "-D", "--defined-only", str(library)], capture_output=True, text=True).stdout
    private = [line.split()[-1] for line in out.splitlines() if " _ZNSo9_M_insert" in line or " _ZNSt6locale" in line]
    if private:
        print(f"warning: {library.name} defines {len(private)} libstdc++ stream/locale symbols itself "
              f"(e.g. {private[0]}): a private libstdc++ copy was linked in; keep std::ostream out of csrc/")


def _arch_versions() -> list[str]:
    """The target architectures ("9.0", "12.0", ...): TORCH_CUDA_ARCH_LIST (set by --arch), else the GPUs'."""
    import torch

    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs:
        versions = [a.replace("+PTX", "").strip() for a in archs.replace(",", ";").split(";") if a.strip()]
    else:
        versions = sorted({"{}.{}".format(*torch.cuda.get_device_capability(i))
                           for i in range(torch.cuda.device_count())})
    if not versions:
        raise SystemExit("no GPU visible and TORCH_CUDA_ARCH_LIST unset: pass --arch")
    return versions


def _gencode_flags() -> list[str]:
    flags = []
    for v in _arch_versions():
        num = v.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    return flags


def wants_tile(versions: list[str]) -> bool:
    """Whether the sm_90a GEMM1 tile is built for these targets (9.0 or 9.0a among them)."""
    return any(v.rstrip("a") == "9.0" for v in versions)


def _build_tile(cpp_extension, build_dir: Path, versions: list[str], verbose: bool) -> Path | None:
    """Compile the Hopper GEMM1 tile for sm_90a into an object the library links, or say why not."""
    if not wants_tile(versions):
        print(f"skipping the sm_90a GEMM1 tile ({TILE_SOURCE.relative_to(ROOT)}): targets {';'.join(versions)} "
              f"include no 9.0; the Triton GEMM1 serves there")
        return None
    obj = build_dir / "gemm1_sm90.o"
    nvcc = str(Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc")
    _run([nvcc, "-c", str(TILE_SOURCE), "-o", str(obj), "-O3", STD, "-lineinfo", "-Xcompiler", "-fPIC",
          f"-I{ROOT / 'csrc'}", TILE_GENCODE, "-Xptxas=-v"], verbose)
    return obj


def _run(cmd: list[str], verbose: bool) -> None:
    import subprocess

    if verbose:
        print(" ".join(cmd))
    subprocess.run(cmd, check=True)


def _build_direct(cpp_extension, build_dir: Path, library: Path, verbose: bool, tile: Path | None) -> None:
    import sysconfig

    import torch

    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    includes = [f"-I{p}" for p in cpp_extension.include_paths(device_type="cuda")]
    includes += [f"-I{sysconfig.get_paths()['include']}", f"-I{ROOT / 'csrc'}"]
    nvcc = str(Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc")
    kernel_o, bindings_o = build_dir / "schedule_kernel.o", build_dir / "bindings.o"
    _run([nvcc, "-c", str(SOURCES[1]), "-o", str(kernel_o), "-O3", STD, "-lineinfo",
          "-Xcompiler", "-fPIC", abi, *includes, *_gencode_flags()], verbose)
    _run(["c++", "-c", str(SOURCES[0]), "-o", str(bindings_o), "-O3", STD, "-fPIC", abi, *includes,
          *(["-DMOE_SM90_TILE"] if tile else [])], verbose)
    libs = [f"-L{p}" for p in cpp_extension.library_paths(device_type="cuda")]
    _run(["c++", "-shared", str(bindings_o), str(kernel_o), *([str(tile)] if tile else []), "-o", str(library), *libs,
          "-lc10", "-lc10_cuda", "-ltorch", "-ltorch_cpu", "-ltorch_cuda", "-lcudart"], verbose)
    torch.ops.load_library(str(library))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--arch", help='e.g. "9.0" or "9.0;12.0" (default: TORCH_CUDA_ARCH_LIST or the local GPUs)')
    args = parser.parse_args()
    build(verbose=args.verbose, arch=args.arch)


if __name__ == "__main__":
    main()
