#!/usr/bin/env bash
# Write tests/fixtures/configs/resolved/: each shipped config as `grpo train --check` resolves it
# (tests/configs_cli.rs compares them). Run from the repository root after a change meant to alter what a
# shipped config means, and commit the difference with the change.
set -euo pipefail
cargo build -q
out=tests/fixtures/configs/resolved
rm -rf "$out" && mkdir -p "$out"
find configs -name '*.toml' ! -path 'configs/models/*' ! -path 'configs/devices/*' | sort | while read -r f; do
  name=$(echo "${f#configs/}" | tr / _)
  GRPO_CACHE_DIR=off target/debug/grpo train --config "$f" --check > "$out/$name"
done
echo "wrote $(ls "$out" | wc -l) resolved configs to $out"
