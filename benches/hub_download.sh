#!/usr/bin/env bash
# Download speed from a local hub: grpo (sha256 checked) against curl, the same 512 MiB file, in the same run
# (tests/hub_cli.rs, download_speed_against_curl). Writes benches/results/hub-download-DATE.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
out="benches/results/hub-download-$(date +%F).txt"
{
  echo "command: cargo test --test hub_cli -- --ignored --nocapture download_speed_against_curl"
  echo "machine: $(nproc) cores, $(uname -sr)"
  cargo test --test hub_cli -- --ignored --nocapture --test-threads 1 download_speed_against_curl 2>&1 \
    | grep -E '^(file|curl|grpo)'
} | tee "$out"
