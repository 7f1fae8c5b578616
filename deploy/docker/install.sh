#!/usr/bin/env bash
# The image's install step, into the active Python environment, from the build stage's DIST:
# torch first, then the project's wheel, then the csrc library where the package looks for it.
#
#   install.sh DIST      DIST holds one moe_serve-*.whl and, from a CUDA build, moe_csrc.so
#
# TORCH_REQUIREMENT (default torch==2.13.0: on Linux x86_64 PyPI serves the CUDA 13.0 build)
# picks the torch build. tests/deploy/test_image_recipe.py runs this script unchanged in a fresh
# virtual environment with the CPU build, so the image recipe cannot rot unnoticed.
set -euo pipefail

dist=${1:?usage: install.sh DIST}
torch_requirement=${TORCH_REQUIREMENT:-torch==2.13.0}

shopt -s nullglob
wheels=("$dist"/moe_serve-*.whl)
if [ "${#wheels[@]}" -ne 1 ]; then
  echo "install.sh: expected one moe_serve wheel in $dist, found ${#wheels[@]}" >&2
  exit 1
fi

# torch before the wheel: the wheel asks for torch>=2.11, which alone would take the newest release.
python -m pip install "$torch_requirement"
python -m pip install "${wheels[0]}"

# Import the service (fail here, not at the first start, when it cannot) and ask the installed
# package, from outside any source tree, where it loads the csrc library from.
library=$(cd / && python -c 'import service.server
from service.kernels.schedule import LIBRARY_PATH
print(LIBRARY_PATH)')
if [ -f "$dist/moe_csrc.so" ]; then
  mkdir -p "$(dirname "$library")"
  cp "$dist/moe_csrc.so" "$library"
  echo "install.sh: csrc library installed as $library"
else
  echo "install.sh: no moe_csrc.so in $dist; the torch schedule builder will be used"
fi

# The wire arena's object allocator (--wire-arena-grpc), built here beside its source so that no
# front end compiles it at its start (the runtime stage has gcc and the Python headers).
(cd / && python -c 'from service.api import arena_objects; print("install.sh: built", arena_objects.prebuild())')
