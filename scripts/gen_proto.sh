#!/usr/bin/env bash
# Generate the Python gRPC stubs from proto/ into cluster/_gen/ (never edit the output by hand).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
out=cluster/_gen
rm -rf "$out"
mkdir -p "$out"
"$PY" -m grpc_tools.protoc -Iproto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/specserve/v1/specserve.proto
# grpc_tools writes "from specserve.v1 import specserve_pb2"; make it package-relative so the
# stubs import as cluster._gen.specserve.v1 without touching sys.path.
sed -i 's/^from specserve\.v1 import /from . import /' "$out"/specserve/v1/*_grpc.py
touch "$out/__init__.py" "$out/specserve/__init__.py" "$out/specserve/v1/__init__.py"
echo "generated $(find "$out" -name '*.py' | wc -l) files in $out"
