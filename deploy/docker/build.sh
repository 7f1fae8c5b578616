#!/usr/bin/env bash
# The image's build stage, run in the source tree: the project's wheel and, from a CUDA build of
# torch and nvcc, the csrc library (csrc/build.py, for the architectures in TORCH_CUDA_ARCH_LIST),
# both into DIST.
#
#   build.sh DIST        BUILD_CSRC=0 builds the wheel alone (tests/deploy/test_image_recipe.py)
#
# Nothing here is inlined in the Dockerfile, so the test runs exactly these steps.
set -euo pipefail

dist=${1:?usage: build.sh DIST}
torch_requirement=${TORCH_REQUIREMENT:-torch==2.13.0}
mkdir -p "$dist"

python -m pip wheel --no-deps --wheel-dir "$dist" .

if [ "${BUILD_CSRC:-1}" != 0 ]; then
  # csrc/build.py imports service.config, so the wheel's dependencies come too; ninja compiles
  # the two sources in parallel.
  python -m pip install "$torch_requirement" "ninja==1.13.0"
  python -m pip install "$dist"/moe_serve-*.whl
  python csrc/build.py
  # The source tree's service package (first on sys.path here) says where the build put it.
  library=$(python -c 'from service.kernels.schedule import LIBRARY_PATH; print(LIBRARY_PATH)')
  cp "$library" "$dist/moe_csrc.so"
fi
ls -l "$dist"
