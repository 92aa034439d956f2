#!/usr/bin/env bash
# Regenerates the protobuf/gRPC modules (needs grpcio-tools, the `dev` extra). tests/test_proto.py checks they are current.
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. kvseal/proto/kvseal.proto
