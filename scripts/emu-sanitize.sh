#!/usr/bin/env bash
# The emulated kernel tests (src/kernels/emu/tests.rs, and each op's own test of its plan on the emulator)
# under ThreadSanitizer and under
# AddressSanitizer + UndefinedBehaviorSanitizer: the emulator and every kernels/*.cu file are compiled with
# the sanitizer (GRPO_EMU_SANITIZE, read by kernels/emu/build_emu.rs) and its runtime is linked into the
# test binary; stable Rust and g++ are enough. Exits non-zero on any sanitizer report or failed test.
#
#   scripts/emu-sanitize.sh            the two sanitizer runs on today's kernels
#   scripts/emu-sanitize.sh --mutate   then each seeded defect, which must be caught:
#     sync    the barrier between a block reduction's writes and reads removed (kernels/common.cuh)
#             -> ThreadSanitizer reports a data race (in the attention softmax, which reduces over blocks)
#     index   rms_norm_fwd writes one element past its row where it goes an element at a time (j <= h,
#             kernels/norm.cu) -> AddressSanitizer reports a heap-buffer-overflow on the last row
#     shared  a launch whose dynamic shared memory is one f32 short of what flash_fwd uses
#             (the test dynamic_shared_memory_one_element_short_is_reported)
#             -> AddressSanitizer reports a heap-buffer-overflow in shared memory
#     argsize rms_norm_fwd declared with a 64-bit `rows` while its launch plan passes a u32
#             -> the emulator's check of each argument against the kernel's signature fails the launch
#   and the warpgroup forward's schedule (kernels/flash_wgmma.cu), each caught by the emulator:
#     wgslot    block j + 2 copied into the slot P_{j-1} V_{j-1} is about to read -> a wgmma reads copies in flight
#     wgpublish a warpgroup's half announced before its copies have landed -> the same, in the other warpgroup
#     wgproxy   the fence.proxy.async before a half is announced left out -> a wgmma reads unfenced copies
#     wgfence   no wgmma.fence naming O before its product -> reported at the product
#     wgacc     O rescaled after its product is issued -> accumulators written while the wgmma runs
#     wgareg    P's A registers rebuilt before the product that reads them has retired
#     wgturn    warpgroup 1 takes one turn too many -> a named barrier left incomplete at the block's end
#
# The mutants are copies of kernels/ in a temporary folder (GRPO_EMU_KERNELS); the tree is not touched.
# Each configuration rebuilds the crate's test binary (the dependencies are reused): minutes, not hours.
set -uo pipefail
cd "$(dirname "$0")/.."

mutate=0
[ "${1:-}" = "--mutate" ] && mutate=1
export TSAN_OPTIONS="halt_on_error=0 exitcode=66 suppressions=$PWD/scripts/emu-tsan.supp ${TSAN_OPTIONS:-}"
export ASAN_OPTIONS="detect_leaks=0 ${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1 ${UBSAN_OPTIONS:-}"
REPORT='ThreadSanitizer|AddressSanitizer|runtime error:'
log=$(mktemp)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp" "$log"' EXIT

# run SANITIZER KERNELS_DIR TEST_FILTER [test args...]: builds the test binary with the sanitizer, then runs
# the emulated tests with the sanitizer's runtime preloaded (it must come first); sets $rc and fills $log.
run() {
  local san=$1 kernels=$2 filter=$3 preload="" part lib
  shift 3
  if ! GRPO_EMU_SANITIZE=$san GRPO_EMU_KERNELS=$kernels cargo test --lib --no-run >"$log" 2>&1; then
    rc=99
    return
  fi
  local bin
  bin=$(grep -Eo 'target/debug/deps/grpo-[0-9a-f]+' "$log" | tail -1)
  for part in ${san//,/ }; do
    case $part in thread) lib=tsan ;; address) lib=asan ;; undefined) lib=ubsan ;; *) continue ;; esac
    preload="$preload${preload:+:}$(g++ -print-file-name=lib$lib.so)"
  done
  LD_PRELOAD=$preload "$bin" "$filter" --test-threads=2 "$@" >"$log" 2>&1
  rc=$?
}

failures=0
clean() {  # clean NAME SANITIZER: today's kernels must pass with no report
  local start=$SECONDS
  # The kernel tests of emu/tests.rs, and those beside each op that run its plan on the emulator.
  run "$2" "" kernels::emu::tests the_cpu_op the_kernel_equals_the_host_update flash_attention::emu_tests \
    --skip dynamic_shared_memory_one_element_short
  local reports
  reports=$(grep -cE "$REPORT" "$log")
  if [ "$rc" -eq 0 ] && [ "$reports" -eq 0 ]; then
    echo "clean    $1: $(grep -E '^test result' "$log" | head -1) ($((SECONDS - start)) s)"
  else
    echo "clean    $1: FAILED (exit $rc, $reports sanitizer lines)"
    grep -E "$REPORT|panicked|FAILED" "$log" | head -20
    failures=$((failures + 1))
  fi
}

caught() {  # caught NAME SANITIZER KERNELS FILTER PATTERN: the mutant must fail with PATTERN in its output
  local start=$SECONDS
  run "$2" "$3" "$4" --exact
  local line
  line=$(grep -m1 -E "$5" "$log")
  if [ "$rc" -ne 0 ] && [ -n "$line" ]; then
    echo "caught   $1 (exit $rc, $((SECONDS - start)) s): $(echo "$line" | sed 's/^ *//' | cut -c1-150)"
  else
    echo "MISSED   $1: exit $rc, no line matching /$5/"
    tail -20 "$log"
    failures=$((failures + 1))
  fi
}

