#!/usr/bin/env bash
# Regenerates grpc_predict_v2_pb2.py / _pb2_grpc.py from grpc_predict_v2.proto (needs grpcio-tools).
# protoc writes absolute imports (`import grpc_predict_v2_pb2`); the sed makes them
# package-relative so the modules live inside service.api.proto.
set -euo pipefail
cd "$(dirname "$0")"
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. grpc_predict_v2.proto
sed -i 's/^import grpc_predict_v2_pb2 as/from . import grpc_predict_v2_pb2 as/' grpc_predict_v2_pb2_grpc.py
# A private descriptor pool: tritonclient.grpc registers the same `inference.*` names in the
# default pool, and one process (a test run, a benchmark, a client embedding the service) may
# import both. gRPC reflection is handed this pool (service.api.grpc).
sed -i 's/^DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile(/POOL = _descriptor_pool.DescriptorPool()\nDESCRIPTOR = POOL.AddSerializedFile(/' grpc_predict_v2_pb2.py
grep -q '^POOL = ' grpc_predict_v2_pb2.py
