#!/usr/bin/env bash
# Builds libgdaki_device.a: gdaki's data path as extern "C" device functions (gdaki_device.h),
# for CUDA C++ compiled with relocatable device code. Needs nvcc, not Rust: the PTX comes from
# gdaki's build (target/ptx/gdaki_device_c.ptx, written whenever the library is built with the
# PTX toolchain of tools/setup.sh).
#
#   tools/cuda/build-device-lib.sh [PTX] [OUT_DIR]
#       PTX      default target/ptx/gdaki_device_c.ptx
#       OUT_DIR  default target/cuda; gets libgdaki_device.a
#   NVCC=path/to/nvcc (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc)
#   GDAKI_CUDA_ARCH=sm_90 (default; any architecture the PTX's target allows, sm_90 or newer)
#
# Then: nvcc -arch=sm_90 -rdc=true -I device/include your.cu -L OUT_DIR -lgdaki_device
set -euo pipefail
ptx=${1:-target/ptx/gdaki_device_c.ptx}
out=${2:-target/cuda}
arch=${GDAKI_CUDA_ARCH:-sm_90}
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
say() { printf 'build-device-lib: %s\n' "$*" >&2; }
[[ -x $nvcc ]] || { say "nvcc not found (install the CUDA toolkit or set NVCC)"; exit 1; }
[[ -s $ptx ]] || { say "$ptx is missing or empty: build gdaki with the PTX toolchain first (tools/setup.sh, cargo build)"; exit 1; }
mkdir -p "$out"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
# nvcc picks the input's kind from its extension.
cp "$ptx" "$work/gdaki_device.ptx"
"$nvcc" -arch="$arch" -dc "$work/gdaki_device.ptx" -o "$work/gdaki_device.o"
"$nvcc" -arch="$arch" -lib "$work/gdaki_device.o" -o "$out/libgdaki_device.a"
say "wrote $out/libgdaki_device.a ($arch)"
