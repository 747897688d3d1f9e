#!/usr/bin/env bash
# Make HF safetensors weights of SmolLM2-135M-Instruct from the GGUF in ../shared (for tests).
# Output: tests/fixtures/models/smollm2-135m (ignored by git). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
src=../shared/data/models/smollm2-135m-instruct
out=tests/fixtures/models/smollm2-135m
[ -f "$out/model.safetensors" ] && exit 0
py=${PYTHON:-python3}
if ! "$py" -c "import gguf, numpy" 2>/dev/null; then
  "$py" -m pip install -q gguf numpy
fi
mkdir -p "$(dirname "$out")"
"$py" ../shared/scripts/gguf_to_hf.py "$src" "$out.tmp"
rm -rf "$out" && mv "$out.tmp" "$out"
