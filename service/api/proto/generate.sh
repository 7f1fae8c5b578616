#!/usr/bin/env bash
# Regenerates grpc_predict_v2_pb2.py / _pb2_grpc.py from grpc_predict_v2.proto.
# Needs grpcio-tools==1.72.1 exactly (e.g. `python -m venv /tmp/gen && /tmp/gen/bin/pip install
# grpcio-tools==1.72.1`, then run this with PYTHON=/tmp/gen/bin/python). Its protoc writes protobuf
# 6.30.0 gencode, which the generated module checks at import: the runtime must be >= 6.30.0, and
# protobuf 7 still loads it. Newer tools would raise that floor past what tritonclient allows
# (protobuf<7), and the service could no longer share an environment with it. The _grpc module
# likewise requires grpcio >= 1.72.1. pyproject.toml's protobuf and grpcio floors are these two.
# protoc writes absolute imports (`import grpc_predict_v2_pb2`); the sed makes them
# package-relative so the modules live inside service.api.proto.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python}
TOOLS=1.72.1
have=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("grpcio-tools"))')
if [ "$have" != "$TOOLS" ]; then
  echo "generate.sh: needs grpcio-tools==$TOOLS, $PYTHON has $have" >&2
  exit 1
fi
"$PYTHON" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. grpc_predict_v2.proto
sed -i 's/^import grpc_predict_v2_pb2 as/from . import grpc_predict_v2_pb2 as/' grpc_predict_v2_pb2_grpc.py
# A private descriptor pool: tritonclient.grpc registers the same `inference.*` names in the
# default pool, and one process (a test run, a benchmark, a client embedding the service) may
# import both. gRPC reflection is handed this pool (service.api.grpc).
sed -i 's/^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(/POOL = _descriptor_pool.DescriptorPool()\nDESCRIPTOR = POOL.AddSerializedFile(/' grpc_predict_v2_pb2.py
grep -q '^POOL = ' grpc_predict_v2_pb2.py
