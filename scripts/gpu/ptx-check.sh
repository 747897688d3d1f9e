#!/usr/bin/env bash
# The project's CUDA kernels (kernels/*.cu) through nvcc and ptxas for the oldest and the newest compute
# capability the README promises (sm_80, sm_90), as build.rs compiles them (`nvcc --ptx -O3 -std=c++17
# -arch=compute_XX`), then `ptxas -v -arch=sm_XX` on each PTX. Fails when any function
#   - spills registers (spill stores or loads above 0 bytes), or uses a stack frame;
#   - uses more static shared memory than a block may have without opting in (48 KiB); the kernels that
#     take dynamic shared memory get at most MAX_DYNAMIC_SMEM more from the host, and static + dynamic must
#     fit too. Which kernels take it is read from the PTX: an entry whose body names an `.extern .shared`
#     array (its `extern __shared__`); a file whose non-inlined `.func`s name one counts all its entries;
#   - needs more registers than a block of its largest size can have (64 Ki 32-bit registers per block:
#     registers x threads, threads = the kernel's __launch_bounds__ (`.maxntid`) or else 1024), which a
#     launch would refuse with "too many resources requested";
# when an entry of kernels/flash_mma.cu has no tensor-core mma.sync instruction (its block products), or
# one of kernels/flash_wgmma.cu no wgmma.mma_async; kernels/flash_wgmma.cu is compiled for sm_90a only (as
# build.rs does: wgmma exists only there) and its kernels opt in to 227 KiB of dynamic shared memory;
# when an element-wise kernel the performance model times as packed has no 16-byte global load or store;
# and when the PTX does not target the architecture asked for (`.target sm_XX`) or uses a PTX ISA newer
# than 9.0 (what driver 580, CUDA 13.0, JIT-compiles).
#
#   scripts/gpu/ptx-check.sh            # nvcc from $CUDA_HOME/bin or PATH (see ../shared/scripts/cuda-toolchain.sh)
#
# env: ARCHS (default "80 90"), SOURCES (default kernels/*.cu), KEEP (a folder to keep the PTX and ptxas
#      logs in).
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${CUDA_HOME:+$CUDA_HOME/bin/}nvcc
PTXAS=${CUDA_HOME:+$CUDA_HOME/bin/}ptxas
ARCHS=${ARCHS:-80 90}
SOURCES=${SOURCES:-kernels/*.cu}
STATIC_SMEM_LIMIT=$((48 << 10))
MAX_DYNAMIC_SMEM=$((48 << 10))
MAX_PTX_ISA=9.0
work=${KEEP:-$(mktemp -d)}
mkdir -p "$work"
[ -n "${KEEP:-}" ] || trap 'rm -rf "$work"' EXIT

# per_entry PTX ARCH ENTRIES EXEMPT INSTRUCTION WHAT: every entry of PTX whose name matches ENTRIES (and not
# EXEMPT) has at least one line matching INSTRUCTION (awk regexes); one line per entry, FAIL where none.
per_entry() {
    awk -v arch="$2" -v entries="$3" -v exempt="$4" -v ins="$5" -v what="$6" '
        /\.entry[[:space:]]/ { match($0, /\.entry[[:space:]]+[A-Za-z0-9_]+/); f = substr($0, RSTART, RLENGTH); sub(/\.entry[[:space:]]+/, "", f)
                               if (f ~ entries) n[f] = 0; else f = ""; next }
        $0 ~ ins && f != "" { n[f]++ }
        END {
            bad = 0
            for (f in n) {
                if (exempt != "^$" && f ~ exempt) { printf "ok   sm_%s %-26s (none expected)\n", arch, f; continue }
                if (n[f] == 0) { printf "FAIL sm_%s %s: no %s\n", arch, f, what; bad = 1 }
                else printf "ok   sm_%s %-26s %4d %s\n", arch, f, n[f], what
            }
            exit bad
        }' "$1" | sort -k3
}

fail=0
for arch in $ARCHS; do
    for src in $SOURCES; do
        stem=$(basename "$src" .cu)
        tarch=$arch dyn_max=$MAX_DYNAMIC_SMEM
        if [ "$stem" = flash_wgmma ]; then
            [ "$arch" = 90 ] || continue
            tarch=90a dyn_max=$((227 << 10))
        fi
        ptx="$work/$stem.sm_$tarch.ptx"
        log="$work/$stem.sm_$tarch.ptxas.txt"
        "$NVCC" --ptx -O3 -std=c++17 "-arch=compute_$tarch" -o "$ptx" "$src"
        "$PTXAS" -v "-arch=sm_$tarch" -o /dev/null "$ptx" >"$log" 2>&1 || { cat "$log"; fail=1; continue; }
        if grep -qE "C751[0-9]|wgmma.mma_async instructions are serialized" "$log"; then
            grep -E "C751[0-9]|serialized" "$log"
            echo "FAIL $src: ptxas serialised wgmma (a register touched inside an asynchronous product, or a product in a divergent path)"
            fail=1
        fi
        target=$(sed -n 's/^\.target[[:space:]]*\([a-z0-9_]*\).*/\1/p' "$ptx")
        if [ "$target" != "sm_$tarch" ]; then
            echo "FAIL $src: PTX targets '$target', expected sm_$tarch"
            fail=1
        fi
        isa=$(sed -n 's/^\.version[[:space:]]*\([0-9.]*\).*/\1/p' "$ptx")
        if ! awk -v a="$isa" -v b="$MAX_PTX_ISA" 'BEGIN { split(a, x, "."); split(b, y, "."); exit !(x[1] < y[1] || (x[1] == y[1] && x[2] <= y[2])) }'; then
            echo "FAIL $src: PTX ISA $isa is newer than $MAX_PTX_ISA (driver 580 cannot JIT it)"
            fail=1
        fi
        # `.maxntid N` of each entry (its __launch_bounds__), else 1024.
        maxntid=$(awk '/\.entry/ { match($0, /\.entry[[:space:]]+[A-Za-z0-9_]+/); f = substr($0, RSTART, RLENGTH); sub(/\.entry[[:space:]]+/, "", f) }
                       /\.maxntid/ && f != "" { n = $2; gsub(/[^0-9]/, "", n); print f, n; f = "" }' "$ptx")
        # The entries that name a dynamic shared-memory array (`.extern .shared ... NAME[]`) in their body.
        dynentries=$(awk '
            /^\.extern[[:space:]]+\.shared/ { s = $NF; sub(/\[\];?$/, "", s); ext[s] = 1; next }
            /\.entry[[:space:]]/ { match($0, /\.entry[[:space:]]+[A-Za-z0-9_]+/); f = substr($0, RSTART, RLENGTH); sub(/\.entry[[:space:]]+/, "", f); infunc = 0; next }
            /\.func[[:space:]]/ { infunc = 1; f = ""; next }
            {
                for (s in ext) if (index($0, s) && match($0, "[^A-Za-z0-9_]" s "([^A-Za-z0-9_]|$)")) {
                    if (infunc) all = 1; else if (f != "") uses[f] = 1
                }
            }
            END { if (all) print "*"; else for (f in uses) print f }' "$ptx")
        # One line per function: name spill-stores spill-loads stack registers static-smem threads.
        awk -v arch="$tarch" -v src="$src" -v smem_limit="$STATIC_SMEM_LIMIT" -v dyn="$dyn_max" \
            -v maxntid="$maxntid" -v dynentries="$dynentries" '
            BEGIN {
                n = split(maxntid, a, /[[:space:]\n]+/); for (i = 1; i + 1 <= n; i += 2) threads[a[i]] = a[i + 1]
                n = split(dynentries, a, /[[:space:]\n]+/); for (i = 1; i <= n; i++) if (a[i] != "") takes_dyn[a[i]] = 1
            }
            /Function properties for/ { f = $NF; gsub(/'"'"'/, "", f) }
            /bytes stack frame/ { stack[f] = $1; st[f] = $5; ld[f] = $9 }
            /Used [0-9]+ registers/ {
                match($0, /Used [0-9]+ registers/); r = substr($0, RSTART + 5, RLENGTH - 15) + 0
                s = 0; if (match($0, /[0-9]+ bytes smem/)) s = substr($0, RSTART, RLENGTH - 11) + 0
                regs[f] = r; smem[f] = s
            }
            END {
                bad = 0
                for (f in stack) {
                    t = (f in threads) ? threads[f] : 1024
                    d = (("*" in takes_dyn) || (f in takes_dyn)) ? dyn : 0
                    msg = ""
                    if (st[f] + 0 > 0 || ld[f] + 0 > 0) msg = msg sprintf(" spills (%s B stores, %s B loads);", st[f], ld[f])
                    if (stack[f] + 0 > 0) msg = msg sprintf(" stack frame of %s B;", stack[f])
                    if (smem[f] > smem_limit || smem[f] + d > (d > smem_limit ? d : smem_limit)) msg = msg sprintf(" shared memory %d B static + %d B dynamic > %d B;", smem[f], d, smem_limit)
                    if (regs[f] * t > 65536) msg = msg sprintf(" %d registers x %d threads > 65536;", regs[f], t)
                    if (msg != "") { printf "FAIL %s sm_%s %s:%s\n", src, arch, f, msg; bad = 1 }
                    else printf "ok   sm_%s %-22s %3d regs x %4d threads, %5d B smem%s\n", arch, f, regs[f], t, smem[f], (d ? sprintf(" + <= %d B dynamic", d) : "")
                }
                exit bad
            }' "$log" | sort -k3 || fail=1
        # The tensor-core kernels' block products are mma instructions, not scalar loops: every entry of
        # flash_mma.cu that computes them has them (all but bwd_prep, which zeroes and writes key spans,
        # bwd_dq_out, which scales and casts dq, and bwd_dkv_sum, which adds the dk/dv kernels' partial sums).
        if [ "$stem" = flash_mma ]; then
            per_entry "$ptx" "$arch" '.' '^flash_mma_bwd_(prep|dq_out|dkv_sum)_' \
                'mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(bf16|f16)' "mma.sync m16n8k16 instructions" || fail=1
        fi
        if [ "$stem" = flash_wgmma ]; then
            per_entry "$ptx" "$tarch" '.' '^$' 'wgmma\.mma_async\.sync\.aligned\.m64n(64|128)k16\.f32\.(bf16|f16)' \
                "wgmma.mma_async m64nNk16 instructions" || fail=1
        fi
        # The element-wise kernels the performance model times at HBM's packed rate (src/cost/time.rs,
        # `packed`: 16 bytes a thread and access, docs/cuda.md "Element-wise kernels") have 16-byte global
        # loads or stores (ld/st.global.v4 of 32-bit words, or v2 of 64-bit ones): a change that loses them
        # would leave them at the one-element rate, a quarter of it, while the model still says 0.80.
        per_entry "$ptx" "$tarch" \
            '^((swiglu_(fwd|bwd)|rms_norm_(fwd|bwd)|rope_(fwd|bwd)|lp_row_(stats|grad)|heads|bias_(add|partial)|row_dot|accumulate|lora_(input|combine))_(f32|bf16|f16)|adamw_f32)$' \
            '^$' '(ld|st)\.global(\.nc)?\.(v4\.(u32|b32|f32)|v2\.(u64|b64|f64))' "16-byte global accesses" || fail=1
    done
done
if [ "$fail" -ne 0 ]; then
    echo "ptx-check: FAILED"
    exit 1
fi
echo "ptx-check: every kernel of kernels/*.cu fits sm_${ARCHS// /, sm_} without spills (flash_wgmma.cu: sm_90a)"
