#!/usr/bin/env bash
# Type-checks the Rust side of the `cuda` feature (`cargo check --features cuda --all-targets`) in
# minutes rather than the 43 of a cold build: candle-kernels' build script compiles all of candle's
# kernels with nvcc, which a type-check does not need. The stand-in of scripts/gpu/candle-kernels-stub.sh
# (candle-kernels' own sources, ci/candle-kernels-stub/build.rs as build script) is patched in for this
# check alone (`--config patch.crates-io...`; Cargo.toml is left as it is, and Cargo.lock, which the patch
# rewrites, is put back when the check ends). Its public items are candle-kernels' own, so candle-core's
# CUDA backend and this crate type-check against the real interface.
#
# It then checks that build.rs compiled the project's kernels to PTX for compute capability 8.0 when
# CUDA_COMPUTE_CAP is unset (the README's promise: every GPU from 8.0 on), but kernels/flash_wgmma.cu's
# for sm_90a (wgmma exists there only).
#
# Needs nvcc for build.rs (source ../shared/scripts/cuda-toolchain.sh first) and CUDARC_CUDA_VERSION or
# nvcc for cudarc's build script.
#   scripts/gpu/cuda-typecheck.sh [extra cargo check arguments]
set -euo pipefail
cd "$(dirname "$0")/../.."
stub=$(scripts/gpu/candle-kernels-stub.sh)

log=$(mktemp)
cp Cargo.lock "$stub/Cargo.lock.orig"
trap 'cp "$stub/Cargo.lock.orig" Cargo.lock; rm -f "$log"' EXIT
env -u CUDA_COMPUTE_CAP cargo check --features cuda --all-targets --message-format=json-diagnostic-rendered-ansi \
    --config "patch.crates-io.candle-kernels.path=\"$stub\"" "$@" >"$log" || {
    grep '"rendered"' "$log" | python3 -c 'import json, sys; [print(json.loads(l)["message"]["rendered"]) for l in sys.stdin]'
    exit 1
}
python3 - "$log" <<'PYEOF'
import json, pathlib, sys
out_dirs = []
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-message" and m["message"].get("level") in ("warning", "error"):
        print(m["message"].get("rendered", ""), end="")
    pid = m.get("package_id", "")
    if m.get("reason") == "build-script-executed" and ("#grpo@" in pid or pid.startswith("grpo ")):
        out_dirs.append(m["out_dir"])
if not out_dirs:
    sys.exit("cuda-typecheck: no build-script output of grpo")
ptx = sorted(pathlib.Path(out_dirs[-1]).glob("*.ptx"))
if not ptx:
    sys.exit(f"cuda-typecheck: build.rs wrote no PTX to {out_dirs[-1]}")
for p in ptx:
    target = next((l.split()[1] for l in p.read_text().splitlines() if l.startswith(".target")), None)
    want = "sm_90a" if p.name == "flash_wgmma.ptx" else "sm_80"  # wgmma exists on sm_90a only
    if target != want:
        sys.exit(f"cuda-typecheck: {p.name} targets {target}, expected {want} when CUDA_COMPUTE_CAP is unset")
print(f"cuda-typecheck: ok; build.rs compiled {len(ptx)} kernel files to PTX for sm_80 by default")
PYEOF