mutant() {  # mutant NAME FILE PYTHON_REPLACEMENT: a copy of kernels/ with one edit, checked to apply
  local dir=$tmp/$1
  mkdir -p "$dir"
  cp kernels/*.cu kernels/*.cuh "$dir"/
  python3 - "$dir/$2" "$3" "$4" <<'EOF' || exit 2
import sys
path, old, new = sys.argv[1], sys.argv[2].encode().decode('unicode_escape'), sys.argv[3].encode().decode('unicode_escape')
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"mutation does not apply to {path}: {old!r} found {text.count(old)} times")
open(path, 'w').write(text.replace(old, new))
EOF
  echo "$dir"
}

echo "== emulated kernel tests under sanitizers ($(g++ --version | head -1))"
clean "ThreadSanitizer" thread
if [ "$mutate" -eq 1 ]; then
  dir=$(mutant sync common.cuh '    if (lane == 0) shared[warp] = v;\n    __syncthreads();' '    if (lane == 0) shared[warp] = v;')
  caught "sync (removed __syncthreads)" thread "$dir" kernels::emu::tests::attn_softmax_fwd \
    'WARNING: ThreadSanitizer: data race'
fi
clean "AddressSanitizer+UBSan" address,undefined
if [ "$mutate" -eq 1 ]; then
  caught "shared (shared memory one f32 short)" address,undefined "" \
    kernels::emu::tests::dynamic_shared_memory_one_element_short_is_reported 'ERROR: AddressSanitizer'
  dir=$(mutant index norm.cu 'for (uint32_t j = packs * N + lane; j < h; j += 32) yr[j]' \
    'for (uint32_t j = packs * N + lane; j <= h; j += 32) yr[j]')
  caught "index (one past the end)" address,undefined "$dir" kernels::emu::tests::rms_norm_fwd \
    'ERROR: AddressSanitizer'
  dir=$(mutant argsize norm.cu 'void rms_norm_fwd_##NAME(const T *x, const T *w, T *y, uint32_t rows' \
    'void rms_norm_fwd_##NAME(const T *x, const T *w, T *y, uint64_t rows')
  caught "argsize (u32 passed for a 64-bit parameter)" address,undefined "$dir" kernels::emu::tests::rms_norm_fwd \
    'the launch passes 4 bytes'
  # wg NAME WHAT OLD NEW PATTERN: a mutant of the warpgroup forward, caught by flash_wgmma_fwd under ASan
  wg() { caught "$1 ($2)" address,undefined "$(mutant "$1" flash_wgmma.cu "$3" "$4")" \
    kernels::emu::tests::flash_wgmma_fwd "$5"; }
  wg wgslot "a slot refilled before its last product" \
    '            if (j + 2 < n) stage(j + 2, ring.after);\n            bar_sync(wg_turn(w), WG_THREADS);' \
    '            if (j + 2 < n) stage(j + 2, ring.last);\n            bar_sync(wg_turn(w), WG_THREADS);' \
    'is still writing'
  wg wgpublish "a half announced before its copies land" \
    '    if (newer) {\n        cp_async_wait<1>();\n    } else {\n        cp_async_wait<0>();\n    }\n    wg_fence_proxy();' \
    '    wg_fence_proxy();' 'is still writing'
  wg wgproxy "no fence.proxy.async" '    wg_fence_proxy();\n    bar_arrive(wg_full' '    bar_arrive(wg_full' \
    'no fence.proxy.async by that thread'
  wg wgfence "no wgmma.fence for O" '            wg_begin(o);\n            wg_acc_by_tile<T, WG_BK, D>(o, pf, slot(ring.last)' \
    '            wg_acc_by_tile<T, WG_BK, D>(o, pf, slot(ring.last)' 'no wgmma.fence since the last wait named'
  wg wgacc "accumulators written in flight" \
    '            rescale_rows<D>(o, alpha);\n            wg_begin(o);\n            wg_acc_by_tile<T, WG_BK, D>(o, pf, slot(ring.last) + WG_BK * D);\n            wg_commit();' \
    '            wg_begin(o);\n            wg_acc_by_tile<T, WG_BK, D>(o, pf, slot(ring.last) + WG_BK * D);\n            wg_commit();\n            rescale_rows<D>(o, alpha);' \
    "wrote a wgmma's accumulators"
  wg wgareg "A registers written in flight" \
    '            wg_wait<0>(o);\n            wg_keep(pf);\n            wg_frags<T, WG_BK>(pf, sc);' \
    '            wg_frags<T, WG_BK>(pf, sc);\n            wg_wait<0>(o);\n            wg_keep(pf);' "wrote a wgmma's A registers"
  wg wgturn "an extra turn" '        if (w == 0) bar_arrive(wg_turn(1), WG_THREADS);  // n + 1 turns each\n        wg_wait<0>(o);' \
    '        bar_arrive(wg_turn(w ^ 1), WG_THREADS);\n        wg_wait<0>(o);' \
    'left with 128 arrivals'
fi
[ "$failures" -eq 0 ] && echo "all clean$([ "$mutate" -eq 1 ] && echo ', every mutant caught')"
exit "$failures"
