#!/usr/bin/env bash
# Regenerate the kubelet gRPC modules (needs grpcio-tools, in the `test` extra): the
# device-plugin API from sharegpu's own proto, and the DRA plugin and plugin-registration APIs
# from the upstream protos copied beside it (src/sharegpu/agent/proto/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
D=src/sharegpu/agent/proto
PY=${PYTHON:-.venv/bin/python}
for name in api dra_v1 pluginregistration_v1 podresources_v1; do
    "$PY" -m grpc_tools.protoc -I "$D" --python_out="$D" --grpc_python_out="$D" "$D/$name.proto"
    sed -i "s/^import ${name}_pb2 as \(.*\)$/from . import ${name}_pb2 as \1/" "$D/${name}_pb2_grpc.py"
done
