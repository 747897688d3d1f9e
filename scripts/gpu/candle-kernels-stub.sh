#!/usr/bin/env bash
# Makes the stand-in for candle-kernels that CI's CUDA checks patch in (scripts/gpu/cuda-typecheck.sh,
# scripts/gpu/link-check.sh) and prints its folder: candle-kernels' own sources (the version of
# Cargo.lock, from cargo's registry) in target/candle-kernels-stub, with ci/candle-kernels-stub/build.rs in
# place of its build script (empty PTX strings and aborting stubs for its statically compiled kernels,
# instead of 43 min of nvcc on 2 cores). Its public items are candle-kernels' own, so candle-core's CUDA
# backend and this crate compile against the real interface. Files are only rewritten when they change
# (their times kept), so that cargo does not rebuild candle-core on every call.
#
#   stub=$(scripts/gpu/candle-kernels-stub.sh)
#   cargo ... --config "patch.crates-io.candle-kernels.path=\"$stub\""
set -euo pipefail
cd "$(dirname "$0")/../.."
version=$(awk '/^name = "candle-kernels"$/ { getline; gsub(/[^0-9.]/, ""); print; exit }' Cargo.lock)
[ -n "$version" ] || { echo "candle-kernels-stub: candle-kernels is not in Cargo.lock" >&2; exit 1; }
cargo fetch --quiet
src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"candle-kernels-$version" 2>/dev/null | head -n 1)
[ -n "$src" ] || { echo "candle-kernels-stub: candle-kernels-$version not in cargo's registry" >&2; exit 1; }
stub=$PWD/target/candle-kernels-stub
# A stub of another version is replaced as a whole.
if ! grep -qx "version = \"$version\"" "$stub/Cargo.toml" 2>/dev/null; then
    rm -rf "$stub"
fi
mkdir -p "$stub"
[ -d "$stub/src" ] || cp -rp "$src/src" "$stub/src"
# Copy SRC to DEST unless DEST already has the same content (cp -p: keep the time).
update() { cmp -s "$1" "$2" || cp -p "$1" "$2"; }
# Its manifest without the build dependency (cudaforge) and pointing at the stand-in build script.
manifest=$(mktemp)
awk '/^\[build-dependencies/ { skip = 1; next } /^\[/ { skip = 0 } !skip' "$src/Cargo.toml" \
    | sed 's/^build = .*/build = "build.rs"/' >"$manifest"
touch -r "$src/Cargo.toml" "$manifest"
update "$manifest" "$stub/Cargo.toml"
rm -f "$manifest"
update ci/candle-kernels-stub/build.rs "$stub/build.rs"
echo "$stub"
