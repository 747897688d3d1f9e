#!/usr/bin/env bash
# Build the CUDA binaries on a build machine (no GPU needed) and pack them for scripts/gpu/run.sh:
# gpu-bin/grpo.xz and gpu-bin/cuda_ops.xz (stripped, xz: about 16 MB together, small enough to carry
# to a GPU machine; run.sh unpacks them).
#
#   scripts/gpu/pack.sh            env: CARGO_TARGET_DIR (default target)
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck disable=SC1091
source ../shared/scripts/cuda-toolchain.sh
cargo build --release --features cuda
tests=$(cargo test --release --features cuda --test cuda_ops --no-run --message-format=json \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda_ops" and m.get("executable"):
        print(m["executable"])')
target=${CARGO_TARGET_DIR:-target}
mkdir -p gpu-bin
for pair in "grpo:$target/release/grpo" "cuda_ops:$tests"; do
    name=${pair%%:*}
    strip -o "gpu-bin/$name" "${pair#*:}"
    xz -f -T2 -6 "gpu-bin/$name"
done
ls -la gpu-bin
