#!/usr/bin/env bash
# Install arctic-inference (SuffixDecoding's suffix tree, for pools with `suffix:`) into the Python
# environment of $1 (default: .venv). The registry has only its sdist; the tree is plain C++
# (nanobind) and builds in ~15 s with a C++ compiler and CMake. Its CUDA ops build only when
# ARCTIC_INFERENCE_PRECOMPILED_OPS is set (never here); its vLLM plugin stays off unless
# ARCTIC_INFERENCE_ENABLED is set (never here). Idempotent; the wheel is cached in
# $SPECSERVE_WHEEL_CACHE (default ~/.cache/specserve/wheels; "" for no cache).
# Used by scripts/bootstrap.sh and the images (k8s/docker/).
set -euo pipefail
PY=${1:-.venv/bin/python}
PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"  # CMake runs elsewhere: an absolute path
ARCTIC=0.3.0
if "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('arctic_inference') != '$ARCTIC')" 2>/dev/null; then
  exit 0
fi
cache=${SPECSERVE_WHEEL_CACHE-${XDG_CACHE_HOME:-$HOME/.cache}/specserve/wheels}
tag=$("$PY" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
wheel=""
[ -n "$cache" ] && wheel=$(ls "$cache"/arctic_inference-$ARCTIC-$tag-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  echo "[build_arctic] building arctic-inference $ARCTIC (suffix decoding) from its sdist"
  "$PY" -m pip install -q --no-cache-dir nanobind==2.9.2 ninja
  command -v cmake >/dev/null || "$PY" -m pip install -q --no-cache-dir "cmake>=3.18"
  build=$(mktemp -d)
  out=${cache:-$build/wheel}
  mkdir -p "$out"
  "$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation "arctic-inference==$ARCTIC" -d "$build"
  tar xzf "$build/arctic_inference-$ARCTIC.tar.gz" -C "$build"
  bindir=$(dirname "$PY")
  CMAKE_ARGS="-DPython_EXECUTABLE=$PY" PATH="$bindir:$PATH" "$PY" -m pip wheel -q --no-cache-dir \
    --no-deps --no-build-isolation "$build/arctic_inference-$ARCTIC" -w "$out" >"$build/build.log" 2>&1 \
    || { tail -40 "$build/build.log" >&2; echo "[build_arctic] build failed (needs a C++ compiler)" >&2; exit 1; }
  wheel=$(ls "$out"/arctic_inference-$ARCTIC-$tag-*.whl | head -1)
  "$PY" -m pip install -q --no-cache-dir --no-deps "$wheel"
  rm -rf "$build"
  exit 0
fi
"$PY" -m pip install -q --no-cache-dir --no-deps "$wheel"
