#!/usr/bin/env bash
# Instructions per block step of the attention kernels, before and after a change, without a GPU: each
# kernel's main loop (one key or query block's step) in the SASS that ptxas compiles from kernels/, for a
# git revision (BEFORE, default HEAD) and for the working tree, the latter twice more with its steps'
# tests forced each way (kernels/flash_rows.cuh: rows_see_all and probs_t's vote on the mask, and
# rescale_rows' vote on the running maxima): `masked` (a diagonal block's step, the mask applied and the
# output rescaled) and `inside` (a step every row sees whole and none of whose rows finds a new maximum,
# most of a long row's steps); `step0` and `step`: such a step as it runs, before and after (`inside` plus
# the instructions of the tests it forced, counted by line info in the unforced tree). Every variant takes
# the copies' aligned path.
# A static count (scripts/gpu/sass_loops.py), not a timing: where a step is bound by issuing instructions
# rather than by the tensor cores, fewer instructions per step is time.
#
#   source ../shared/scripts/cuda-toolchain.sh; scripts/gpu/sass-loops.sh
#
# env: BEFORE (git revision), NVDISASM (default: on PATH, else installed from the nvidia-cuda-nvdisasm
# wheel into $GRPO_CUDA_DIR), KEEP (a folder to keep the listings in).
set -euo pipefail
cd "$(dirname "$0")/../.."
BEFORE=${BEFORE:-HEAD}
NVCC=${CUDA_HOME:+$CUDA_HOME/bin/}nvcc
PTXAS=${CUDA_HOME:+$CUDA_HOME/bin/}ptxas
if [ -z "${NVDISASM:-}" ]; then
    NVDISASM=$(command -v nvdisasm || true)
    dir=${GRPO_CUDA_DIR:-$HOME/.cache/grpo-cuda13}/nvdisasm
    if [ -z "$NVDISASM" ]; then
        [ -x "$dir/nvidia/cu13/bin/nvdisasm" ] || python3 -m pip install -q --no-deps --target "$dir" nvidia-cuda-nvdisasm
        NVDISASM=$dir/nvidia/cu13/bin/nvdisasm
        chmod +x "$NVDISASM"
    fi
fi
work=${KEEP:-$(mktemp -d)}
mkdir -p "$work"
[ -n "${KEEP:-}" ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work/before" "$work/before_inside" "$work/masked" "$work/inside" "$work/after"
for v in before before_inside; do git archive "$BEFORE" kernels | tar -x -C "$work/$v"; done
for v in after masked inside; do cp -r kernels "$work/$v/"; done
keep='if (__all_sync(0xffffffffu, alpha\[0\] == 1.f \&\& alpha\[1\] == 1.f))'
sed -i "s/if (rows_see_all<KB>(x, j0))/if (false)/; s/if (__all_sync(0xffffffffu, inside))/if (false)/; s/$keep/if (false)/" \
    "$work/masked/kernels/flash_rows.cuh"
for v in inside before_inside; do
    sed -i "s/if (rows_see_all<KB>(x, j0))/if (true)/; s/if (__all_sync(0xffffffffu, inside))/if (true)/; s/$keep/if (true)/" \
        "$work/$v/kernels/flash_rows.cuh"
done
# Every variant takes the copies' aligned path (the one a step runs: the inputs are 16-byte aligned), so
# that the unaligned fallback, never run, is not counted in the loop.
for v in before before_inside after masked inside; do
    python3 - "$work/$v/kernels/flash_wgmma.cu" <<'PY'
import sys
p = sys.argv[1]; s = open(p).read()
for test in ["return (((uintptr_t)a | (uintptr_t)b) & 15) == 0;", "const bool aligned = ((uintptr_t)src & 15) == 0;"]:
    s = s.replace(test, "return true;" if test.startswith("return") else "const bool aligned = true;")
open(p, "w").write(s)
PY
done
# Each forced test must have been found: a pattern that no longer matches the source would leave a variant
# equal to `after` without a word.
for v in masked inside before_inside; do
    src=kernels/flash_rows.cuh
    [ "$v" = before_inside ] && src="$work/before/kernels/flash_rows.cuh"
    for test in 'rows_see_all<KB>(x, j0))' '__all_sync(0xffffffffu, inside))' 'alpha[0] == 1.f && alpha[1] == 1.f))'; do
        # (an older BEFORE may lack a test: nothing to force there)
        [ "$v" = before_inside ] && ! grep -qF "$test" "$src" && continue
        if grep -qF "$test" "$work/$v/kernels/flash_rows.cuh" || ! grep -qF "$test" "$src"; then
            echo "sass-loops: the test '$test' of kernels/flash_rows.cuh was not forced in '$v'" >&2
            exit 1
        fi
    done
done
for v in before before_inside after masked inside; do
    for f in flash_wgmma:90a flash_mma:80; do
        name=${f%%:*} arch=${f##*:}
        "$NVCC" --ptx -O3 -std=c++17 -lineinfo -arch=compute_$arch -o "$work/$v/$name.ptx" "$work/$v/kernels/$name.cu" 2>/dev/null
        "$PTXAS" -arch=sm_$arch -lineinfo -o "$work/$v/$name.cubin" "$work/$v/$name.ptx"
        "$NVDISASM" -g "$work/$v/$name.cubin" >"$work/$v/$name.sass"
    done
done
echo "# instructions in each kernel's main loop (one block's step): $BEFORE ($(git rev-parse --short "$BEFORE")), then this tree"
echo "# ($(git describe --always --dirty)); masked / inside: its steps' mask forced on / off; step0 / step: an inside step as"
echo "# it runs (inside, plus its tests' own instructions) before and after; $("$NVCC" --version | tail -1)"
for f in flash_wgmma:90a flash_mma:80; do
    name=${f%%:*} arch=${f##*:}
    kernels=()
    for k in fwd bwd_dq bwd_dkv bwd_dkvq; do for d in 64 128; do kernels+=("${name}_${k}_d${d}_bf16"); done; done
    echo "## $name, sm_$arch"
    scripts/gpu/sass_loops.py "${kernels[@]}" --sass before="$work/before/$name.sass" \
        --sass masked="$work/masked/$name.sass" --sass inside="$work/inside/$name.sass" \
        --step step0="$work/before_inside/$name.sass,$work/before/$name.sass" \
        --step step="$work/inside/$name.sass,$work/after/$name.sass"
done
