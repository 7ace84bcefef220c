#!/usr/bin/env bash
# Rebuilds libgmm.so from gmm_kernel.cu (one object per variant x layout) + gmm_options.cu.
# Usage: ./build.sh [variant ids...]   (default: all of 1..7 = a..g)
#   env JOBS (default 2), NVCC (default /usr/local/cuda/bin/nvcc),
#       CUTLASS_INC, CUTLASS_UTIL_INC (default: /tmp/cutlass_src/... unpacked from the nvidia-cutlass 4.2 wheel)
set -euo pipefail
cd "$(dirname "$0")"
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
CUTLASS_INC=${CUTLASS_INC:-/tmp/cutlass_src/cutlass_library/source/include}
CUTLASS_UTIL_INC=${CUTLASS_UTIL_INC:-/tmp/cutlass_src/cutlass_library/source/tools/util/include}
JOBS=${JOBS:-2}
VARIANTS=${*:-"1 2 3 4 5 6 7"}
mkdir -p obj logs
FLAGS="-O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DNDEBUG \
  -I$CUTLASS_INC -I$CUTLASS_UTIL_INC -Xcompiler -fPIC -Xptxas -v"
export NVCC FLAGS

compile_one() {  # $1 = variant id, $2 = layout_nn (0/1)
  local o="obj/v$1_nn$2.o" log="logs/v$1_nn$2.log"
  if $NVCC $FLAGS -DGMM_VARIANT_ID=$1 -DGMM_LAYOUT_NN=$2 -c gmm_kernel.cu -o "$o" >"$log" 2>&1; then
    echo "OK   v$1 nn=$2"
  else
    echo "FAIL v$1 nn=$2 (see $log)"; rm -f "$o"
  fi
}
export -f compile_one

jobs_list=""
for v in $VARIANTS; do for l in 0 1; do jobs_list+="$v $l"$'\n'; done; done
printf "%s" "$jobs_list" | xargs -P "$JOBS" -L 1 bash -c 'compile_one "$0" "$1"'

$NVCC $FLAGS -c gmm_options.cu -o obj/options.o > logs/options.log 2>&1
# Link every object that exists (all variants ever built successfully and not removed).
$NVCC -shared -gencode arch=compute_90a,code=sm_90a -Xcompiler -fPIC obj/*.o -o libgmm.so
ls -la libgmm.so
nm -D --defined-only libgmm.so | grep -E ' T gmm_' | awk '{print $3}' | sort
