#!/usr/bin/env bash
# Builds and LINKS the `cuda` binary without a GPU and without candle's kernels, checks which shared
# libraries it needs, and starts it: what CI runs so that a library missing at link time, or one the
# binary should not need, fails CI (the first GPU run found that the `cuda` build linked libnccl, which
# a machine with one GPU may not have).
#
# 1. `cargo build --features cuda --bin grpo` (dev profile: most dependencies are already built by
#    `cargo test`) with the stand-in for candle-kernels of scripts/gpu/candle-kernels-stub.sh patched in:
#    candle-kernels' interface, empty PTX and aborting stubs for its statically compiled kernels, which
#    call the CUDA runtime as the real ones do (so the libraries linked are the real build's). Cargo.lock,
#    which the patch rewrites, is put back at the end. The binary has no CUDA kernels: never ship it
#    (scripts/gpu/pack.sh builds the real one, release profile, in target/release).
# 2. The libraries the build scripts put on the link line (cargo's build-script-executed messages), then
#    `readelf -d` (NEEDED) and `ldd` of it, with LD_LIBRARY_PATH = the toolchain's lib folder (CUDA 13's
#    cuBLAS, cuRAND, NVRTC, runtime). Fails when the link asks for libnccl or the binary needs it (loaded at run time by
#    src/dist/nccl_sys.rs, only by a run on several GPUs), when a library other than the driver's
#    libcuda.so.1 is not found, or when one resolves to the toolchain's lib/stubs.
# 3. The binary needs the driver's libcuda.so.1 to start at all (candle-core links the driver API;
#    cudarc's dynamic loading is not available with candle's CUDA backend): on a machine without a driver
#    the start fails naming libcuda.so.1, which is checked. Then, with the toolchain's stub libcuda (its
#    functions answer CUDA_ERROR_STUB_LIBRARY) as libcuda.so.1 for this start only, `grpo --version`,
#    `grpo selftest --device cpu` (every check passes on the CPU) and `grpo selftest --device cuda:0`
#    (a clear error, no crash: no GPU).
#
# Needs the toolchain: source ../shared/scripts/cuda-toolchain.sh first (CUDA_HOME, nvcc).
#   scripts/gpu/link-check.sh            env: CARGO_TARGET_DIR (default target)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -n "${CUDA_HOME:-}" ] && [ -d "$CUDA_HOME/lib" ] || {
    echo "link-check: CUDA_HOME is not set; source ../shared/scripts/cuda-toolchain.sh first" >&2
    exit 2
}
stub=$(scripts/gpu/candle-kernels-stub.sh)
work=$(mktemp -d)
cp Cargo.lock "$work/Cargo.lock"
trap 'cp "$work/Cargo.lock" Cargo.lock; rm -rf "$work"' EXIT

echo "link-check: cargo build --features cuda --bin grpo (candle-kernels stubbed)"
cargo build --features cuda --bin grpo --message-format=json-render-diagnostics \
    --config "patch.crates-io.candle-kernels.path=\"$stub\"" >"$work/build.json"
bin=$(python3 -c 'import json, sys
for l in open(sys.argv[1]):
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "grpo" and m.get("executable"):
        print(m["executable"])' "$work/build.json" | tail -n 1)
[ -x "$bin" ] || { echo "link-check: FAIL: cargo built no grpo binary" >&2; exit 1; }
echo "link-check: linked $bin ($(du -h "$bin" | cut -f1))"

fail=0
# What the build scripts put on the link line. The toolchain has a libnccl.so, so a `-lnccl` would link
# here and still fail on a build machine without NCCL (as the first GPU build did), even when the linker
# then drops it from NEEDED: no build script may ask for it.
linked=$(python3 -c 'import json, sys
for l in open(sys.argv[1]):
    m = json.loads(l)
    if m.get("reason") == "build-script-executed" and m["linked_libs"]:
        print(m["package_id"].split("#")[-1].split(" ")[0], " ".join(m["linked_libs"]))' "$work/build.json")
echo "libraries the build scripts link:"
sed 's/^/  /' <<<"$linked"
if grep -qi nccl <<<"$linked"; then
    echo "link-check: FAIL: the build links libnccl (cudarc's \`nccl\` feature?); NCCL must be loaded at run time"
    fail=1
fi
needed=$(readelf -d "$bin" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
echo "NEEDED: $(echo "$needed" | tr '\n' ' ')"
libs=$CUDA_HOME/lib
echo "ldd (LD_LIBRARY_PATH=$libs):"
LD_LIBRARY_PATH=$libs ldd "$bin" | tee "$work/ldd.txt"
if grep -qi nccl <<<"$needed" || grep -qi nccl "$work/ldd.txt"; then
    echo "link-check: FAIL: the binary needs libnccl; NCCL must be loaded at run time (src/dist/nccl_sys.rs)"
    fail=1
fi
missing=$(awk '/not found/ { print $1 }' "$work/ldd.txt" | grep -vx 'libcuda.so.1' || true)
if [ -n "$missing" ]; then
    echo "link-check: FAIL: not found besides the driver's libcuda.so.1: $missing"
    fail=1
fi
if grep -q "$libs/stubs" "$work/ldd.txt"; then
    echo "link-check: FAIL: a library resolves to the toolchain's link-time stubs ($libs/stubs)"
    fail=1
fi
# What docs/cuda.md says a GPU run needs (libcublasLt through libcublas; NVRTC is linked but left out by
# --as-needed: candle calls none of it).
for lib in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libcudart.so.13; do
    grep -q "^[[:space:]]*$lib " "$work/ldd.txt" || { echo "link-check: FAIL: $lib is not needed: update docs/cuda.md"; fail=1; }
done

# Without a driver the binary does not start, and says which library it lacks.
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda.so.1 '; then
    if LD_LIBRARY_PATH=$libs "$bin" --version >"$work/nodriver.txt" 2>&1; then
        echo "link-check: FAIL: started without libcuda.so.1 (update docs/cuda.md)"
        fail=1
    elif grep -q 'libcuda.so.1' "$work/nodriver.txt"; then
        echo "without a driver: $(cat "$work/nodriver.txt") (expected)"
    else
        echo "link-check: FAIL: without a driver: $(cat "$work/nodriver.txt")"
        fail=1
    fi
fi

# Started with the toolchain's stub as the driver (this start only): the CPU works, a GPU is a clear error.
mkdir -p "$work/driver"
ln -s "$libs/stubs/libcuda.so" "$work/driver/libcuda.so.1"
run() { LD_LIBRARY_PATH="$libs:$work/driver" "$bin" "$@"; }
run --version || fail=1
if run -q selftest --device cpu >"$work/selftest.txt" 2>&1; then
    echo "selftest --device cpu: $(tail -n 1 "$work/selftest.txt")"
else
    cat "$work/selftest.txt"
    echo "link-check: FAIL: grpo selftest --device cpu"
    fail=1
fi
rc=0
run -q selftest --device cuda:0 >"$work/gpu.txt" 2>&1 || rc=$?
if [ "$rc" -ne 0 ] && [ "$rc" -lt 128 ]; then
    echo "selftest --device cuda:0 without a GPU: exit $rc, $(grep -m1 -i error "$work/gpu.txt" || tail -n 1 "$work/gpu.txt")"
else
    cat "$work/gpu.txt"
    echo "link-check: FAIL: grpo selftest --device cuda:0 without a GPU: exit $rc (expected a clear error)"
    fail=1
fi
[ "$fail" -eq 0 ] && echo "link-check: ok"
exit "$fail"
