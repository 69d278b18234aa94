#!/usr/bin/env bash
# Compiles CUDA C++ kernels that call gdaki's device functions (gdaki_device.h) to PTX with
# clang, with gdaki's data path linked in as LLVM bitcode and inlined into the kernels: no calls
# across the boundary, so a post costs what it costs in a Rust kernel, in about as many registers
# (docs/cuda-cpp.md, "Inlined, with clang"); the functions are marked always-inline in the
# bitcode. The PTX needs nothing else: load it with the driver
# (cuModuleLoadData, or Gpu::load_ptx from Rust). Needs clang 22 (the LLVM of the Rust compiler
# that writes the bitcode; tools/setup.sh installs it), not CUDA: device-only, no CUDA headers,
# with a few lines of its own for the CUDA keywords and built-in variables (threadIdx, ...).
#
#   tools/cuda/clang-kernel.sh IN.cu OUT.ptx [clang arguments...]
#   GDAKI_BITCODE=path   default target/ptx/gdaki_device_c.bc (written by gdaki's build)
#   GDAKI_CUDA_ARCH=sm_90 (default; sm_90 or newer, as the bitcode's target)
#   GDAKI_PTX_VERSION=ptx86 (default; the PTX ISA, as for gdaki's own build; ptx84 for CUDA 12.4
#                        drivers, with doorbell fences that also invalidate the SM's L1)
#   CLANG=path           default clang-22 on PATH
set -euo pipefail
(($# >= 2)) || { echo "usage: tools/cuda/clang-kernel.sh IN.cu OUT.ptx [clang arguments...]" >&2; exit 2; }
in=$1 out=$2; shift 2
here=$(cd "$(dirname "$0")/../.." && pwd)
bc=${GDAKI_BITCODE:-$here/target/ptx/gdaki_device_c.bc}
arch=${GDAKI_CUDA_ARCH:-sm_90}
isa=${GDAKI_PTX_VERSION:-ptx86}
clang=${CLANG:-$(command -v clang-22 || echo clang-22)}
say() { printf 'clang-kernel: %s\n' "$*" >&2; }
command -v "$clang" >/dev/null || { say "$clang not found (tools/setup.sh installs clang-22, or set CLANG)"; exit 1; }
[[ -s $bc ]] || { say "$bc is missing or empty: build gdaki with the PTX toolchain first (tools/setup.sh, cargo build)"; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
# What CUDA's headers would give a device-only compile: the keywords and the built-in variables
# (clang's own header for those).
cat > "$work/cuda_keywords.h" <<'H'
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __host__ __attribute__((host))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __forceinline__ __inline__ __attribute__((always_inline))
#include <__clang_cuda_builtin_vars.h>
H
"$clang" -x cuda --cuda-device-only -nocudainc -nocudalib --cuda-gpu-arch="$arch" \
  -Xclang -target-feature -Xclang "+$isa" -O3 -include "$work/cuda_keywords.h" \
  -I "$here/device/include" \
  -Xclang -mlink-builtin-bitcode -Xclang "$bc" "$@" -S "$in" -o "$out"
say "wrote $out ($arch, gdaki inlined)"
