#!/usr/bin/env bash
# Regenerate the device-plugin gRPC modules from sharegpu's own proto (needs grpcio-tools).
set -euo pipefail
cd "$(dirname "$0")/.."
D=src/sharegpu/agent/proto
PY=${PYTHON:-.venv/bin/python}
"$PY" -m grpc_tools.protoc -I "$D" --python_out="$D" --grpc_python_out="$D" "$D/api.proto"
sed -i 's/^import api_pb2 as api__pb2$/from . import api_pb2 as api__pb2/' "$D/api_pb2_grpc.py"
